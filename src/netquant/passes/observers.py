"""Observers for configs, by name, through netquant.calib's registry."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from netquant.core.spec import QuantSpec
from netquant.errors import ConfigError


def observer_names() -> list[str]:
    """Names the calib registry knows."""
    from netquant.calib import ALIASES, OBSERVERS

    return sorted({*OBSERVERS, *ALIASES})


def make_observer(name: str, spec: QuantSpec, tensor_name: str,
                  options: Mapping[str, Mapping[str, Any]] | None = None) -> Any:
    """A fresh observer `name` for one tensor, with the per-observer `options` applied."""
    from netquant import calib

    opts = dict((options or {}).get(name, {}))
    try:
        return calib.make_observer(name, spec, tensor_name=tensor_name, **opts)
    except TypeError as err:
        raise ConfigError(f"observer '{name}' for tensor '{tensor_name}' does not accept options "
                          f"{sorted(opts)}: {err}") from None
