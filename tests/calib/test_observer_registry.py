"""@register_observer: one decorator registers an observer under its name and aliases."""

from __future__ import annotations

import pytest

from netquant.calib import (
    ALIASES,
    OBSERVERS,
    MinMaxObserver,
    make_observer,
    observer_class,
    register_observer,
)
from netquant.core.spec import QuantSpec
from netquant.errors import ConfigError


def test_builtin_names_and_aliases() -> None:
    assert set(OBSERVERS) == {"minmax", "ema", "percentile", "kl", "mse", "hist_l2", "fixed", "none"}
    assert ALIASES == {"entropy": "kl", "max": "minmax", "moving_average": "ema"}
    assert all(cls.name == name for name, cls in OBSERVERS.items())
    assert observer_class("max") is MinMaxObserver


def test_register_a_new_observer() -> None:
    @register_observer("test_half_minmax", aliases=("test_half",))
    class HalfMinMax(MinMaxObserver):
        pass

    try:
        assert HalfMinMax.name == "test_half_minmax"
        assert isinstance(make_observer("test_half", QuantSpec.int8()), HalfMinMax)
        with pytest.raises(ConfigError, match="already registered"):
            register_observer("kl")(HalfMinMax)
    finally:
        OBSERVERS.pop("test_half_minmax", None)
        ALIASES.pop("test_half", None)
