"""Registry of platforms by name: register_platform / get_platform / list_platforms."""

from __future__ import annotations

from netquant.errors import ConfigError
from netquant.platforms.platform import Platform

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


def get_platform(name: str | Platform) -> Platform:
    """The platform registered under `name` (case-insensitive, '-' == '_'); a Platform passes through."""
    if isinstance(name, Platform):
        return name
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
    """Names of all registered platforms, sorted."""
    return sorted(p.name for p in _PLATFORMS.values())
