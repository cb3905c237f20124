"""Which int8 weight scheme is safe on every CPU and keeps accuracy: full int8, 7-bit (reduce_range),
uint8 (U8U8) and pair-limited int8, on the PP-OCRv4 recognizer and the text-direction classifier.

Each scheme's file is evaluated twice with the same onnxruntime:
- "x86 without VNNI": onnxruntime's optimized graph on this machine when its probe says pairwise_int16,
  else netquant's executor emulating that arithmetic on the file's quantizers;
- "exact (VNNI / ARM)": onnxruntime with graph optimizations off (Q/DQ as defined: exact int32 products)
  when this machine saturates, else onnxruntime's optimized graph here.
Latency: batch 1, 1 thread, interleaved with FP32 in the same rounds, on this machine.
The light models of onnx's backend test data are left out: their weights are constants (ConstantOfShape 0.02),
so their outputs are degenerate (ties everywhere) and no accuracy can be read from them.

    python benchmarks/weight_schemes.py [--calib 64] [--eval 200]

Writes benchmarks/results/weight_schemes.md.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

import netquant
from netquant.api import zoo
from netquant.atomic import write_text_atomic
from netquant.core.int_kernels import Accumulation
from netquant.data.ocr import cls_batch, ctc_greedy_decode, direction_samples, rec_batch, score_lines
from netquant.data.text_render import make_text_lines
from netquant.platforms.targets import host_info

RESULTS = Path(__file__).parent / "results" / "weight_schemes.md"
SCHEMES = [("int8", "x86-vnni"), ("int8-pairs", "any"), ("int7", "any"), ("uint8", "any")]


def session(path: Path, optimized: bool, threads: int = 0) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = threads
    if not optimized:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def snr_db(ref: np.ndarray, test: np.ndarray) -> float:
    """10 log10(sum ref^2 / sum (ref - test)^2) over all outputs: a low-noise companion of the accuracy."""
    ref64, test64 = ref.astype(np.float64), test.astype(np.float64)
    return float(10 * np.log10((ref64 ** 2).sum() / max(((ref64 - test64) ** 2).sum(), 1e-300)))


def run_file(path: Path, x: np.ndarray, optimized: bool) -> np.ndarray:
    sess = session(path, optimized)
    name = sess.get_inputs()[0].name
    return np.concatenate([sess.run(None, {name: x[i:i + 16]})[0] for i in range(0, len(x), 16)])


def run_emulated(qm: netquant.QuantizedModel, x: np.ndarray, acc: Accumulation) -> np.ndarray:
    name = qm.graph.inputs[0].name
    ex = qm.qgraph.executor(fake_quant=True, accumulation=acc)
    with torch.no_grad():
        outs = [next(iter(ex.run({name: torch.from_numpy(x[i:i + 16])}).values())).numpy()
                for i in range(0, len(x), 16)]
    return np.concatenate(outs)


def latencies_ms(paths: list[Path], x1: np.ndarray, rounds: int = 5, per_round: int = 8) -> list[float]:
    sessions = [session(p, True, threads=1) for p in paths]
    names = [s.get_inputs()[0].name for s in sessions]
    times: list[list[float]] = [[] for _ in paths]
    for s, n in zip(sessions, names):
        for _ in range(3):
            s.run(None, {n: x1})
    for _ in range(rounds):
        for i, (s, n) in enumerate(zip(sessions, names)):
            for _ in range(per_round):
                t = time.perf_counter()
                s.run(None, {n: x1})
                times[i].append(time.perf_counter() - t)
    return [1000 * statistics.median(t) for t in times]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calib", type=int, default=64)
    ap.add_argument("--eval", type=int, default=200)
    args = ap.parse_args()
    host = host_info(ort_threads=1)
    saturating_here = host.accumulation is Accumulation.PAIRWISE_INT16
    dictionary = zoo.ppocr_rec_dictionary()
    calib_lines = make_text_lines(args.calib, seed=1000)
    eval_lines = make_text_lines(args.eval, seed=2000)
    truth = [line.text for line in eval_lines]
    cls_eval = direction_samples(eval_lines)
    models = {
        "PP-OCRv4 rec": (zoo.ppocr_model_path("rec"), rec_batch(calib_lines), rec_batch(eval_lines),
                         lambda y: score_lines(ctc_greedy_decode(y, dictionary), truth).line_acc),
        "PP-OCR cls": (zoo.ppocr_model_path("cls"), cls_batch([s.image for s in direction_samples(calib_lines)]),
                       cls_batch([s.image for s in cls_eval]),
                       lambda y: float((y.argmax(1) == np.array([s.label for s in cls_eval])).mean())),
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model_name, (fp32, calib, x, score) in models.items():
            y32 = run_file(fp32, x, True)
            fp32_acc = score(y32)
            paths, results = [fp32], []
            for scheme, target in SCHEMES:
                t = time.perf_counter()
                qm = netquant.quantize_onnx(str(fp32), {"x": calib}, target=target, weight_scheme=scheme,
                                            batch_size=8, quiet=True)
                quant_s = time.perf_counter() - t
                out = Path(tmp) / f"{fp32.stem}_{scheme}.onnx"
                qm.export(out, validate=False, check_kernels=False)
                if saturating_here:
                    y_sat, y_exact = run_file(out, x, True), run_file(out, x, False)
                else:
                    y_sat, y_exact = run_emulated(qm, x, Accumulation.PAIRWISE_INT16), run_file(out, x, True)
                paths.append(out)
                results.append((scheme, target, score(y_sat), score(y_exact), snr_db(y32, y_sat),
                                snr_db(y32, y_exact), quant_s))
            lat = latencies_ms(paths, x[:1])
            rows.append(f"| {model_name} | FP32 | - | {100 * fp32_acc:.2f} | {100 * fp32_acc:.2f} | - | - | - | "
                        f"{lat[0]:.2f} | 1.00 |")
            for (scheme, target, sat, exact, snr_sat, snr_exact, quant_s), ms in zip(results, lat[1:]):
                rows.append(f"| {model_name} | {scheme} | {target} | {100 * sat:.2f} | {100 * exact:.2f} | "
                            f"{snr_sat:.1f} | {snr_exact:.1f} | {quant_s:.1f} | {ms:.2f} | {lat[0] / ms:.2f} |")
            print("\n".join(rows[-len(SCHEMES) - 1:]), flush=True)
    text = (f"# int8 weight schemes: accuracy on both CPU kinds, latency\n\n"
            f"`python benchmarks/weight_schemes.py --calib {args.calib} --eval {args.eval}`; rendered text lines "
            f"(calibration seed 1000, evaluation seed 2000); accuracy = exact lines (rec) / direction (cls).\n\n"
            f"{host.markdown()}\n"
            f"Column 'x86 without VNNI' is {'onnxruntime on this machine' if saturating_here else 'the executor emulating int16 pair saturation'}; "
            f"'exact' is {'onnxruntime with graph optimizations off (Q/DQ as defined)' if saturating_here else 'onnxruntime on this machine'}. "
            "Latency: onnxruntime, batch 1, 1 thread, median of interleaved rounds, this machine.\n\n"
            "Output SNR: 10 log10(sum y32^2 / sum (y32 - y8)^2) over all evaluation outputs (softmax / class scores).\n\n"
            "| model | weights | target | acc % x86 without VNNI | acc % exact (VNNI / ARM) | output SNR dB x86 without VNNI "
            "| output SNR dB exact | quantize s | latency ms | speed vs FP32 |\n"
            "|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    write_text_atomic(RESULTS, text)
    print(text)


if __name__ == "__main__":
    main()
