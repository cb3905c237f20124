"""Registry of platforms by name: register_platform / get_platform / list_platforms."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

from netquant.errors import ConfigError
from netquant.platforms.platform import Platform

# the entry-point group through which other packages add platforms: in their pyproject.toml
#   [project.entry-points."netquant.platforms"]
#   my_dsp = "my_package.platforms:MY_DSP"     # a Platform, a list of them, or a function returning either
ENTRY_POINT_GROUP = "netquant.platforms"
_entry_points_loaded = False


class PlatformPluginWarning(UserWarning):
    """An entry point of the netquant.platforms group could not be loaded (the other platforms still are)."""

_PLATFORMS: dict[str, Platform] = {}
# short names people type (and the CLI accepts): alias -> registered name; from each Platform's `aliases`
ALIASES: dict[str, str] = {}


def _key(name: str) -> str:
    return name.strip().lower().replace("-", "_")


def register_platform(platform: Platform, *, overwrite: bool = False) -> Platform:
    """Make `platform` available by name (and by its aliases) to the API and the CLI; returns it."""
    if not isinstance(platform, Platform):
        raise ConfigError(f"register_platform expects a netquant.platforms.Platform, got {type(platform).__name__}")
    key = _key(platform.name)
    if key in _PLATFORMS and not overwrite and _PLATFORMS[key] is not platform:
        raise ConfigError(f"a platform named '{platform.name}' is already registered; "
                          f"pass overwrite=True to replace it")
    _PLATFORMS[key] = platform
    # an alias keeps naming the first platform that claimed it (copies made with Platform.with_ carry the
    # aliases of their source)
    for alias in map(_key, platform.aliases):
        ALIASES.setdefault(alias, key)
    return platform


def unregister_platform(name: str) -> None:
    """Remove a registered platform (no error if absent)."""
    _PLATFORMS.pop(_key(name), None)


def _platforms_of(obj: Any) -> list[Platform]:
    value = obj() if callable(obj) and not isinstance(obj, Platform) else obj
    items = [value] if isinstance(value, Platform) else list(value) if isinstance(value, Iterable) else [value]
    bad = [type(v).__name__ for v in items if not isinstance(v, Platform)]
    if bad:
        raise ConfigError(f"expected a Platform, a list of them or a function returning either, got {', '.join(bad)}")
    return items


def load_entry_point_platforms(*, force: bool = False,
                               entry_points: Callable[..., Any] | None = None) -> list[str]:
    """Register the platforms installed packages declare in the `netquant.platforms` entry-point group (once per
    process; force: again). A failing entry point, or one naming a platform already registered, is skipped with a
    PlatformPluginWarning naming it. Returns the names registered now."""
    global _entry_points_loaded
    if _entry_points_loaded and not force:
        return []
    _entry_points_loaded = True  # first: a plugin may call get_platform while it loads
    if entry_points is None:
        from importlib.metadata import entry_points
    added = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        where = f"entry point '{ep.name} = {ep.value}' (group {ENTRY_POINT_GROUP})"
        try:
            for platform in _platforms_of(ep.load()):
                if _key(platform.name) in _PLATFORMS and _PLATFORMS[_key(platform.name)] is not platform:
                    warnings.warn(PlatformPluginWarning(f"{where}: a platform named '{platform.name}' is already "
                                                        "registered; skipped (rename it in its package)"), stacklevel=2)
                    continue
                register_platform(platform)
                added.append(platform.name)
        except Exception as exc:  # noqa: BLE001 - a broken plugin must not break netquant
            first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
            warnings.warn(PlatformPluginWarning(f"{where} failed to load: {type(exc).__name__}: {first}; its "
                                                "platforms are not available (fix or uninstall that package)"),
                          stacklevel=2)
    return added


def get_platform(name: str | Platform) -> Platform:
    """The platform registered under `name` (case-insensitive, '-' == '_'); a Platform passes through."""
    if isinstance(name, Platform):
        return name
    load_entry_point_platforms()
    if not isinstance(name, str):
        raise ConfigError(f"platform must be a name or a Platform, got {type(name).__name__}")
    key = _key(name)
    if key not in _PLATFORMS and key in ALIASES:
        key = ALIASES[key]
    try:
        return _PLATFORMS[key]
    except KeyError:
        aliases = ", ".join(f"{a}->{t}" for a, t in sorted(ALIASES.items()))
        raise ConfigError(f"unknown platform '{name}'; valid platforms: {', '.join(list_platforms())} "
                          f"(aliases: {aliases})") from None


def list_platforms() -> list[str]:
    """Names of all registered platforms (built in, register_platform, the netquant.platforms entry points), sorted."""
    load_entry_point_platforms()
    return sorted(p.name for p in _PLATFORMS.values())
