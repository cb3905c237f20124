"""OpenVINO: the QDQ model in the form OpenVINO's CPU plugin runs fast, validated by OpenVINO itself, and written
as OpenVINO IR (model.xml + model.bin).

OpenVINO reads ONNX QuantizeLinear / DequantizeLinear as FakeQuantize; its low-precision transformations (LPT)
then run Convolution / MatMul in int8 where FakeQuantize sits on their inputs. Validation compiles the file on
the CPU plugin in a child process (a native crash, e.g. SIGFPE in libopenvino, becomes an ExportError naming the
model), runs the validation batches, and reads the precision every layer of the runtime model executes in.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from netquant.errors import ExportError
from netquant.export.fidelity import DEFAULT_MIN_COSINE, check_vs_fp32, compare_with_fp32
from netquant.export.validate import DEFAULT_MAX_ERROR_RATIO

# layers whose int8 execution decides the speed (runtime-model layer types of the CPU plugin)
HEAVY_LAYER_TYPES = ("Convolution", "GroupConvolution", "Deconvolution", "MatMul", "FullyConnected")
INT8_PRECISIONS = ("i8", "u8")
CHILD_TIMEOUT_S = 600


def openvino_available() -> bool:
    try:
        import openvino  # noqa: F401
    except ImportError:
        return False
    return True


def openvino_version() -> str:
    import openvino as ov

    return ov.get_version().split("-")[0]


# ---- graph form ---------------------------------------------------------------------------------

def _is_hard_sigmoid_1_6(node: onnx.NodeProto) -> bool:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return (node.op_type == "HardSigmoid" and node.domain in ("", "ai.onnx")
            and abs(float(attrs.get("alpha", 0.2)) - 1 / 6) < 1e-6 and abs(float(attrs.get("beta", 0.5)) - 0.5) < 1e-6)


def relu6_hard_sigmoid(model: onnx.ModelProto) -> int:
    """Rewrite every HardSigmoid(x; alpha=1/6, beta=1/2) as Div(Clip(Add(x, 3), 0, 6), 6) in place (the same
    function); returns how many.

    OpenVINO's CPU plugin runs the ONNX HardSigmoid op with a reference kernel outside the convolution, while it
    recognises the ReLU6 form as HSigmoid / HSwish (with the Mul by x) and fuses it into the preceding
    convolution (PP-OCRv4 rec: 69 ms -> 39 ms FP32, 1 thread). netquant's simplify pass writes the HardSigmoid form.
    """
    graph = model.graph
    taken = {t.name for t in graph.initializer} | {o for n in graph.node for o in n.output}
    consts: dict[float, str] = {}

    def const(value: float) -> str:
        if value not in consts:
            name, i = f"netquant_ov_c{value:g}", 0
            while name in taken:
                i += 1
                name = f"netquant_ov_c{value:g}_{i}"
            taken.add(name)
            graph.initializer.append(numpy_helper.from_array(np.array(value, dtype=np.float32), name))
            consts[value] = name
        return consts[value]

    out: list[onnx.NodeProto] = []
    count = 0
    for node in graph.node:
        if not _is_hard_sigmoid_1_6(node):
            out.append(node)
            continue
        x, y, base = node.input[0], node.output[0], node.name or node.output[0]
        shifted, clipped = f"{y}_ov_add3", f"{y}_ov_relu6"
        out += [helper.make_node("Add", [x, const(3.0)], [shifted], name=f"{base}_ov_add"),
                helper.make_node("Clip", [shifted, const(0.0), const(6.0)], [clipped], name=f"{base}_ov_clip"),
                helper.make_node("Div", [clipped, const(6.0)], [y], name=f"{base}_ov_div")]
        count += 1
    if count:
        del graph.node[:]
        graph.node.extend(out)
    return count


def openvino_form(model: onnx.ModelProto) -> onnx.ModelProto:
    """The QDQ model rewritten into the op forms OpenVINO fuses (same function; see relu6_hard_sigmoid)."""
    relu6_hard_sigmoid(model)
    return model


# ---- running in OpenVINO (child process) -------------------------------------------------------

@dataclass
class OpenVinoRun:
    """What one OpenVINO compile-and-run of a model gave."""

    outputs: list[dict[str, np.ndarray]]  # per validation batch: output name -> array
    layers: dict[str, int]  # "layerType:runtimePrecision" -> count, from compiled.get_runtime_model()
    version: str = ""

    @property
    def heavy_layers(self) -> int:
        return sum(n for k, n in self.layers.items() if k.split(":")[0] in HEAVY_LAYER_TYPES)

    @property
    def int8_heavy_layers(self) -> int:
        return sum(n for k, n in self.layers.items()
                   if k.split(":")[0] in HEAVY_LAYER_TYPES and k.split(":")[1] in INT8_PRECISIONS)

    def int8_by_type(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for k, n in sorted(self.layers.items()):
            kind, prec = k.split(":")
            if kind in HEAVY_LAYER_TYPES and prec in INT8_PRECISIONS:
                out[kind] = out.get(kind, 0) + n
        return out


# The child imports only openvino and numpy: it converts (and saves) the model, compiles it on CPU, runs the
# batches and writes outputs + runtime layer precisions. argv: model, feeds.npz, result folder, [ir.xml]
# Telemetry off: openvino.convert_model starts openvino_telemetry, which (without a consent file, as OVC asks for no
# opt-in) sends usage events to Google Analytics over HTTPS and writes ~/intel. Every OVC import of it falls back to
# OpenVINO's own no-op stub on ImportError, which a None entry in sys.modules gives (as if it were not installed).
_CHILD = r"""
import json, sys
sys.modules["openvino_telemetry"] = None
import numpy as np
import openvino as ov
model_path, feeds_path, result, xml = sys.argv[1], sys.argv[2], sys.argv[3], (sys.argv[4:] or [""])[0]
core = ov.Core()
model = ov.convert_model(model_path)
if xml:
    try:
        ov.save_model(model, xml, compress_to_fp16=False)
    except Exception as exc:  # disk full, no permission: the file system, not the model (exit status SAVE_FAILED)
        sys.stderr.write("netquant: cannot save the IR: %s\n" % ((str(exc).strip().splitlines() or [""])[-1]
                                                                or type(exc).__name__))
        sys.exit(3)
    model = core.read_model(xml)
compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": "1",
                                             "NUM_STREAMS": "1"})
layers = {}
for op in compiled.get_runtime_model().get_ordered_ops():
    info = op.get_rt_info()
    key = info["layerType"].astype(str) + ":" + info["runtimePrecision"].astype(str)
    layers[key] = layers.get(key, 0) + 1
feeds = np.load(feeds_path)
names = [o.get_any_name() for o in compiled.outputs]
req = compiled.create_infer_request()
arrays = {}
n = int(feeds["__batches__"])
inputs = [i.get_any_name() for i in compiled.inputs]
for b in range(n):
    got = req.infer({k: feeds[f"{b}:{k}"] for k in inputs})
    for name, port in zip(names, compiled.outputs):
        arrays[f"{b}:{name}"] = np.asarray(got[port])
np.savez(result + "/outputs.npz", **arrays)
with open(result + "/run.json", "w") as f:
    json.dump({"layers": layers, "names": names, "batches": n, "version": ov.get_version()}, f)
"""

_SIGNALS = {4: "SIGILL", 6: "SIGABRT", 7: "SIGBUS", 8: "SIGFPE", 9: "SIGKILL", 11: "SIGSEGV"}


def run_in_openvino(model_path: str | os.PathLike[str], batches: Sequence[dict[str, np.ndarray]], where: str,
                    xml_path: str | os.PathLike[str] | None = None, timeout: float = CHILD_TIMEOUT_S,
                    child_source: str = _CHILD) -> OpenVinoRun:
    """Convert `model_path` (ONNX), optionally save it as IR at `xml_path` (+ .bin beside it) and read that IR
    back, compile on OpenVINO's CPU plugin and run `batches`, all in a child process. ExportError naming `where`
    when the child fails or dies (a native crash such as SIGFPE included)."""
    with tempfile.TemporaryDirectory(prefix="netquant_ov_") as tmp:
        feeds_path = Path(tmp) / "feeds.npz"
        arrays = {f"{b}:{k}": np.ascontiguousarray(v) for b, feeds in enumerate(batches) for k, v in feeds.items()}
        np.savez(feeds_path, __batches__=np.array(len(batches)), **arrays)
        cmd = [sys.executable, "-c", child_source, str(model_path), str(feeds_path), tmp]
        if xml_path is not None:
            cmd.append(str(xml_path))
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                  env={**os.environ, "PYTHONFAULTHANDLER": "1"})
        except subprocess.TimeoutExpired as exc:
            raise ExportError(f"OpenVINO did not finish compiling and running the model for '{where}' within "
                              f"{timeout:.0f} s; no file written") from exc
        if proc.returncode == SAVE_FAILED and xml_path is not None:
            raise ExportError(_save_failure(where, Path(xml_path), proc.stderr))
        if proc.returncode != 0:
            raise ExportError(_child_failure(where, proc.returncode, proc.stderr))
        info = json.loads((Path(tmp) / "run.json").read_text())
        with np.load(Path(tmp) / "outputs.npz") as data:
            outputs = [{n: data[f"{b}:{n}"] for n in info["names"]} for b in range(info["batches"])]
    return OpenVinoRun(outputs=outputs, layers=dict(info["layers"]), version=str(info["version"]).split("-")[0])


SAVE_FAILED = 3  # the child's exit status when ov.save_model cannot write the IR


def _save_failure(where: str, xml: Path, stderr: str) -> str:
    """The message for an IR the child could not write: the folder (its free space), not the model, is at fault."""
    folder = xml.parent
    reason = next((line.split("cannot save the IR:", 1)[1].strip() for line in stderr.splitlines()
                   if "cannot save the IR:" in line), "") or "no message"
    try:
        n = shutil.disk_usage(folder).free
        free = f"; {n / 1e6:.1f} MB free there" if n >= 1e6 else f"; {n / 1e3:.0f} kB free there"
    except OSError:
        free = ""
    return (f"writing OpenVINO IR '{where}' (.xml + .bin) into folder '{folder}' failed (OpenVINO: {reason}{free}); "
            "the model converted fine: free some space or give -o a path on another disk. No file written.")


def _child_failure(where: str, returncode: int, stderr: str) -> str:
    tail = [line for line in stderr.strip().splitlines() if line.strip()][-3:]
    detail = " | ".join(tail)[-600:] or "no message"
    if returncode < 0:
        sig = _SIGNALS.get(-returncode, f"signal {-returncode}")
        return (f"OpenVINO crashed ({sig}) while converting / compiling / running the exported model for '{where}' "
                f"(a native fault inside libopenvino; caught in a child process). This netquant version's "
                "openvino_int8 rules should not produce such graphs: report it with the model. Workarounds: keep "
                "the ops named by the crash in float (--fp32-ops), or export for another platform. No file written.")
    return (f"OpenVINO failed on the exported model for '{where}' (exit status {returncode}): {detail}. "
            "No file written.")


# ---- validation ---------------------------------------------------------------------------------

@dataclass
class OpenVinoCheck:
    """OpenVINO's verdict on an exported model: engine version, runtime layer precisions, agreement."""

    engine: str
    int8_layers: dict[str, int] = field(default_factory=dict)  # heavy layer type -> layers running in i8 / u8
    int8_heavy: int = 0
    heavy: int = 0
    agreement: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, list[np.ndarray]] = field(default_factory=dict)  # per output, one array per batch


class _Recorded:
    """OpenVINO's outputs replayed through the onnxruntime-session interface compare_with_executor takes."""

    def __init__(self, run: OpenVinoRun) -> None:
        self._run, self._next = run, 0

    class _Out:
        def __init__(self, name: str) -> None:
            self.name = name

    def get_outputs(self) -> list[Any]:
        return [self._Out(n) for n in (self._run.outputs[0] if self._run.outputs else {})]

    def run(self, _names: Any, _feeds: Any) -> list[np.ndarray]:
        got = self._run.outputs[self._next]
        self._next += 1
        return list(got.values())


def validate_in_openvino(qgraph: Any, model_path: str | os.PathLike[str], batches: Sequence[dict[str, np.ndarray]],
                         where: str, min_cosine: float, max_error_ratio: float | None,
                         xml_path: str | os.PathLike[str] | None = None) -> OpenVinoCheck:
    """Compile `model_path` in OpenVINO (child process), run `batches`, count int8 heavy layers of the runtime model
    and accept its outputs by the rule used for onnxruntime (validate.Agreement); ExportError otherwise."""
    from netquant.export.validate import compare_with_executor
    from netquant.platforms.targets import host_accumulation

    run = run_in_openvino(model_path, batches, where, xml_path)
    outputs: dict[str, list[np.ndarray]] = {}
    try:
        agreement = compare_with_executor(qgraph, _Recorded(run), batches, where, min_cosine, host_accumulation(),
                                          max_error_ratio, record=outputs)
    except ExportError as exc:
        raise ExportError(str(exc).replace("in onnxruntime", f"in OpenVINO {run.version} (CPU plugin)")
                          .replace("onnxruntime computes", "OpenVINO computes")) from exc
    if batches and not agreement:
        names = list(run.outputs[0]) if run.outputs else []
        raise ExportError(f"exported model for '{where}': OpenVINO's outputs {names} match none of the model's "
                          f"outputs {list(qgraph.graph.output_names)}, so they could not be checked; no file written")
    return OpenVinoCheck(engine=f"OpenVINO {run.version} (CPU plugin, this CPU)", int8_layers=run.int8_by_type(),
                         int8_heavy=run.int8_heavy_layers, heavy=run.heavy_layers, agreement=agreement,
                         outputs=outputs)


# ---- OpenVINO IR --------------------------------------------------------------------------------

def export_openvino(qmodel: Any, path: str | os.PathLike[str], *, bin_path: str | os.PathLike[str] | None = None,
                    opset: int | None = None, validate: bool = True, sample: Any = None, min_cosine: float = 0.98,
                    max_error_ratio: float | None = DEFAULT_MAX_ERROR_RATIO,
                    min_fp32_cosine: float | None = DEFAULT_MIN_COSINE) -> Any:
    """Write `qmodel` as OpenVINO IR: `path` (model.xml) and `bin_path` (default: model.bin beside it), both whole
    or neither.

    The QDQ model (export_qdq's, in OpenVINO's op forms) goes through openvino.convert_model and
    save_model(compress_to_fp16=False) in a child process, which then reads the IR back, compiles it on the CPU
    plugin and runs the validation batches (validate=True: accepted as export_qdq accepts onnxruntime's outputs;
    the report counts the heavy runtime layers running in int8; validate=False still compiles, without batches).
    The .bin is moved into place before the .xml; if that last move fails the new .bin is removed again (an older
    .bin it replaced is gone). OpenVINO's outputs are compared with the FP32 model in onnxruntime (export.fidelity,
    ExportReport.vs_fp32); an output below min_fp32_cosine is refused (None: no check). Needs the openvino package
    (pip install netquant[openvino]); ExportError, and no file, on any failure.
    """
    import time

    from netquant.atomic import new_hidden_file
    from netquant.export.onnx_qdq import ExportReport, build_qdq_model
    from netquant.export.opset import ai_onnx_opset
    from netquant.export.slots import unwrap
    from netquant.export.validate import check_model, check_target_arithmetic, validation_feeds
    from netquant.platforms.targets import host_accumulation

    start = time.perf_counter()
    xml = Path(path)
    weights = Path(bin_path) if bin_path is not None else xml.with_suffix(".bin")
    where = str(xml)
    if xml.suffix.lower() != ".xml":
        raise ExportError(f"OpenVINO IR path '{xml}' must end in .xml (the weights go to a .bin beside it)")
    if not openvino_available():
        raise ExportError(f"cannot write OpenVINO IR '{xml}': the openvino package is not installed "
                          "(pip install 'netquant[openvino]'), or write an .onnx QDQ file, which OpenVINO reads too")
    for p in (xml, weights):
        folder = p.parent if str(p.parent) else Path(".")
        if not folder.is_dir():
            raise ExportError(f"cannot write OpenVINO IR '{p}': folder '{folder}' does not exist")
    qgraph = unwrap(qmodel)
    batches = validation_feeds(qgraph, sample) if validate else []
    vs_fp32 = None
    if validate:
        check_target_arithmetic(qgraph, where)
    model, builder, source = build_qdq_model(qgraph, opset=opset, feeds=batches[0] if batches else None)
    openvino_form(model)
    if validate:
        check_model(model, where)
    tmp_xml = new_hidden_file(xml, ".xml", ExportError, f"cannot write OpenVINO IR '{xml}'")
    tmp_bin = tmp_xml.with_suffix(".bin")
    moved: list[Path] = []
    try:
        with tempfile.TemporaryDirectory(prefix="netquant_ov_") as work:
            onnx_path = Path(work) / "model.onnx"
            onnx.save(model, str(onnx_path))
            if validate:
                check = validate_in_openvino(qgraph, onnx_path, batches, where, min_cosine, max_error_ratio,
                                             xml_path=tmp_xml)
                vs_fp32 = compare_with_fp32(qgraph, check.outputs, batches, check.engine.split(" (")[0],
                                            sample_given=sample is not None)
                check_vs_fp32(vs_fp32, min_fp32_cosine, where)
            else:
                run = run_in_openvino(onnx_path, [], where, xml_path=tmp_xml)
                check = OpenVinoCheck(engine=f"OpenVINO {run.version} (CPU plugin, this CPU)",
                                      int8_layers=run.int8_by_type(), int8_heavy=run.int8_heavy_layers,
                                      heavy=run.heavy_layers)
        if not tmp_bin.is_file() or tmp_xml.stat().st_size == 0:
            raise ExportError(f"OpenVINO wrote no IR pair for '{xml}'; no file written")
        mode = 0o666 & ~_umask()
        for tmp, final in ((tmp_bin, weights), (tmp_xml, xml)):  # the .xml last: readers open it first
            os.chmod(tmp, mode)
            os.replace(tmp, final)
            moved.append(final)
    except BaseException as exc:
        tmp_xml.unlink(missing_ok=True)
        tmp_bin.unlink(missing_ok=True)
        if len(moved) == 1:  # the .bin is in place but the .xml is not: take the .bin back out
            moved[0].unlink(missing_ok=True)
        if isinstance(exc, ExportError) or not isinstance(exc, Exception):
            raise
        raise ExportError(f"writing OpenVINO IR '{xml}' failed, no file written: {type(exc).__name__}: {exc}") from exc
    return ExportReport(
        path=xml, opset=ai_onnx_opset(model), source_opset=source, fp32_bytes=builder.stats.fp32_bytes,
        size_bytes=xml.stat().st_size + weights.stat().st_size,
        quantize_nodes=builder.stats.quantize_nodes, dequantize_nodes=builder.stats.dequantize_nodes,
        integer_initializers=builder.stats.integer_initializers, quantized_ops=builder.stats.quantized_ops,
        validated=validate, validated_with=check.engine if validate else "",
        output_cosine={k: a.ort_vs_fake_quant for k, a in check.agreement.items()},
        output_max_abs_diff={k: a.max_abs_diff for k, a in check.agreement.items()},
        validation_batches=len(batches), accumulation=host_accumulation() if validate else None,
        cpu_target=qgraph.platform.cpu_target.value if qgraph.platform.cpu_target is not None else None,
        engine=check.engine, int8_layers=check.int8_layers, heavy_layers=check.heavy,
        warnings=list(builder.stats.warnings), seconds=time.perf_counter() - start, vs_fp32=vs_fp32)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
