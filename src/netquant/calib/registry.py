"""Observers by name, for configs and the CLI: make_observer("kl", spec, num_bins=2048)."""

from __future__ import annotations

import inspect

from netquant.calib.base import Observer
from netquant.calib.fixed import FixedRangeObserver, NoObserver
from netquant.calib.hist_observers import HistL2Observer, KLObserver, MSEObserver, PercentileObserver
from netquant.calib.minmax import EmaMinMaxObserver, MinMaxObserver
from netquant.core.spec import QuantSpec
from netquant.errors import ConfigError

OBSERVERS: dict[str, type[Observer]] = {
    cls.name: cls
    for cls in (MinMaxObserver, EmaMinMaxObserver, PercentileObserver, KLObserver, MSEObserver,
                HistL2Observer, FixedRangeObserver, NoObserver)
}
ALIASES: dict[str, str] = {"entropy": "kl", "max": "minmax", "moving_average": "ema"}


def observer_class(name: str) -> type[Observer]:
    """The observer class registered under `name` (or an alias)."""
    key = ALIASES.get(name, name) if isinstance(name, str) else name
    try:
        return OBSERVERS[key]
    except (KeyError, TypeError):
        valid = ", ".join(sorted(OBSERVERS))
        aliases = ", ".join(f"{a}->{t}" for a, t in sorted(ALIASES.items()))
        raise ConfigError(f"unknown observer {name!r}; valid names: {valid} (aliases: {aliases})") from None


def make_observer(name: str, spec: QuantSpec | None = None, **opts: object) -> Observer:
    """Build the observer `name` for `spec`; unknown names or options raise ConfigError."""
    cls = observer_class(name)
    accepted = _accepted_options(cls)
    unknown = sorted(set(opts) - accepted)
    if unknown:
        raise ConfigError(f"observer {name!r} does not take option(s) {unknown}; it accepts "
                          f"{sorted(accepted)}")
    return cls(spec, **opts)


def _accepted_options(cls: type[Observer]) -> set[str]:
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        for p in inspect.signature(init).parameters.values():
            if p.kind is p.KEYWORD_ONLY:
                names.add(p.name)
    return names
