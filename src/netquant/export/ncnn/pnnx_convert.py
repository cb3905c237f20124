"""FP32 ONNX -> FP32 ncnn (.param + .bin) with pnnx, the converter the ncnn project maintains."""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import onnx

from netquant.errors import ExportError

INSTALL_HINT = "pip install netquant[ncnn]"


def require_engine() -> tuple[object, str]:
    """(the ncnn module, the pnnx executable); ExportError saying what to install when either is missing."""
    try:
        import ncnn
    except ImportError:
        raise ExportError(f"ncnn export needs the ncnn Python package to validate the file: {INSTALL_HINT}") from None
    try:
        import pnnx
    except ImportError:
        raise ExportError(f"ncnn export needs pnnx (ONNX -> ncnn converter): {INSTALL_HINT}") from None
    exe = Path(getattr(pnnx, "EXEC_PATH", ""))
    if not exe.is_file():
        raise ExportError(f"the pnnx package has no converter executable (expected {exe}); reinstall it: "
                          f"{INSTALL_HINT}")
    return ncnn, str(exe)


@dataclass
class Fp32Ncnn:
    """pnnx's ncnn model: param text and weights (float32)."""

    param_text: str
    weights: bytes
    log: str


def ir_version_for_pnnx(model: onnx.ModelProto) -> int:
    """The lowest IR version that holds `model`'s opsets: pnnx's bundled onnxruntime crashes on newer IR versions
    (IR 14 from onnx >= 1.20 segfaults it) although the graph itself needs nothing past its opsets' IR."""
    return min(int(model.ir_version), onnx.helper.find_min_ir_version_for(list(model.opset_import)))


def pnnx_convert(model: onnx.ModelProto, input_shapes: Sequence[Sequence[int]], where: str,
                 timeout_s: float = 600.0) -> Fp32Ncnn:
    """Run pnnx on `model` (saved to a temp folder, IR lowered by `ir_version_for_pnnx`) with fixed input shapes;
    float32 weights (fp16=0)."""
    _, exe = require_engine()
    if model.ir_version != ir_version_for_pnnx(model):
        model = onnx.ModelProto.FromString(model.SerializeToString())
        model.ir_version = ir_version_for_pnnx(model)
    shapes = ",".join("[" + ",".join(str(int(d)) for d in s) + "]" for s in input_shapes)
    with tempfile.TemporaryDirectory(prefix="netquant-pnnx-") as tmp:
        work = Path(tmp)
        src = work / "model.onnx"
        onnx.save(model, str(src))
        outs = {k: work / f"model.{k}" for k in ("pnnxparam", "pnnxbin", "pnnxpy", "pnnxonnx", "ncnnparam",
                                                   "ncnnbin", "ncnnpy")}
        cmd = [exe, str(src), f"inputshape={shapes}", "fp16=0", *(f"{k}={v}" for k, v in outs.items())]
        try:
            proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise ExportError(f"pnnx did not convert '{where}' within {timeout_s:.0f} s") from None
        log = proc.stdout + proc.stderr
        if proc.returncode != 0 or not outs["ncnnparam"].is_file() or not outs["ncnnbin"].is_file():
            tail = "\n".join(log.strip().splitlines()[-8:])
            raise ExportError(f"pnnx could not convert '{where}' to ncnn (exit {proc.returncode}):\n{tail}")
        return Fp32Ncnn(outs["ncnnparam"].read_text(encoding="utf-8"), outs["ncnnbin"].read_bytes(), log)
