"""PP-OCR classifier and recognizer in ncnn: netquant's ncnn int8 export vs the FP32 ncnn model (pnnx), in ncnn.

Models come from rapidocr-onnxruntime==1.4.4 (netquant.api.zoo); data are rendered text lines with known ground
truth (netquant.data.text_render), as in benchmarks/ptq_ocr.py. Every number is measured by running the .param/.bin
in ncnn (Python ncnn.Net, use_int8_inference, fp16 off). ncnn's own int8 tools (ncnn2table / ncnn2int8) are not in
the ncnn wheel, so the peer recipe is emulated: netquant's export with KL ranges (ncnn2table's default method).

    python benchmarks/ncnn_int8.py [--calib 64] [--eval 400] [--repeats 30]

Writes benchmarks/results/ncnn_int8.md and prints it.
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import netquant
from netquant.analysis.timing import interleaved_ms
from netquant.api import zoo
from netquant.data.ocr import cls_batch, ctc_greedy_decode, direction_samples, rec_batch, score_lines
from netquant.data.text_render import make_text_lines
from netquant.export.ncnn import export_ncnn
from netquant.export.ncnn.pnnx_convert import pnnx_convert
from netquant.export.ncnn.runner import NcnnRunner
from netquant.graph import to_onnx
from netquant.platforms.targets import host_info
from results_table import publish

RESULTS = Path(__file__).parent / "results" / "ncnn_int8.md"
CALIB_SEED, EVAL_SEED = 1000, 2000


@dataclass
class Row:
    model: str
    variant: str
    acc: float
    delta: float
    int8_layers: str
    cosine: str
    export_s: str
    size_mb: float
    latency_ms: float = 0.0
    speedup: float = 0.0


def run_all(runner: NcnnRunner, x: np.ndarray) -> np.ndarray:
    blob_in, blob_out = runner.input_names[0], runner.output_names[0]
    return np.stack([runner.run_sample({blob_in: s}, [blob_out])[0] for s in x])


def interleaved_latency_ms(runners: list[NcnnRunner], x1: np.ndarray, repeats: int, rounds: int = 5) -> list[float]:
    """Median one-sample latency of each net; the nets alternate in rounds so load changes hit all alike."""
    return interleaved_ms([functools.partial(r.run_sample, {r.input_names[0]: x1}) for r in runners],
                          per_round=repeats // rounds, rounds=rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calib", type=int, default=64, help="calibration lines")
    ap.add_argument("--eval", type=int, default=400, help="held-out evaluation lines")
    ap.add_argument("--repeats", type=int, default=30, help="latency runs per model (one sample, one thread)")
    ap.add_argument("--models", default="cls,rec")
    args = ap.parse_args()

    dictionary = zoo.ppocr_rec_dictionary()
    calib_lines = make_text_lines(args.calib, seed=CALIB_SEED)
    eval_lines = make_text_lines(args.eval, seed=EVAL_SEED)
    truth = [line.text for line in eval_lines]
    eval_dir = direction_samples(eval_lines)
    data = {
        "cls": (cls_batch([s.image for s in direction_samples(calib_lines)]), cls_batch([s.image for s in eval_dir])),
        "rec": (rec_batch(calib_lines), rec_batch(eval_lines)),
    }
    labels = np.array([s.label for s in eval_dir])

    def accuracy(which: str, probs: np.ndarray) -> float:
        if which == "cls":
            return float((probs.reshape(len(labels), -1).argmax(1) == labels).mean())
        return score_lines(ctc_greedy_decode(probs.reshape(len(truth), -1, len(dictionary)), dictionary),
                           truth).line_acc

    rows: list[Row] = []
    notes: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for which in args.models.split(","):
            name = {"cls": "classifier", "rec": "recognizer"}[which]
            calib, xe = data[which]
            batches = [{"x": calib[i:i + 8]} for i in range(0, len(calib), 8)]
            runners: list[tuple[Row, NcnnRunner]] = []
            base = None
            for variant, settings in (("netquant ncnn_int8 (defaults)", {}),
                                      ("netquant ncnn_int8, KL ranges (ncnn2table's method)",
                                       {"activation_observer": "kl"})):
                qm = netquant.quantize_onnx(str(zoo.ppocr_model_path(which)), batches, platform="ncnn_int8",
                                            quiet=True, **settings)
                if base is None:  # pnnx's FP32 ncnn model of the same cleaned graph
                    fp = pnnx_convert(to_onnx(qm.graph, check=False), [[1, *calib.shape[1:]]], which)
                    (work / f"{which}.fp32.param").write_text(fp.param_text)
                    (work / f"{which}.fp32.bin").write_bytes(fp.weights)
                    r32 = NcnnRunner(work / f"{which}.fp32.param", work / f"{which}.fp32.bin", int8=False)
                    base = accuracy(which, run_all(r32, xe))
                    row = Row(name, "FP32 ncnn (pnnx)", base, 0.0, "0", "-", "-", len(fp.weights) / 1e6)
                    rows.append(row)
                    runners.append((row, r32))
                out = work / f"{which}.{len(rows)}.param"
                t = time.perf_counter()
                rep = export_ncnn(qm, out)
                seconds = time.perf_counter() - t
                r8 = NcnnRunner(out, out.with_suffix(".bin"), int8=True)
                acc = accuracy(which, run_all(r8, xe))
                layers = ", ".join(f"{k} {v}" for k, v in rep.int8_layers.items())
                heavy = ", ".join(f"{k} {v}" for k, v in rep.float_heavy_layers.items())
                cos = ", ".join(f"{v:.5f}" for v in rep.output_cosine.values())
                row = Row(name, variant, acc, acc - base,
                          f"{sum(rep.int8_layers.values())} ({layers})" + (f"; float: {heavy}" if heavy else ""),
                          cos, f"{seconds:.1f}", out.with_suffix(".bin").stat().st_size / 1e6)
                rows.append(row)
                runners.append((row, r8))
                notes.extend(f"{name}, {variant}: {w}" for w in rep.warnings)
                print(row, flush=True)
            lats = interleaved_latency_ms([r for _, r in runners], xe[0], args.repeats)
            for (row, _), lat in zip(runners, lats):
                row.latency_ms, row.speedup = lat, lats[0] / lat

    header = ("| model | variant | accuracy % (cls / exact lines) | delta vs FP32 ncnn | int8 layers in ncnn | "
              "cosine vs fake-quant (validation) | export s | .bin MB | latency ms (1 sample, 1 thread) | "
              "speed vs FP32 |")
    lines = [
        "# PP-OCR in ncnn: netquant's ncnn int8 export vs FP32 ncnn",
        "",
        host_info().markdown(),
        f"Calibration: {args.calib} rendered lines (seed {CALIB_SEED}); evaluation: {args.eval} other lines (seed "
        f"{EVAL_SEED}); classifier: the same lines, every other one rotated 180 degrees. Every accuracy is the "
        "file run by ncnn (Python ncnn.Net; int8 model with use_int8_inference, fp16/bf16 off). FP32 ncnn = pnnx's "
        "conversion of the same cleaned-up graph. ncnn's own int8 tools are not in the ncnn wheel; the KL row "
        "uses ncnn2table's default calibration method with netquant's export. Latency: median of interleaved "
        "runs on a machine shared with other jobs.",
        "",
        header,
        "|" + "---|" * (header.count("|") - 1),
    ]
    for r in rows:
        lines.append(f"| {r.model} | {r.variant} | {100 * r.acc:.2f} | {100 * r.delta:+.2f} | {r.int8_layers} | "
                     f"{r.cosine} | {r.export_s} | {r.size_mb:.2f} | {r.latency_ms:.2f} | {r.speedup:.2f}x |")
    if notes:
        lines += ["", "Export warnings:", ""] + [f"- {n}" for n in notes]
    publish(RESULTS, lines)


if __name__ == "__main__":
    main()
