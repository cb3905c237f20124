"""What each repair pass buys on PP-OCRv4 rec / cls (all regions INT8, objective=None): output cosine vs FP32 and
the task metric, measured by running the exported QDQ file in onnxruntime, with each pass's quantization time.

Models: the rapidocr wheel's (netquant.api.zoo); data: rendered text lines (netquant.data.text_render), calibration
and evaluation sets with different seeds.

    python benchmarks/repair_ocr.py [--calib 64] [--eval 200] [--platform onnxruntime_int8] [--ada-iters 200]
    python benchmarks/repair_ocr.py --platform w4a4 [--models cls] [--iters 200]   (and w4a8: the low-bit rows)

Low-bit settings (w4a8, w4a4: academic_int8 with 4-bit per-channel weights, and 4-bit activations) compare plain,
AdaRound (asymmetric), block reconstruction (passes.reconstruction), learned scales (passes.learned_scales) and
learned scales + reconstruction. Writes benchmarks/results/repair_ocr_<platform>.md and prints it.
"""

from __future__ import annotations

import argparse
import os
import platform as host
import tempfile
import time
from pathlib import Path

import numpy as np

import netquant
from netquant.api import zoo
from netquant.data.ocr import (
    cls_batch,
    ctc_greedy_decode,
    direction_samples,
    ort_session,
    rec_batch,
    run_batched,
    score_lines,
)
from netquant.data.text_render import make_text_lines
from netquant.passes.adaround import AdaRoundPass
from netquant.passes.equalization import ClipMode, EqualizationPass
from netquant.passes.learned_scales import LearnedScalePass, LearnedScaleSettings
from netquant.passes.reconstruction import BlockReconstructionPass, ReconstructionSettings
from netquant.passes.smoothquant import SmoothQuantPass
from netquant.platforms import Platform, get_platform
from results_table import publish

RESULTS_DIR = Path(__file__).parent / "results"
CALIB_SEED, EVAL_SEED = 1000, 2000


def w4a8() -> Platform:
    """academic_int8 with 4-bit per-channel weights (W4A8)."""
    a8 = get_platform("academic_int8")
    return a8.with_(name="w4a8", weight=a8.weight.with_(bits=4))


def w4a4() -> Platform:
    """academic_int8 with 4-bit per-channel weights and 4-bit activations (W4A4)."""
    a8 = get_platform("academic_int8")
    return a8.with_(name="w4a4", weight=a8.weight.with_(bits=4), activation=a8.activation.with_(bits=4))


def low_bit_variants(iters: int) -> list[tuple[str, list]]:
    def lsq() -> LearnedScalePass:
        return LearnedScalePass(LearnedScaleSettings(iterations=iters))

    def rec() -> BlockReconstructionPass:
        return BlockReconstructionPass(ReconstructionSettings(iterations=iters))

    return [("plain (nearest rounding)", []),
            (f"AdaRound asymmetric ({iters} it)", [AdaRoundPass(iterations=iters, asymmetric=True)]),
            (f"block reconstruction ({iters} it)", [rec()]),
            (f"learned scales ({iters} it)", [lsq()]),
            (f"learned scales + block reconstruction ({iters} it each)", [lsq(), rec()])]


def variants(ada_iters: int) -> list[tuple[str, list]]:
    return [
        ("plain (nearest rounding)", []),
        ("SmoothQuant", [SmoothQuantPass()]),
        ("equalization", [EqualizationPass()]),
        ("equalization, ReLU6 -> Relu", [EqualizationPass(clip=ClipMode.RELU)]),
        (f"AdaRound ({ada_iters} it)", [AdaRoundPass(iterations=ada_iters)]),
        (f"equalization + SmoothQuant + AdaRound ({ada_iters} it)",
         [EqualizationPass(), SmoothQuantPass(), AdaRoundPass(iterations=ada_iters)]),
    ]


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (else platform.machine())."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return host.machine()


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.reshape(len(a), -1).astype(np.float64), b.reshape(len(b), -1).astype(np.float64)
    return float(np.mean((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))))


def metric(which: str, probs: np.ndarray, truth, dictionary) -> float:
    if which == "rec":
        return 100.0 * score_lines(ctc_greedy_decode(probs, dictionary), truth).line_acc
    return 100.0 * float((probs.argmax(axis=1) == truth).mean())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calib", type=int, default=64)
    ap.add_argument("--eval", type=int, default=200)
    ap.add_argument("--platform", default="onnxruntime_int8", help="a platform name, or w4a8 (academic_int8 with "
                    "4-bit per-channel weights)")
    ap.add_argument("--ada-iters", type=int, default=200)
    ap.add_argument("--iters", type=int, default=200, help="iterations per layer / block of the low-bit rows")
    ap.add_argument("--models", default="cls,rec")
    ap.add_argument("--rows", default="", help="comma-separated row indices to run (default: all)")
    ap.add_argument("--out", default="", help="results file name (default: repair_ocr_<platform>.md)")
    args = ap.parse_args()
    threads = 1  # the host is shared: one thread per engine keeps timings sane
    calib_lines, eval_lines = make_text_lines(args.calib, seed=CALIB_SEED), make_text_lines(args.eval, seed=EVAL_SEED)
    data = {
        "rec": (rec_batch(calib_lines), rec_batch(eval_lines), [ln.text for ln in eval_lines]),
        "cls": (cls_batch([s.image for s in direction_samples(calib_lines)]),
                cls_batch([s.image for s in direction_samples(eval_lines)]),
                np.array([s.label for s in direction_samples(eval_lines)])),
    }
    dictionary = zoo.ppocr_rec_dictionary()
    low_bit = {"w4a8": w4a8, "w4a4": w4a4}
    load = os.getloadavg()[0]
    lines = [f"# Repair passes on PP-OCRv4 ({args.platform}, all INT8, objective=None)", "",
             f"CPU: {cpu_name()} ({os.cpu_count()} cores, shared with other jobs: load average {load:.1f} at the "
             f"start, LOAD_END at the end; torch and onnxruntime on {threads} thread); "
             f"calibration {args.calib} lines, evaluation {args.eval} other lines; accuracy and cosine from the "
             "exported QDQ file in onnxruntime; cosine = mean per-sample cosine of the model output vs the FP32 "
             "model's. FP32 column: the FP32 graph after the pass (exact passes keep the model's accuracy).", "",
             "| model | passes | metric INT8 | metric FP32 (after pass) | cosine vs FP32 | quant time s | pass s |",
             "|---|---|---|---|---|---|---|"]
    for which in args.models.split(","):
        path = zoo.ppocr_model_path(which)
        calib, x, truth = data[which]
        fp32 = run_batched(ort_session(path, threads), x)
        lines.append(f"| {which} | FP32 | {metric(which, fp32, truth, dictionary):.1f} | | 1.0 | | |")
        batches = [{"x": calib[i:i + 16]} for i in range(0, len(calib), 16)]
        plat = low_bit[args.platform]() if args.platform in low_bit else args.platform
        rows = low_bit_variants(args.iters) if args.platform in low_bit else variants(args.ada_iters)
        if args.rows:
            rows = [rows[int(i)] for i in args.rows.split(",")]
        for label, passes in rows:
            t0 = time.perf_counter()
            q = netquant.quantize_onnx(str(path), batches, plat, passes=passes, objective=None, quiet=True,
                                       min_cosine=-1)  # low-bit rows may fall below the export check: measured
            elapsed = time.perf_counter() - t0
            pass_s = sum(q.qgraph.timings.get(p.name, 0.0) for p in passes)
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "m.onnx"
                q.export(out)
                probs = run_batched(ort_session(out, threads), x)
            fp_after = np.concatenate([q.run({"x": x[i:i + 32]}, fake_quant=False)[q.qgraph.graph.outputs[0].name]
                                       .numpy() for i in range(0, len(x), 32)])
            row = (f"| {which} | {label} | {metric(which, probs, truth, dictionary):.1f} | "
                   f"{metric(which, fp_after, truth, dictionary):.1f} | {cosine(probs, fp32):.5f} | {elapsed:.1f} | "
                   f"{pass_s:.1f} |")
            print(row, flush=True)
            lines.append(row)
    lines[2] = lines[2].replace("LOAD_END", f"{os.getloadavg()[0]:.1f}")
    publish(RESULTS_DIR / (args.out or f"repair_ocr_{args.platform}.md"), lines)


if __name__ == "__main__":
    main()
