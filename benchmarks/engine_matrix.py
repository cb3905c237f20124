"""Every platform's file for the PP-OCR classifier and recognizer, run in the engine it is for.

platform x model -> the file `qm.export(path)` writes with the platform's natural suffix, the engine that ran it,
whether it loads, int8 layers / heavy layers as that engine reports them, accuracy vs FP32 (classifier: direction
accuracy; recognizer: exact lines) and latency vs FP32 in the same engine (batch 1, one thread, interleaved rounds).

Engines: onnxruntime (optimized graph: its fused int8 kernels), OpenVINO (compiled for CPU; int8 layers from the
runtime model's runtimePrecision), LiteRT (int8 ops in the .tflite), ncnn (layers with int8_scale_term), and the
Q/DQ reference (onnxruntime with graph optimizations off: Q/DQ as ONNX defines them) for engines that do not run
here (TensorRT, QNN) and for the FP8 / academic / power-of-two schemes. Each engine's runner is one small function
below; an engine that is not installed or a writer netquant does not have yet is reported as such.

    python benchmarks/engine_matrix.py [--calib 64] [--eval 200] [--platforms a,b] [--models cls,rec]

Writes benchmarks/results/engine_matrix.md and prints it.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from netquant.analysis.timing import interleaved_ms

RESULTS = Path(__file__).parent / "results" / "engine_matrix.md"  # cells also kept as .json (for --update)
CALIB_SEED, EVAL_SEED = 1000, 2000

Runner = Callable[[np.ndarray], np.ndarray]  # one batch-1 input -> the model's first output


@dataclass
class Loaded:
    """A file loaded in an engine: how to run one sample, and its int8 / heavy layer counts."""

    run: Runner
    int8_layers: int | None = None
    heavy_layers: int | None = None
    note: str = ""


@dataclass
class Engine:
    """One engine: its name, whether it installs here, and how it loads a file (FP32 baseline too)."""

    name: str
    load: Callable[[Path, tuple[int, ...]], Loaded]  # (file, batch-1 input shape) -> Loaded
    module: str | None = None  # the import that must work
    fp32_file: Callable[[Path, Path, tuple[int, ...]], Path | None] | None = None  # FP32 ONNX -> this engine's file

    def available(self) -> bool:
        if self.module is None:
            return True
        try:
            __import__(self.module)
        except ImportError:
            return False
        return True


@dataclass
class Cell:
    """One platform x model result."""

    platform: str
    model: str
    suffix: str = ""
    file: str = "-"
    engine: str = "-"
    loads: str = "-"
    int8: str = "-"
    accuracy: str = "-"
    fp32_accuracy: str = "-"
    delta: str = "-"
    latency: str = "-"
    speed: str = "-"
    notes: list[str] = field(default_factory=list)


# ---- engines ------------------------------------------------------------------------------------------------

ORT_HEAVY_FLOAT = {"Conv", "FusedConv", "NchwcConv", "MatMul", "FusedMatMul", "Gemm", "FusedGemm", "ConvTranspose"}
ORT_HEAVY_INT8 = {"QLinearConv", "NhwcQLinearConv", "ConvInteger", "QLinearMatMul", "MatMulInteger",
                  "MatMulIntegerToFloat", "QGemm", "DynamicQuantizeMatMul", "QLinearConvTranspose"}


def _ort_session(path: Path, optimized: bool) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = 1, 1, 3
    if not optimized:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _ort_runner(sess: Any) -> Runner:
    name = sess.get_inputs()[0].name
    return lambda x: sess.run(None, {name: x})[0]


def load_onnxruntime(path: Path, shape: tuple[int, ...]) -> Loaded:
    """onnxruntime's optimized graph: heavy layers counted from the op types it really runs (ort_kernels)."""
    from netquant.export.ort_kernels import ort_optimized_op_types

    counts = ort_optimized_op_types(path)
    int8 = sum(n for op, n in counts.items() if op in ORT_HEAVY_INT8)
    heavy = int8 + sum(n for op, n in counts.items() if op in ORT_HEAVY_FLOAT)
    return Loaded(_ort_runner(_ort_session(path, optimized=True)), int8, heavy)


def load_reference(path: Path, shape: tuple[int, ...]) -> Loaded:
    """Q/DQ as ONNX defines them (onnxruntime, optimizations off); int8 layers: heavy ops fed by DequantizeLinear."""
    import onnx

    model = onnx.load(str(path))
    producer = {o: n.op_type for n in model.graph.node for o in n.output}
    heavy = [n for n in model.graph.node if n.op_type in ("Conv", "MatMul", "Gemm", "ConvTranspose")]
    quantized = sum(1 for n in heavy if producer.get(n.input[0]) == "DequantizeLinear"
                    and len(n.input) > 1 and producer.get(n.input[1]) == "DequantizeLinear")
    return Loaded(_ort_runner(_ort_session(path, optimized=False)), quantized, len(heavy),
                  "low-precision layers in the file (Q/DQ on input and weight)")


OV_HEAVY = {"Convolution", "GroupConvolution", "FullyConnected", "MatMul", "Deconvolution", "GemmIE"}


def _ov_str(value: Any) -> str:
    try:
        return str(value.astype(str))
    except Exception:  # noqa: BLE001 - OVAny of another version
        return str(value)


def load_openvino(path: Path, shape: tuple[int, ...]) -> Loaded:
    """OpenVINO CPU, one thread; int8 layers: heavy layers whose runtimePrecision is i8 / u8."""
    import openvino as ov

    core = ov.Core()
    model = core.read_model(str(path))
    model.reshape(list(shape))  # static shapes, as an application compiles them
    compiled = core.compile_model(model, "CPU",
                                  {"INFERENCE_NUM_THREADS": 1, "NUM_STREAMS": 1, "INFERENCE_PRECISION_HINT": "f32"})
    int8 = heavy = 0
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        if _ov_str(info["layerType"]) in OV_HEAVY:
            heavy += 1
            int8 += _ov_str(info["runtimePrecision"]).lower() in ("i8", "u8")
    request = compiled.create_infer_request()
    return Loaded(lambda x: np.asarray(request.infer([x])[compiled.output(0)]).copy(), int8, heavy)


TFLITE_HEAVY = {"CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED", "BATCH_MATMUL", "TRANSPOSE_CONV"}


def load_litert(path: Path, shape: tuple[int, ...]) -> Loaded:
    """LiteRT interpreter, one thread; int8 layers: heavy ops whose first input is int8 in the .tflite."""
    from ai_edge_litert.interpreter import Interpreter

    interp = Interpreter(model_path=str(path), num_threads=1)
    interp.allocate_tensors()
    inp, out = interp.get_input_details()[0], interp.get_output_details()[0]
    dtypes = {t["index"]: t["dtype"] for t in interp.get_tensor_details()}
    ops = interp._get_ops_details()  # noqa: SLF001 - the only op listing LiteRT's Python API has
    heavy_ops = [op for op in ops if op["op_name"] in TFLITE_HEAVY]
    int8 = sum(1 for op in heavy_ops if op["inputs"].size and dtypes.get(int(op["inputs"][0])) == np.int8)
    int8_ops = sum(1 for op in ops if op["inputs"].size and dtypes.get(int(op["inputs"][0])) == np.int8)

    def run(x: np.ndarray) -> np.ndarray:
        if len(inp["shape"]) == 4 and inp["shape"][-1] == x.shape[1] and x.shape[1] != x.shape[-1]:
            x = x.transpose(0, 2, 3, 1)  # NCHW -> NHWC
        if tuple(inp["shape"]) != x.shape:
            interp.resize_tensor_input(inp["index"], list(x.shape))
            interp.allocate_tensors()
        scale, zp = inp["quantization"]
        if inp["dtype"] != np.float32:
            x = np.clip(np.round(x / scale) + zp, np.iinfo(inp["dtype"]).min, np.iinfo(inp["dtype"]).max)
        interp.set_tensor(inp["index"], x.astype(inp["dtype"]))
        interp.invoke()
        y = interp.get_tensor(out["index"])
        scale, zp = out["quantization"]
        return (y.astype(np.float32) - zp) * scale if out["dtype"] != np.float32 else y

    return Loaded(run, int8, len(heavy_ops), f"{int8_ops}/{len(ops)} ops with int8 input")


NCNN_INT8_PARAM = {"Convolution": "8", "ConvolutionDepthWise": "8", "InnerProduct": "8", "Gemm": "18"}
NCNN_HEAVY = {*NCNN_INT8_PARAM, "MatMul", "Deconvolution", "DeconvolutionDepthWise"}


def _ncnn_layers(param: Path) -> list[tuple[str, list[str], list[str], dict[str, str]]]:
    """(type, bottoms, tops, params) of every layer of an ncnn .param file."""
    lines = param.read_text().split("\n")
    layers = []
    for line in lines[2:]:
        parts = line.split()
        if len(parts) < 4:
            continue
        kind, nin, nout = parts[0], int(parts[2]), int(parts[3])
        bottoms, tops = parts[4:4 + nin], parts[4 + nin:4 + nin + nout]
        params = dict(p.split("=", 1) for p in parts[4 + nin + nout:] if "=" in p)
        layers.append((kind, bottoms, tops, params))
    return layers


def load_ncnn(path: Path, shape: tuple[int, ...]) -> Loaded:
    """ncnn, one thread, int8 inference on; int8 layers: heavy layers with int8_scale_term set in the .param."""
    import ncnn

    layers = _ncnn_layers(path)
    inputs = [t for kind, _, tops, _ in layers if kind == "Input" for t in tops]
    consumed = {b for _, bottoms, _, _ in layers for b in bottoms}
    outputs = [t for _, _, tops, _ in layers for t in tops if t not in consumed]
    heavy = [(k, p) for k, _, _, p in layers if k in NCNN_HEAVY]
    int8 = sum(1 for k, p in heavy if k in NCNN_INT8_PARAM and p.get(NCNN_INT8_PARAM[k], "0") not in ("0", ""))
    net = ncnn.Net()
    net.opt.num_threads = 1
    net.opt.use_int8_inference = True
    if net.load_param(str(path)) != 0 or net.load_model(str(path.with_suffix(".bin"))) != 0:
        raise RuntimeError(f"ncnn cannot load {path.name} / {path.with_suffix('.bin').name}")

    def run(x: np.ndarray) -> np.ndarray:
        ex = net.create_extractor()
        ex.input(inputs[0], ncnn.Mat(np.ascontiguousarray(x[0])))
        ret, y = ex.extract(outputs[0])
        if ret != 0:
            raise RuntimeError(f"ncnn extract '{outputs[0]}' returned {ret}")
        return np.array(y)[None]

    return Loaded(run, int8, len(heavy))


def ncnn_fp32(onnx_path: Path, work: Path, shape: tuple[int, ...]) -> Path | None:
    """The FP32 model as ncnn .param / .bin, converted by pnnx (None when pnnx fails)."""
    src = work / f"fp32_{onnx_path.stem}.onnx"
    shutil.copy(onnx_path, src)
    exe = shutil.which("pnnx") or str(Path(sys.executable).parent / "pnnx")
    try:
        subprocess.run([exe, str(src), f"inputshape=[{','.join(map(str, shape))}]"], cwd=work, check=True,
                       capture_output=True, timeout=300)
    except Exception:  # noqa: BLE001 - no baseline is a result too
        return None
    param = src.with_suffix(".ncnn.param")
    return param if param.exists() else None


def _same_file(onnx_path: Path, work: Path, shape: tuple[int, ...]) -> Path:
    return onnx_path


ENGINES = {
    "onnxruntime": Engine("onnxruntime (optimized, this CPU)", load_onnxruntime, "onnxruntime", _same_file),
    "reference": Engine("Q/DQ reference (onnxruntime, optimizations off)", load_reference, "onnxruntime", _same_file),
    "openvino": Engine("OpenVINO CPU", load_openvino, "openvino", _same_file),
    "litert": Engine("LiteRT", load_litert, "ai_edge_litert"),
    "ncnn": Engine("ncnn", load_ncnn, "ncnn", ncnn_fp32),
}

# platform -> (natural file suffix, engine); rows run in this order. The ".onnx read by OpenVINO" row checks the
# QDQ file OpenVINO also reads, until the .xml writer is there.
PLATFORMS: list[tuple[str, str, str]] = [
    ("onnxruntime_int8", ".onnx", "onnxruntime"),
    ("openvino_int8", ".xml", "openvino"),
    ("openvino_int8", ".onnx", "openvino"),
    ("tflite_int8", ".tflite", "litert"),
    ("ncnn_int8", ".param", "ncnn"),
    ("tensorrt_int8", ".onnx", "reference"),
    ("qnn_dsp", ".onnx", "reference"),
    ("fp8_e4m3", ".onnx", "reference"),
    ("academic_int8", ".onnx", "reference"),
    ("academic_int4", ".onnx", "reference"),
    ("pow2_int8", ".onnx", "reference"),
]


def written_kind(path: Path) -> str:
    """What the file at `path` really is: 'onnx', 'openvino-ir', 'tflite', 'ncnn-param' or 'unknown'."""
    head = path.read_bytes()[:64]
    if head.lstrip().startswith((b"<?xml", b"<net")):
        return "openvino-ir"
    if head[4:8] == b"TFL3":
        return "tflite"
    if head.split(b"\n", 1)[0].strip() == b"7767517":
        return "ncnn-param"
    try:
        import onnx

        onnx.load(str(path), load_external_data=False)
        return "onnx"
    except Exception:  # noqa: BLE001
        return "unknown"


EXPECTED_KIND = {".onnx": "onnx", ".xml": "openvino-ir", ".tflite": "tflite", ".param": "ncnn-param"}


# ---- measuring -------------------------------------------------------------------------------------------------

def interleaved_runs_ms(runners: list[Runner], x1: np.ndarray, repeats: int, rounds: int = 5) -> list[float]:
    """Median batch-1 latency of each runner; the runners alternate in `rounds` so load changes hit all alike."""
    return interleaved_ms([functools.partial(run, x1) for run in runners], per_round=repeats // rounds, rounds=rounds,
                          warmup=2)


def outputs_of(run: Runner, x: np.ndarray) -> np.ndarray:
    return np.concatenate([run(x[i:i + 1]) for i in range(len(x))])


def in_child(fn: Callable[[], dict[str, Any]], timeout: float = 900) -> dict[str, Any]:
    """fn() in a forked process (an engine that crashes, e.g. SIGFPE in a compiler, takes only the child down)."""
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)

    def target() -> None:
        try:
            child.send(fn())
        except BaseException as exc:  # noqa: BLE001 - reported in the table
            child.send({"error": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}",
                        "trace": traceback.format_exc()[-2000:]})

    proc = ctx.Process(target=target)
    proc.start()
    result, deadline = None, time.monotonic() + timeout
    while time.monotonic() < deadline:  # (the kill below only ends a child that is still running)
        if parent.poll(1.0):
            result = parent.recv()
            break
        if not proc.is_alive() and not parent.poll(0):
            break  # died without a word (a signal in the engine)
    proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join()
    if result is None and time.monotonic() >= deadline:
        return {"error": f"timed out after {timeout:.0f} s"}
    if result is None:
        code = proc.exitcode
        return {"error": f"crashed ({'signal ' + str(-code) if code < 0 else 'exit code ' + str(code)})"
                         if code else "timed out"}
    return result


@dataclass
class Task:
    """One model: its FP32 file, calibration batches, evaluation inputs and scorer."""

    name: str
    fp32: Path
    calib: list[dict[str, np.ndarray]]
    x_eval: np.ndarray
    score: Callable[[np.ndarray], float]
    shape: tuple[int, ...]


def make_tasks(models: list[str], n_calib: int, n_eval: int) -> list[Task]:
    from netquant.api import zoo
    from netquant.data.ocr import cls_batch, ctc_greedy_decode, direction_samples, rec_batch, score_lines
    from netquant.data.text_render import make_text_lines

    calib_lines, eval_lines = make_text_lines(n_calib, seed=CALIB_SEED), make_text_lines(n_eval, seed=EVAL_SEED)
    tasks = []
    if "cls" in models:
        cd, ed = direction_samples(calib_lines), direction_samples(eval_lines)
        xc, xe = cls_batch([s.image for s in cd]), cls_batch([s.image for s in ed])
        labels = np.array([s.label for s in ed])
        tasks.append(Task("cls", zoo.ppocr_model_path("cls"), [{"x": xc[i:i + 8]} for i in range(0, len(xc), 8)],
                          xe, lambda p: float((p.reshape(len(labels), -1).argmax(1) == labels).mean()),
                          (1, *xe.shape[1:])))
    if "rec" in models:
        xc, xe = rec_batch(calib_lines), rec_batch(eval_lines)
        truth, dictionary = [line.text for line in eval_lines], zoo.ppocr_rec_dictionary()
        tasks.append(Task("rec", zoo.ppocr_model_path("rec"), [{"x": xc[i:i + 8]} for i in range(0, len(xc), 8)],
                          xe, lambda p: score_lines(ctc_greedy_decode(p, dictionary), truth).line_acc,
                          (1, *xe.shape[1:])))
    return tasks


def export_file(qm: Any, path: Path) -> tuple[str, list[str]]:
    """qm.export(path) as a user would; when validation refuses the file, once more without it (noted).

    Returns the file status ('yes', 'yes (unvalidated)', 'no: ...' or 'not available (exporter missing)') and notes.
    """
    notes: list[str] = []
    status = "yes"
    try:
        report = qm.export(path)
        validated_with = getattr(report, "validated_with", "")
        if validated_with:
            notes.append(f"validated in {validated_with}")
    except Exception as exc:  # noqa: BLE001 - a refused file is a result
        message = (str(exc).splitlines() or [""])[0]
        notes.append(f"export refused: {message[:220]}")
        try:
            qm.export(path, validate=False)
            status = "yes (validate=False)"
        except Exception as exc2:  # noqa: BLE001
            return f"no: {type(exc2).__name__}: {(str(exc2).splitlines() or [''])[0][:160]}", notes
    if not path.exists():
        return "no: nothing written", notes
    kind = written_kind(path)
    if kind != EXPECTED_KIND[path.suffix]:
        return "not available (exporter missing)", [f"qm.export wrote {kind}, not {EXPECTED_KIND[path.suffix]}"]
    return status, notes


def placement_note(qm: Any) -> str | None:
    """'placement: N region(s) kept float (...)' when placement floated regions (and 'M in <the platform's wider
    format>' when it widened some), None otherwise."""
    placement = getattr(qm, "placement", None)
    anchors = list(placement.float_anchors()) if placement is not None and hasattr(placement, "float_anchors") else []
    wide = list(placement.wider_anchors()) if placement is not None and hasattr(placement, "wider_anchors") else []
    if not anchors and not wide:
        return None
    shown = ", ".join(anchors[:4]) + (", ..." if len(anchors) > 4 else "")
    parts = [f"{len(anchors)} region(s) kept float ({shown})"] if anchors else []
    if wide:
        label = next((r.wider_format for r in placement.regions if r.wider_format), "the wider format")
        parts.append(f"{len(wide)} of {len(placement.regions)} region(s) in {label}")
    return "placement: " + "; ".join(parts)


def measure(task: Task, platform: str, suffix: str, engine_key: str, work: Path, fp32_cache: dict[str, Any],
            repeats: int, placement: bool = True) -> Cell:
    import netquant

    engine = ENGINES[engine_key]
    cell = Cell(platform, task.name, suffix, engine=engine.name)
    if not engine.available():
        cell.loads = f"not available ({engine.module} not installed)"
        return cell
    path = work / f"{task.name}_{platform}{suffix}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        settings: dict[str, Any] = {} if placement else {"objective": None}
        qm = netquant.quantize_onnx(str(task.fp32), task.calib, platform=platform, quiet=True, **settings)
    if not placement:
        cell.notes.append("placement off (objective=None: the platform's defaults alone)")
    elif (note := placement_note(qm)) is not None:
        cell.notes.append(note)
    status, notes = export_file(qm, path)
    cell.notes += notes
    cell.file = f"{suffix}: {status}"
    if not status.startswith("yes"):
        return cell
    key = f"{engine_key}/{task.name}"
    if key not in fp32_cache:
        fp32_cache[key] = engine.fp32_file(task.fp32, work, task.shape) if engine.fp32_file else None

    def run_cell() -> dict[str, Any]:
        loaded = engine.load(path, task.shape)
        acc = task.score(outputs_of(loaded.run, task.x_eval))
        out: dict[str, Any] = {"acc": acc, "int8": loaded.int8_layers, "heavy": loaded.heavy_layers,
                               "note": loaded.note}
        base_path = fp32_cache[key]
        if base_path is not None:
            base = engine.load(base_path, task.shape)
            out["fp32_acc"] = task.score(outputs_of(base.run, task.x_eval))
            if engine_key != "reference":
                out["lat"] = interleaved_runs_ms([base.run, loaded.run], task.x_eval[:1], repeats)
        return out

    res = in_child(run_cell)
    if "error" in res:
        cell.loads = f"no: {res['error']}"
        return cell
    cell.loads = "yes"
    cell.int8 = f"{res['int8']} / {res['heavy']}" + (f" ({res['note']})" if res["note"] else "")
    cell.accuracy = f"{100 * res['acc']:.2f}"
    if "fp32_acc" in res:
        cell.fp32_accuracy = f"{100 * res['fp32_acc']:.2f}"
        cell.delta = f"{100 * (res['acc'] - res['fp32_acc']):+.2f}"
    else:
        cell.notes.append("no FP32 model in this engine")
    if "lat" in res:
        fp, q = res["lat"]
        cell.latency, cell.speed = f"{q:.2f} (FP32 {fp:.2f})", f"{fp / q:.2f}x"
    elif engine_key == "reference":
        cell.latency = "- (reference semantics, not an engine)"
    return cell


def render(cells: list[Cell], args: argparse.Namespace, seconds: float) -> str:
    from netquant.platforms.targets import host_info

    header = ("| platform | model | file written | engine | loads | int8 layers / heavy layers | accuracy % | "
              "FP32 % (same engine) | delta | latency ms b1 1 thread | speed vs FP32 | notes |")
    lines = [
        "# Engine matrix: every platform's file in the engine it is for (PP-OCR classifier and recognizer)",
        "",
        host_info(torch_threads=None, ort_threads=1).markdown(),
        f"Calibration: {args.calib} rendered text lines (seed {CALIB_SEED}); evaluation: {args.eval} other lines "
        f"(seed {EVAL_SEED}); classifier: the same lines, every other one rotated 180 degrees (accuracy = "
        "direction accuracy), recognizer: exact-line accuracy. Each file is written by `qm.export(path)` with the "
        "platform's natural suffix; a file the export's validation refuses is written again with validate=False "
        "and measured (noted). Accuracy and latency run in the named engine, one thread; latency is the median of "
        "interleaved rounds against the FP32 model in the same engine on a machine shared with other jobs. "
        "'Q/DQ reference' is onnxruntime with graph optimizations off: Q/DQ as ONNX defines them, the semantics "
        "TensorRT / QNN files are checked in here (those engines do not run on this machine). "
        f"Last run time {seconds / 60:.1f} min" + (" (rows of earlier runs kept: --update)." if args.update else "."),
        "",
        header,
        "|" + "---|" * (header.count("|") - 1),
    ]
    for c in cells:
        notes = "; ".join(n.replace("|", "/") for n in c.notes)
        lines.append(f"| {c.platform} | {c.model} | {c.file} | {c.engine} | {c.loads.replace('|', '/')} | {c.int8} | "
                     f"{c.accuracy} | {c.fp32_accuracy} | {c.delta} | {c.latency} | {c.speed} | {notes} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calib", type=int, default=64, help="calibration lines")
    ap.add_argument("--eval", type=int, default=200, help="held-out evaluation lines")
    ap.add_argument("--repeats", type=int, default=30, help="latency runs per model and engine")
    ap.add_argument("--models", default="cls,rec")
    ap.add_argument("--platforms", default=None, help="comma-separated subset (default: all rows)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--no-placement", action="store_true",
                    help="quantize with objective=None (the platform's defaults alone, no accuracy budget)")
    ap.add_argument("--update", action="store_true",
                    help="keep the cells of the last run (OUT.json) that this run does not measure again")
    args = ap.parse_args()
    wanted = args.platforms.split(",") if args.platforms else None
    rows = PLATFORMS if wanted is None else sorted((r for r in PLATFORMS if r[0] in wanted),
                                                   key=lambda r: wanted.index(r[0]))
    start = time.perf_counter()
    tasks = make_tasks(args.models.split(","), args.calib, args.eval)
    store = args.out.with_suffix(".json")
    kept = [Cell(**d) for d in json.loads(store.read_text())] if args.update and store.exists() else []
    cells: list[Cell] = []
    fp32_cache: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for task in tasks:
            for platform, suffix, engine in rows:
                try:
                    cell = measure(task, platform, suffix, engine, Path(tmp), fp32_cache, args.repeats,
                                   placement=not args.no_placement)
                except Exception as exc:  # noqa: BLE001 - quantization failing is a result too
                    traceback.print_exc()
                    cell = Cell(platform, task.name, suffix, notes=[f"{type(exc).__name__}: {str(exc)[:200]}"])
                cells.append(cell)
                print(cell, flush=True)
                save(kept, cells, args, time.perf_counter() - start)  # a partial run keeps what it measured
    print(args.out.read_text())


def save(kept: list[Cell], cells: list[Cell], args: argparse.Namespace, seconds: float) -> None:
    """Write OUT (.md) and OUT.json: this run's cells, plus the kept cells this run did not measure again."""
    from netquant.atomic import write_text_atomic

    new = {(c.platform, c.model, c.suffix) for c in cells}
    order = {(p, s): i for i, (p, s, _) in enumerate(PLATFORMS)}
    merged = sorted([c for c in kept if (c.platform, c.model, c.suffix) not in new] + cells,
                    key=lambda c: (c.model != "cls", order.get((c.platform, c.suffix), 99)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out, render(merged, args, seconds))
    write_text_atomic(args.out.with_suffix(".json"), json.dumps([asdict(c) for c in merged], indent=1) + "\n")


if __name__ == "__main__":
    main()
