"""Shared CLI helpers."""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import wraps
from typing import Any

from netquant.errors import NetquantError


def friendly_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Show netquant errors as one red line and exit with status 1 (no traceback).

    SIGTERM ends the command like Ctrl-C (status 143), so temp files are removed on the way out.
    """

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from netquant.atomic import terminate_cleanly

        try:
            with terminate_cleanly():
                return fn(*args, **kwargs)
        except NetquantError as exc:
            from rich.console import Console
            from rich.text import Text

            Console(stderr=True, highlight=False, soft_wrap=True).print(
                Text.assemble((f"Error ({type(exc).__name__}): ", "bold red"), str(exc)))
            sys.exit(1)

    return wrapper


def warn(console: Any, message: str) -> None:
    """Print a yellow 'warning:' line; the message is plain text (no rich markup)."""
    from rich.text import Text

    console.print(Text.assemble(("warning: ", "yellow"), message), soft_wrap=True)


def quantize_quietly(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, list[str]]:
    """Call fn, collecting Python warnings instead of printing them raw; returns (result, messages)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args, **kwargs)
    messages = list(dict.fromkeys(str(w.message) for w in caught))
    extra = getattr(result, "warnings", None) or []
    return result, list(dict.fromkeys([*messages, *extra]))
