"""Checking a .tflite file in LiteRT itself: the interpreter's shapes match the writer's, and over the validation
batches every output is as close to FP32 as netquant's fake-quant run (validate.Agreement)."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from netquant.errors import ExportError
from netquant.export.tflite import layout
from netquant.export.tflite.schema import interpreter_class
from netquant.export.validate import (
    DEFAULT_MAX_ERROR_RATIO,
    Agreement,
    agreement_of,
    refuse_zero_outputs,
    rejected,
)
from netquant.passes.quant_graph import QuantizedGraph

NATIVE_INFO = ("INFO: ",)  # LiteRT's C++ log lines of a normal load ("INFO: Created TensorFlow Lite XNNPACK ...")


@contextlib.contextmanager
def quiet_native_info() -> Iterator[None]:
    """Run the block with file descriptor 2 (C++ stderr) captured: on success its INFO lines are dropped and anything
    else is written back to stderr; on failure everything is written back (real errors stay visible)."""
    sys.stderr.flush()
    saved = os.dup(2)
    ok = False
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
            ok = True
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            lines = captured.read().decode(errors="replace").splitlines(keepends=True)
            kept = [line for line in lines if not ok or not line.startswith(NATIVE_INFO)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def load_interpreter(path: str | Path, where: str, threads: int | None = None) -> Any:
    """A LiteRT Interpreter on `path`, tensors allocated; ExportError naming `where` when LiteRT refuses it. LiteRT's
    INFO lines of a normal load (the XNNPACK delegate) are not printed (quiet_native_info)."""
    cls = interpreter_class()
    try:
        with quiet_native_info():
            interp = cls(model_path=str(path), num_threads=threads)
            interp.allocate_tensors()
    except Exception as exc:
        raise ExportError(f"exported TFLite model for '{where}' does not load in LiteRT: {exc}") from exc
    return interp


def run_interpreter(interp: Any, feeds: dict[str, np.ndarray], input_names: Sequence[str],
                    channels_last: Sequence[bool], where: str) -> list[np.ndarray]:
    """Outputs for `feeds` (ONNX layout, any batch): run in chunks of the file's batch size, 4-D inputs given
    NHWC."""
    details = interp.get_input_details()
    out_details = interp.get_output_details()
    batch = int(details[0]["shape"][0]) if len(details[0]["shape"]) else 1
    total = next(iter(feeds.values())).shape[0] if feeds else 1
    if total % batch:
        raise ExportError(f"TFLite model for '{where}' has batch {batch}; validation batch of {total} does not split")
    outs: list[list[np.ndarray]] = [[] for _ in out_details]
    for start in range(0, total, batch):
        for d, name, cl in zip(details, input_names, channels_last):
            x = np.asarray(feeds[name][start:start + batch], dtype=np.float32)
            interp.set_tensor(d["index"], np.ascontiguousarray(layout.to_stored(x, cl)))
        try:
            interp.invoke()
        except Exception as exc:
            raise ExportError(f"exported TFLite model for '{where}' fails in LiteRT: {exc}") from exc
        for k, d in enumerate(out_details):
            outs[k].append(interp.get_tensor(d["index"]).copy())
    return [np.concatenate(o, axis=0) for o in outs]


def check_shapes(interp: Any, declared: dict[int, tuple[int, ...]], where: str) -> None:
    """Every tensor's shape in LiteRT after allocation equals the shape the writer declared."""
    for d in interp.get_tensor_details():
        want = declared.get(int(d["index"]))
        got = tuple(int(v) for v in d["shape"])
        if want is not None and got != want and len(got) > 0:
            raise ExportError(f"exported TFLite model for '{where}': tensor '{d['name']}' has shape {got} in LiteRT "
                              f"but {want} in the converter (an op was converted wrongly)")


def compare_with_litert(qgraph: QuantizedGraph, interp: Any, batches: Sequence[dict[str, np.ndarray]],
                        input_names: Sequence[str], channels_last: Sequence[bool], output_names: Sequence[str],
                        where: str, min_cosine: float = 0.98,
                        max_error_ratio: float | None = DEFAULT_MAX_ERROR_RATIO,
                        record: dict[str, list[np.ndarray]] | None = None) -> dict[str, Agreement]:
    """Agreement of every output over `batches`: LiteRT vs FP32 and vs the executor's fake-quant run; ExportError
    unless each is accepted. record: filled with LiteRT's outputs, per output name one array per batch."""
    fq_ex = qgraph.executor(fake_quant=True)
    fp_ex = qgraph.executor(fake_quant=False)
    runs: dict[str, dict[str, list[np.ndarray]]] = {n: {"lite": [], "fq": [], "fp": []} for n in output_names}
    for feeds in batches:
        got = run_interpreter(interp, feeds, input_names, channels_last, where)
        tf = {k: torch.from_numpy(np.ascontiguousarray(v).reshape(np.shape(v))) for k, v in feeds.items()}
        with torch.no_grad():
            fq, fp = fq_ex.run(tf), fp_ex.run(tf)
        for name, y in zip(output_names, got):
            ref = fq[name].detach().cpu().numpy()
            if ref.shape != y.shape:
                raise ExportError(f"exported TFLite model for '{where}': output '{name}' has shape {y.shape} in "
                                  f"LiteRT but {ref.shape} in netquant's executor")
            if not np.isfinite(y).all():
                raise ExportError(f"exported TFLite model for '{where}' produces NaN/Inf in output '{name}'")
            runs[name]["lite"].append(y)
            if record is not None:
                record.setdefault(name, []).append(y)
            runs[name]["fq"].append(ref)
            runs[name]["fp"].append(fp[name].detach().cpu().numpy())
    result: dict[str, Agreement] = {}
    for name, e in runs.items():
        result[name] = agreement_of(*(np.concatenate([a.ravel() for a in e[k]]) for k in ("lite", "fq", "fp")))
    refuse_zero_outputs(result, where, "LiteRT")
    detail = rejected(result, min_cosine, max_error_ratio)
    if detail:
        raise ExportError(f"exported TFLite model for '{where}' is farther from FP32 in LiteRT than netquant's "
                          f"fake-quant run over {len(batches)} batch(es): cosine {detail}. Keep the ops named by "
                          "`layer_report` in float (force_fp32 / --fp32-ops), or export with validate=False. "
                          "No file written.")
    return result
