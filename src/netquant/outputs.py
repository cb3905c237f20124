"""One output plan per run: every file a run writes, checked before any work and written together at the end.

`OutputPlan.create` resolves each output path and refuses, before anything is computed, an output that is
'-' (netquant writes files, not standard output), a folder or a special file, lies in a folder that is missing
or where no file can be created, is the same file as another output, or is one of the run's inputs (same path
or same inode: a hard link, a symlink; the model, its external data, every calibration file, the placement
file read). A companion file nobody named (OpenVINO's or ncnn's .bin, ncnn's .table, written beside the named
output) that already exists is refused too unless the run may overwrite (`--overwrite`, `overwrite=True`):
it may belong to another model (`-o m.param` after `-o m.xml` would replace the IR's m.bin).
`OutputPlan.staged()` hands out one hidden staging file per output, next to its target; when the block
ends without error they all replace their targets, and on any error (SIGTERM and Ctrl-C included) every
staging file is deleted and no target is touched: a failed run leaves no outputs, a finished one all.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from netquant.atomic import new_hidden_file
from netquant.errors import ConfigError, ExportError, NetquantError

T = TypeVar("T")


@dataclass(frozen=True)
class PlannedOutput:
    """One file the run will write: the option that named it, the path as given and resolved."""

    option: str
    path: Path
    what: str
    named: bool = True  # False: a companion written beside a named output, its path chosen by netquant

    @property
    def resolved(self) -> Path:
        return self.path.resolve()


def model_files(path: str | os.PathLike[str]) -> list[Path]:
    """An ONNX model file plus the external-data files it references (those that exist)."""
    import onnx

    path = Path(path)
    files = [path]
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001 - an unreadable model is reported by the loader, not here
        return files
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    for tensor in model.graph.initializer:
        if uses_external_data(tensor):
            data = path.parent / ExternalDataInfo(tensor).location
            if data not in files and data.is_file():
                files.append(data)
    return files


def absolute(path: str | os.PathLike[str]) -> Path:
    """`path` made absolute against the current folder now (symlinks kept: _same_file compares inodes)."""
    return Path(os.path.abspath(path))


def _same_file(a: Path, b: Path) -> bool:
    if a.resolve() == b.resolve():
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _check_writable_folder(out: PlannedOutput, error: type[NetquantError]) -> None:
    folder = out.path.parent if str(out.path.parent) else Path(".")
    if not folder.is_dir():
        raise error(f"{out.option} '{out.path}': folder '{folder}' does not exist; create it first")
    new_hidden_file(out.path, ".probe", error, f"{out.option} '{out.path}'").unlink()


@dataclass
class OutputPlan:
    """The outputs of one run, checked against each other and against the inputs."""

    outputs: list[PlannedOutput]
    inputs: list[Path] = field(default_factory=list)
    _ids: dict[object, Path] = field(default_factory=dict, repr=False)  # resolved path / (dev, inode) -> input

    @classmethod
    def create(cls, outputs: Sequence[tuple[str, str | os.PathLike[str] | None, str]
                                      | tuple[str, str | os.PathLike[str] | None, str, bool]],
               inputs: Sequence[str | os.PathLike[str]] = (),
               error: type[NetquantError] = ConfigError, *, overwrite: bool = False,
               overwrite_hint: str = "--overwrite") -> OutputPlan:
        """outputs: (option, path or None = not requested, what[, named]); inputs: files the run reads.

        named=False marks a companion whose path netquant chose: refused when it exists unless `overwrite`
        (`overwrite_hint` says how the user allows it). `error` (ConfigError by default) naming the option and
        path for any conflict; nothing is written.
        """
        plan = cls([PlannedOutput(o[0], Path(o[1]), o[2], *o[3:]) for o in outputs if o[1] is not None],
                   [Path(p) for p in inputs])
        for i, out in enumerate(plan.outputs):
            if out.path.name == "-":
                raise error(f"{out.option} '{out.path}': netquant writes files, not standard output ('-'); give a "
                            "file name")
            if out.path.is_dir():
                raise error(f"{out.option} '{out.path}' is a folder; give a file name")
            if out.path.exists() and not out.path.is_file():
                raise error(f"{out.option} '{out.path}' exists and is not a regular file; give another path")
            src = plan._input_at(out.path)
            if src is not None:
                raise error(f"{out.option} '{out.path}' is the input file '{src}'; writing it would destroy the "
                            "input: give another output path")
            if not out.named and out.path.exists() and not overwrite:
                main = plan.outputs[0].path if plan.outputs else out.path
                raise error(f"{out.what} '{out.path}' (written beside '{main}') already exists and this run did "
                            f"not write it: it may belong to another model. Move it away, choose another output "
                            f"name, or pass {overwrite_hint} to replace it")
            for other in plan.outputs[:i]:
                if _same_file(out.path, other.path):
                    raise error(f"{out.option} '{out.path}' and {other.option} '{other.path}' are the same "
                                      "file; one would overwrite the other: give each output its own path")
            _check_writable_folder(out, error)
        return plan

    def _input_at(self, path: Path) -> Path | None:
        """The input that `path` is (same resolved path or same inode), else None."""
        if not self._ids:  # computed once: a calibration folder may hold thousands of files
            for src in reversed(self.inputs):
                self._ids[src.resolve()] = src
                with contextlib.suppress(OSError):
                    st = src.stat()
                    self._ids[(st.st_dev, st.st_ino)] = src
        found = self._ids.get(path.resolve())
        if found is None:
            with contextlib.suppress(OSError):
                st = path.stat()
                found = self._ids.get((st.st_dev, st.st_ino))
        return found

    def path(self, option: str) -> Path | None:
        for out in self.outputs:
            if out.option == option:
                return out.path
        return None

    @contextlib.contextmanager
    def staged(self) -> Iterator[Stage]:
        """A Stage of hidden files next to each target; all replace their targets on success, none on error."""
        stage = Stage(self)
        try:
            yield stage
            stage.commit()
        finally:
            stage.discard()


class Stage:
    """The staging files of an OutputPlan while the run writes them."""

    def __init__(self, plan: OutputPlan) -> None:
        self.plan = plan
        self._tmp: dict[str, Path] = {}

    def _staging_path(self, out: PlannedOutput) -> Path:
        folder = out.path.parent if str(out.path.parent) else Path(".")
        try:  # keep the suffix: writers choose the format by it
            fd, name = tempfile.mkstemp(prefix=f".{out.path.stem}.", suffix=f".stage{out.path.suffix}", dir=folder)
        except OSError as exc:
            raise ExportError(f"cannot write {out.what} '{out.path}': no file can be created in folder "
                              f"'{folder}' ({exc.strerror or exc})") from exc
        os.close(fd)
        os.unlink(name)  # writers create it themselves (atomically)
        return Path(name)

    def write(self, option: str, writer: Callable[[Path], T]) -> T:
        """Run writer(staging path) for the output named by `option`; errors name the real path."""
        out = next((o for o in self.plan.outputs if o.option == option), None)
        if out is None:
            raise ConfigError(f"output {option} is not in this run's output plan")
        tmp = self._tmp[option] = self._staging_path(out)
        try:
            return writer(tmp)
        except NetquantError as exc:
            message = str(exc)
            for staged_option, staged in self._tmp.items():  # this output's and the companions staged before it
                real = next(o.path for o in self.plan.outputs if o.option == staged_option)
                message = message.replace(str(staged), str(real)).replace(staged.name, real.name)
            if message == str(exc):
                raise
            try:
                renamed = type(exc)(message)
            except Exception:  # noqa: BLE001 - an error class with another signature keeps its message
                raise exc from None
            raise renamed from exc

    def commit(self) -> None:
        """Move every staged file onto its target (each an atomic rename)."""
        missing = [o.option for o in self.plan.outputs if o.option not in self._tmp or not self._tmp[o.option].exists()]
        if missing:
            raise ExportError(f"outputs {', '.join(missing)} were planned but not written; no file written")
        done: list[Path] = []
        for out in self.plan.outputs:
            try:
                os.replace(self._tmp.pop(out.option), out.path)
            except OSError as exc:
                written = f"; already written: {', '.join(map(str, done))}" if done else ""
                raise ExportError(f"cannot move {out.what} into place at '{out.path}': {exc}{written}") from exc
            done.append(out.path)

    def discard(self) -> None:
        """Delete every staging file still there (after a failure, or left over after commit)."""
        for tmp in self._tmp.values():
            tmp.unlink(missing_ok=True)
        self._tmp.clear()
