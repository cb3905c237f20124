"""Whole-or-nothing file writes: write a temp file in the target folder, then os.replace.

Every layer writes its files through here, so an interrupted or failed write never leaves a partial
file, and a finished one gets the usual permissions (0666 minus the umask, not mkstemp's 0600).
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from netquant.errors import ExportError, NetquantError


def _file_mode() -> int:
    """0o666 minus the process umask: the mode open() would give a new file."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def new_hidden_file(target: Path, suffix: str, error: type[NetquantError], subject: str) -> Path:
    """Create the empty file `.{target.name}.XXXX{suffix}` beside `target`; `error` ('{subject}: no file can be
    created ...') when the folder refuses it."""
    folder = target.parent if str(target.parent) else Path(".")
    try:
        fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=suffix, dir=folder)
    except OSError as exc:
        raise error(f"{subject}: no file can be created in folder '{folder}' ({exc.strerror or exc}); "
                    "choose a writable folder") from exc
    os.close(fd)
    return Path(name)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], what: str = "file",
                error: type[NetquantError] = ExportError) -> Iterator[Path]:
    """Yield a temp path next to `path`; on success it replaces `path`, on any error it is deleted.

    Errors other than NetquantError are wrapped in `error` naming `path`; `path` itself is never
    left half-written (and an existing file there is kept unchanged on failure).
    """
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        raise error(f"cannot write {what} '{target}': folder '{folder}' does not exist")
    if target.is_dir():
        raise error(f"cannot write {what} '{target}': it is a folder; give a file name")
    tmp = new_hidden_file(target, ".tmp", error, f"cannot write {what} '{target}'")
    try:
        yield tmp
        os.chmod(tmp, _file_mode())
        os.replace(tmp, target)
    except NetquantError:
        tmp.unlink(missing_ok=True)
        raise
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, Exception):
            raise error(f"writing {what} '{target}' failed, no file written: "
                              f"{type(exc).__name__}: {exc}") from exc
        raise


def write_text_atomic(path: str | os.PathLike[str], text: str, what: str = "file",
                      error: type[NetquantError] = ExportError) -> Path:
    """Write `text` (utf-8) to `path` whole or not at all."""
    with atomic_path(path, what, error) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes, what: str = "file",
                       error: type[NetquantError] = ExportError) -> Path:
    """Write `data` to `path` whole or not at all."""
    with atomic_path(path, what, error) as tmp:
        tmp.write_bytes(data)
    return Path(path)


class Terminated(SystemExit):
    """SIGTERM as an exception, so that `finally` blocks and atomic writers clean up their temp files."""


@contextlib.contextmanager
def terminate_cleanly() -> Iterator[None]:
    """Within the block, SIGTERM raises Terminated (exit status 143) instead of killing the process.

    Without it a terminated run leaves its hidden temp files behind; with it they are removed as on
    Ctrl-C.  Outside the main thread (where signal handlers cannot be set) this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise Terminated(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
