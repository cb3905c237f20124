"""PP-OCR classifier and recognizer as .tflite files in LiteRT: netquant's int8 export vs FP32.

Both files come from netquant's TFLite writer (the FP32 one with every op left in float), so LiteRT runs the same
graph; the FP32 reference accuracy is also taken from onnxruntime on the source ONNX model. Writes
benchmarks/results/tflite_ocr.md.

    python benchmarks/tflite_ocr.py [--calib 64] [--eval 400]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
from ai_edge_litert.interpreter import Interpreter

import netquant
from netquant.analysis.timing import interleaved_ms
from netquant.api import zoo
from netquant.data.ocr import (
    cls_batch,
    ctc_greedy_decode,
    direction_samples,
    ort_session,
    rec_batch,
    score_lines,
)
from netquant.data.text_render import make_text_lines
from netquant.export.tflite import export_tflite
from netquant.platforms.targets import host_info
from results_table import publish

RESULTS = Path(__file__).parent / "results" / "tflite_ocr.md"
CALIB_SEED, EVAL_SEED = 1000, 2000


def lite_outputs(path: Path, x: np.ndarray) -> np.ndarray:
    it = Interpreter(model_path=str(path), num_threads=1)
    it.allocate_tensors()
    d_in, d_out = it.get_input_details()[0]["index"], it.get_output_details()[0]["index"]
    ys = []
    for k in range(len(x)):
        it.set_tensor(d_in, np.ascontiguousarray(x[k:k + 1].transpose(0, 2, 3, 1)))
        it.invoke()
        ys.append(it.get_tensor(d_out).copy())
    return np.concatenate(ys)


def interleaved_invoke_ms(paths: list[Path], x1: np.ndarray, repeats: int = 30, rounds: int = 5) -> list[float]:
    """Median invoke time per file, the files alternating over `rounds` (same load for each)."""
    its = []
    for p in paths:
        it = Interpreter(model_path=str(p), num_threads=1)
        it.allocate_tensors()
        it.set_tensor(it.get_input_details()[0]["index"], np.ascontiguousarray(x1.transpose(0, 2, 3, 1)))
        its.append(it)
    return interleaved_ms([it.invoke for it in its], per_round=repeats, rounds=rounds, warmup=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calib", type=int, default=64)
    ap.add_argument("--eval", type=int, default=400)
    args = ap.parse_args()
    calib, evals = make_text_lines(args.calib, seed=CALIB_SEED), make_text_lines(args.eval, seed=EVAL_SEED)
    truth = [line.text for line in evals]
    d_eval = direction_samples(evals)
    labels = np.array([s.label for s in d_eval])
    sets = {"rec": (rec_batch(calib), rec_batch(evals)),
            "cls": (cls_batch([s.image for s in direction_samples(calib)]), cls_batch([s.image for s in d_eval]))}
    dictionary = zoo.ppocr_rec_dictionary()

    def score(which: str, y: np.ndarray) -> float:
        if which == "rec":
            return score_lines(ctc_greedy_decode(y, dictionary), truth).line_acc
        return float((y.argmax(1) == labels).mean())

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for which, (xc, xe) in sets.items():
            model = str(zoo.ppocr_model_path(which))
            batches = [{"x": xc[i:i + 8]} for i in range(0, len(xc), 8)]
            t = time.perf_counter()
            qm = netquant.quantize_onnx(model, batches, platform="tflite_int8", quiet=True)
            int8 = Path(tmp) / f"{which}_int8.tflite"
            report = export_tflite(qm, int8)
            seconds = time.perf_counter() - t
            fp = netquant.quantize_onnx(model, batches, platform="tflite_int8", quiet=True, force_fp32=("glob:*",))
            fp32 = Path(tmp) / f"{which}_fp32.tflite"
            export_tflite(fp, fp32, sample=batches[0])
            sess = ort_session(model, 1)
            ort_y = np.concatenate([sess.run(None, {"x": xe[i:i + 16]})[0] for i in range(0, len(xe), 16)])
            acc = {"ort": score(which, ort_y), "fp32": score(which, lite_outputs(fp32, xe)),
                   "int8": score(which, lite_outputs(int8, xe))}
            ms_fp32, ms_int8 = interleaved_invoke_ms([fp32, int8], xe[:1])
            kernels = ", ".join(f"{k} x{v}" for k, v in (report.int8_kernels or {}).items())
            rows.append(f"| {which} | {100 * acc['ort']:.2f} | {100 * acc['fp32']:.2f} | **{100 * acc['int8']:.2f}** | "
                        f"{ms_fp32:.2f} | {ms_int8:.2f} | {ms_fp32 / ms_int8:.2f}x | {seconds:.1f} | "
                        f"{fp32.stat().st_size / 1e6:.2f} -> {int8.stat().st_size / 1e6:.2f} | "
                        f"{report.total_ops} ops, {len(report.float_ops or [])} float, "
                        f"{report.quantize_nodes} Q / {report.dequantize_nodes} DQ; int8: {kernels} |")
            print(rows[-1], flush=True)
    score_name = "rec: exact lines %, cls: accuracy %"
    lines = [host_info().markdown(), "", "# PP-OCR as .tflite in LiteRT (netquant tflite_int8 vs FP32)", "",
             f"Calibration {args.calib} rendered lines (seed {CALIB_SEED}), evaluation {args.eval} other lines (seed "
             f"{EVAL_SEED}; the classifier: the same lines, every other one rotated 180 degrees). {score_name}. "
             "Both .tflite files come from netquant's writer (FP32: every op left in float) and run in "
             "ai-edge-litert's Interpreter (XNNPACK, 1 thread, NHWC batch 1); latency: median of interleaved "
             "rounds on a machine shared with other jobs.", "",
             "| model | FP32 ONNX Runtime | FP32 .tflite | int8 .tflite | FP32 ms | int8 ms | speed-up | quantize + "
             "export s | MB | file |",
             "|---|---|---|---|---|---|---|---|---|---|", *rows]
    publish(RESULTS, lines)


if __name__ == "__main__":
    main()
