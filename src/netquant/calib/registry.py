"""Observers by name, for configs and the CLI: make_observer("kl", spec, num_bins=2048).

Each observer class registers itself with @register_observer("name", aliases=(...)) where it is defined."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TypeVar

from netquant.calib.base import Observer
from netquant.core.spec import QuantSpec
from netquant.errors import ConfigError

ObserverT = TypeVar("ObserverT", bound=type[Observer])

OBSERVERS: dict[str, type[Observer]] = {}  # name -> class, filled by @register_observer
ALIASES: dict[str, str] = {}  # alias -> name


def register_observer(name: str, *, aliases: tuple[str, ...] = ()) -> Callable[[ObserverT], ObserverT]:
    """Class decorator: register an Observer subclass under `name` (also set as its `.name`) and `aliases`.

    The one edit a new observer needs (plus importing its module in netquant.calib when it is a new one).
    ConfigError when a name or alias is taken by another class.
    """

    def register(cls: ObserverT) -> ObserverT:
        if not (isinstance(cls, type) and issubclass(cls, Observer)):
            raise ConfigError(f"register_observer({name!r}) decorates Observer subclasses, got {cls!r}")
        for key in (name, *aliases):
            taken = OBSERVERS.get(ALIASES.get(key, key))
            if taken is not None and taken.__qualname__ != cls.__qualname__:
                raise ConfigError(f"observer name {key!r} is already registered for {taken.__name__}")
        cls.name = name
        OBSERVERS[name] = cls
        ALIASES.update({alias: name for alias in aliases})
        return cls

    return register


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


@functools.cache
def _accepted_options(cls: type[Observer]) -> frozenset[str]:
    """The keyword-only options of the class's __init__ chain (once per class: inspect.signature took 0.04 s of a
    calibration's 129 observers)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        for p in inspect.signature(init).parameters.values():
            if p.kind is p.KEYWORD_ONLY:
                names.add(p.name)
    return frozenset(names)
