"""Quantization wall time and peak memory: netquant vs onnxruntime's quantize_static (MinMax, QDQ, per channel).

netquant: quantize_onnx(model, data, "onnxruntime_int8") + export_qdq (validated file written).
onnxruntime: quant_pre_process (as its docs recommend), then quantize_static(QDQ, per_channel=True, QUInt8
activations, QInt8 weights, CalibrationMethod.MinMax), file written.
Both on the same data, one thread each (torch.set_num_threads(1); ORT's calibration session intra_op_num_threads=1),
every measurement in a fresh subprocess (its own peak RSS, imports included in neither time).

    python benchmarks/quant_time.py [--models encoder,rec,cls,squeezenet,...] [--rounds 1]
        [--conditions quiet,busy,default] [--append]

The three-condition table of every model (rec, cls, the encoder, the nine light models), as the issue asks:

    python benchmarks/quant_time.py --conditions quiet,busy,default --rounds 3

Conditions (`--conditions`; without it, quiet only into quant_time.md): `quiet` is the setup above (one thread each, no load added); `busy`
starts one busy process per core (a Python spin loop each, started before and stopped after that condition's
measurements by this script) and runs both tools with default settings: no thread environment variables,
netquant's thread policy (platforms.threads) and onnxruntime's own thread default; `default` is default settings
without added load. Writes benchmarks/results/quant_time.md (no --conditions) or quant_time_conditions.md (any
--conditions, even quiet alone), and prints it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).parent / "results" / "quant_time.md"
CONDITIONS_RESULTS = Path(__file__).parent / "results" / "quant_time_conditions.md"
ENCODER_SAMPLES = 128
OCR_SAMPLES = 128
LIGHT_SAMPLES = 32  # batch-1 models (fixed batch dim): random images (the light models ship no data)


def _data(name: str) -> tuple[Path, list[dict[str, np.ndarray]], int]:
    """(model, calibration samples as single-sample feeds, netquant batch size)."""
    from netquant.api import zoo

    if name == "encoder":
        data = zoo.encoder_inputs(ENCODER_SAMPLES, seed=0)
        feeds = [{k: v[i:i + 1] for k, v in data.items()} for i in range(ENCODER_SAMPLES)]
        return zoo.encoder_model_path(), feeds, 16
    if name in ("rec", "cls"):
        from netquant.data.ocr import cls_batch, direction_samples, rec_batch
        from netquant.data.text_render import make_text_lines

        lines = make_text_lines(OCR_SAMPLES, seed=1000)  # the calibration set of benchmarks/ptq_ocr.py
        x = rec_batch(lines) if name == "rec" else cls_batch([s.image for s in direction_samples(lines)])
        return zoo.ppocr_model_path(name), [{"x": x[i:i + 1]} for i in range(len(x))], 16
    import onnxruntime as ort

    model, _ = zoo.light_model_path(name)
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    inp = sess.get_inputs()[0]
    shape = [d if isinstance(d, int) and d > 0 else 1 for d in inp.shape]
    rng = np.random.default_rng(0)
    return model, [{inp.name: rng.standard_normal(shape).astype(np.float32)} for _ in range(LIGHT_SAMPLES)], 1


def _stack(feeds: list[dict[str, np.ndarray]], batch: int) -> list[dict[str, np.ndarray]]:
    return [{k: np.concatenate([f[k] for f in feeds[i:i + batch]]) for k in feeds[0]}
            for i in range(0, len(feeds), batch)]


def run_netquant(name: str, out: Path, pinned: bool = True) -> float:
    import torch

    import netquant
    from netquant.export import export_qdq

    if pinned:
        torch.set_num_threads(1)
    model, feeds, batch = _data(name)
    batches = _stack(feeds, batch)
    t = time.perf_counter()
    qm = netquant.quantize_onnx(str(model), batches, "onnxruntime_int8", quiet=True)
    export_qdq(qm, out)
    seconds = time.perf_counter() - t
    USED_THREADS.append(qm.threads or torch.get_num_threads())
    c = qm.qgraph.calibration
    CALIB_ENGINE.append(c.engine + (f" x{c.sample_workers}" if c.sample_workers > 1 else ""))
    return seconds


def run_ort(name: str, out: Path, pinned: bool = True) -> float:
    import onnxruntime
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )
    from onnxruntime.quantization import calibrate as ort_calibrate
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class OneThread(onnxruntime.SessionOptions):  # the calibration session, like netquant's one torch thread
        def __init__(self) -> None:
            super().__init__()
            self.intra_op_num_threads = 1
            self.inter_op_num_threads = 1

    if pinned:
        ort_calibrate.onnxruntime.SessionOptions = OneThread  # type: ignore[misc]

    class Reader(CalibrationDataReader):
        def __init__(self, feeds: list[dict[str, np.ndarray]]) -> None:
            self.it = iter(feeds)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.it, None)

    model, feeds, _ = _data(name)
    t = time.perf_counter()
    cwd = os.getcwd()
    os.chdir(out.parent)  # quant_pre_process and the calibrator leave files in the working directory
    try:
        pre = out.parent / "pre.onnx"
        try:
            quant_pre_process(str(model), str(pre))
        except Exception:  # noqa: BLE001 - its symbolic shape inference fails on PP-OCRv4 rec; the documented fallback
            quant_pre_process(str(model), str(pre), skip_symbolic_shape=True)
        for source in (pre, model):  # the raw model when the pre-processed one does not calibrate
            try:
                quantize_static(str(source), str(out), Reader(feeds), quant_format=QuantFormat.QDQ,
                                per_channel=True, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                                calibrate_method=CalibrationMethod.MinMax)
                break
            except Exception as exc:  # noqa: BLE001 - a second failure is reported
                if source == model:
                    raise
                print(f"pre-processed model failed ({str(exc).splitlines()[0][:100]}); raw model", file=sys.stderr)
    finally:
        os.chdir(cwd)
    return time.perf_counter() - t


THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
USED_THREADS: list[int] = []  # torch threads netquant's run used (its thread policy, or the pinned 1)
CALIB_ENGINE: list[str] = []  # the engine of netquant's FP32 calibration statistics (passes.calib_ort)


def one(tool: str, name: str, condition: str = "quiet") -> None:
    """Child process: one measurement, printed as JSON (seconds, peak RSS MB, torch threads netquant chose)."""
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "q.onnx"
        seconds = (run_netquant if tool == "netquant" else run_ort)(name, out, pinned=condition == "quiet")
    print(json.dumps({"seconds": seconds, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "torch_threads": USED_THREADS[-1] if USED_THREADS else torch.get_num_threads(),
                      "calib_engine": CALIB_ENGINE[-1] if CALIB_ENGINE else ""}))


@contextlib.contextmanager
def busy_cores(active: bool) -> Iterator[None]:
    """One spinning process per core for the block (started and stopped here, by their own pids; a SIGTERM to the
    benchmark stops them too: it exits through the block's end instead of leaving them spinning)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)] \
        if active else []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum)) if procs else None
    try:
        if procs:
            time.sleep(1.0)  # let them start spinning
        yield
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def measure(tool: str, name: str, condition: str = "quiet") -> dict[str, float] | str:
    if condition == "quiet":
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    else:  # default settings: no thread environment variables at all
        env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, __file__, "--one", tool, name, condition], capture_output=True, text=True,
                          env=env)
    if proc.returncode != 0:  # reported in the table: the last line of the error
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        return (lines[-1] if lines else f"exit {proc.returncode}")[:160]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    from netquant.api.zoo import LIGHT_MODELS
    from netquant.atomic import write_text_atomic
    from netquant.platforms.targets import host_info

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(("encoder", "rec", "cls", *LIGHT_MODELS)))
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds per model (median reported)")
    ap.add_argument("--conditions", default=None,
                    help="quiet, busy, default (comma-separated): the conditions table (quant_time_conditions.md); "
                         "without it, the quiet one-thread table (quant_time.md)")
    ap.add_argument("--append", action="store_true",
                    help="conditions table: keep the rows already written for other (condition, model) pairs")
    ap.add_argument("--one", nargs="+", metavar="ARG", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        one(*args.one)
        return
    if args.conditions is not None:
        conditions = [c.strip() for c in args.conditions.split(",") if c.strip()]
        conditions_table(args.models.split(","), conditions, args.rounds, args.append)
        return
    samples = {"encoder": ENCODER_SAMPLES, "rec": OCR_SAMPLES, "cls": OCR_SAMPLES}
    rows, ratios, times, notes = [], {}, {}, []
    for name in args.models.split(","):
        got: dict[str, list[dict[str, float] | str]] = {"netquant": [], "ort": []}
        for _ in range(args.rounds):  # interleaved: both tools see the same machine load
            for tool in ("netquant", "ort"):
                got[tool].append(measure(tool, name))
        failed = {t: next((m for m in ms if isinstance(m, str)), None) for t, ms in got.items()}
        ok = {t: [m for m in ms if not isinstance(m, str)] for t, ms in got.items()}
        cells = {}
        for tool in ("netquant", "ort"):
            if failed[tool]:
                cells[tool] = ("fails", "-")
                notes.append(f"{name}, {tool}: {failed[tool]}")
            else:
                cells[tool] = (f"{statistics.median(m['seconds'] for m in ok[tool]):.1f}",
                               f"{max(m['rss_mb'] for m in ok[tool]):.0f}")
        ratio = "-"
        if not failed["netquant"]:
            times[name] = float(cells["netquant"][0])
        if not any(failed.values()):
            ratios[name] = statistics.median(m["seconds"] for m in ok["netquant"]) / \
                statistics.median(m["seconds"] for m in ok["ort"])
            ratio = f"{ratios[name]:.2f}"
        rows.append(f"| {name} | {samples.get(name, LIGHT_SAMPLES)} | {cells['netquant'][0]} | {cells['ort'][0]} "
                    f"| {ratio} | {cells['netquant'][1]} | {cells['ort'][1]} |")
        print(rows[-1], flush=True)
    load = os.getloadavg()
    text = (
        "# Quantization time: netquant vs onnxruntime quantize_static (MinMax)\n\n"
        + host_info().markdown()
        + f"\nGenerated by `benchmarks/quant_time.py` ({args.rounds} round(s), median). One thread each: netquant's "
        "torch (OMP_NUM_THREADS=1) and onnxruntime's calibration session (intra_op_num_threads=1). netquant: "
        "`quantize_onnx(model, data, 'onnxruntime_int8')` + `export_qdq` (validated in onnxruntime, file written); "
        "onnxruntime: `quant_pre_process` + `quantize_static(QDQ, per_channel=True, QUInt8/QInt8, MinMax)` (on the raw model when "
        "the pre-processed one does not calibrate: the light models, whose weights quant_pre_process turns into "
        "required inputs). "
        "Peak RSS of each subprocess (imports included). Models: the built-in 6-layer transformer encoder "
        "(`zoo.encoder_model_path`, padded token batches), PP-OCRv4 rec / cls on rendered text lines, the onnx "
        f"light models on {LIGHT_SAMPLES} random images each (their weights are constants, every element 0.02: the "
        "worst case of netquant's pair-limited weight scale search, where every int8 weight pair can overflow). "
        "The two tools do not do the same work there: those weights are ConstantOfShape outputs, which netquant "
        "folds into per-channel int8 initializers, while quantize_static calibrates them as activations and writes "
        "a file that regenerates and re-quantizes them (per tensor, uint8) at every run (no int8 weights in it). "
        "Machine load average during the run: "
        f"{load[0]:.1f} (shared 2-core host: absolute times are noisy, both tools see the same load).\n\n"
        "| model | samples | netquant s | ORT MinMax s | ratio | netquant peak MB | ORT peak MB |\n"
        "|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
        + ("Failures:\n\n" if notes else "")
        + "".join(f"- {n}\n" for n in notes) + ("\n" if notes else "") +
        f"Targets: ratio <= 1 on every model both tools quantize: {'met' if all(r <= 1 for r in ratios.values()) else 'NOT met'} "
        f"({', '.join(f'{k} {v:.2f}' for k, v in ratios.items())}).\n"
        + (f"Encoder (128 samples) under 30 s: {'met' if times['encoder'] < 30 else 'NOT met'} "
           f"({times['encoder']:.1f} s).\n" if "encoder" in times else "")
    )
    write_text_atomic(RESULTS, text)
    print(text)


def _nine_columns(row: str) -> str:
    """A row of the older six-column table (no calib engine, ORT threads or load) in today's nine columns."""
    cells = [c.strip() for c in row.strip().strip("|").split("|")]
    if len(cells) == 6:
        cells = [*cells[:4], "-", cells[4], "-", cells[5], "-"]
    return "| " + " | ".join(cells) + " |"


def conditions_table(models: list[str], conditions: list[str], rounds: int, append: bool = False) -> None:
    """netquant vs ORT MinMax per model and condition (module docstring), written to quant_time_conditions.md."""
    from netquant.atomic import write_text_atomic
    from netquant.platforms.targets import host_info

    rows: list[str] = []
    loads: dict[str, float] = {}
    if append and CONDITIONS_RESULTS.exists():
        redone = {(c, m) for c in conditions for m in models}
        rows = [ln for ln in CONDITIONS_RESULTS.read_text().splitlines() if ln.startswith("| ")
                and not ln.startswith("| condition") and tuple(x.strip() for x in ln.split("|")[1:3]) not in redone]
        rows = [_nine_columns(r) for r in rows]
    for condition in conditions:
        with busy_cores(condition == "busy"):
            loads[condition] = os.getloadavg()[0]
            for name in models:
                got: dict[str, list[dict[str, float] | str]] = {"netquant": [], "ort": []}
                for _ in range(rounds):
                    for tool in ("netquant", "ort"):
                        got[tool].append(measure(tool, name, condition))
                cells = {}
                for tool, ms in got.items():
                    bad = next((m for m in ms if isinstance(m, str)), None)
                    ok = [m for m in ms if not isinstance(m, str)]
                    cells[tool] = (f"fails: {bad[:80]}", None, None, "") if bad else (
                        f"{statistics.median(m['seconds'] for m in ok):.1f}",
                        statistics.median(m["seconds"] for m in ok), int(ok[0]["torch_threads"]),
                        str(ok[0].get("calib_engine", "")))
                ratio = (f"{cells['netquant'][1] / cells['ort'][1]:.2f}"
                         if cells["netquant"][1] and cells["ort"][1] else "-")
                ort_threads = "1" if condition == "quiet" else f"default ({os.cpu_count()})"
                rows.append(f"| {condition} | {name} | {cells['netquant'][0]} | {cells['netquant'][2]} "
                            f"| {cells['netquant'][3]} | {cells['ort'][0]} | {ort_threads} | {ratio} "
                            f"| {os.getloadavg()[0]:.1f} |")
                print(rows[-1], flush=True)
    text = (
        "# Quantization time under three conditions: netquant vs onnxruntime quantize_static (MinMax)\n\n"
        + host_info().markdown()
        + f"\nGenerated by `benchmarks/quant_time.py --conditions {','.join(conditions)}"
        + (f" --models {','.join(models)} --append` (rows of {', '.join(models)} in those conditions from this run, "
           "appended at the end; the others kept from earlier runs, measured with the netquant of their time; rows "
           "with '-' in calib and load predate those columns: earlier sessions, possibly another CPU (those ran on "
           "an AVX2-only AMD EPYC))"
           if append else "`") + f" ({rounds} round(s), median; "
        "each measurement a fresh subprocess, work as in quant_time.md: quantize + validated export vs "
        "quant_pre_process + quantize_static). quiet: one thread each (OMP_NUM_THREADS=1, ORT calibration session 1 "
        "thread), no load added; busy: one spinning process per core started and stopped by the benchmark, default "
        "settings (no thread environment variables: netquant's thread policy, onnxruntime's default threads); "
        "default: default settings, no load added. 'netquant threads' is torch's intra-op thread count netquant "
        "used (its thread policy, platforms.threads), 'calib' the engine of its FP32 calibration statistics "
        "(passes.calib_ort; 'x2': the later batches on 2 sample threads, one sample each, passes.calib_pool), 'ORT threads' the calibration session's intra-op threads; 'load' the 1-min load average "
        "after the row's measurements (the benchmark's own busy processes included). "
        "Load average (1 min) at the start of each condition (this run): "
        + ", ".join(f"{c} {v:.1f}" for c, v in loads.items())
        + " (the host is shared with other jobs: 'quiet' is only as quiet as they let it be).\n\n"
        "| condition | model | netquant s | netquant threads | calib | ORT MinMax s | ORT threads | ratio | load |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
        + "\n".join(rows) + "\n")
    write_text_atomic(CONDITIONS_RESULTS, text)
    print(text)


if __name__ == "__main__":
    main()
