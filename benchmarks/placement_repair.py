"""Placement with repair before float on PP-OCRv4 rec / cls: exact-line (rec) / direction (cls) accuracy of the
exported file in onnxruntime vs FP32, regions INT8, the repairs placement applied and the quantization time.

Data as benchmarks/placement.py: 128 calibration lines (seed 1000), 400 evaluation lines (seed 2000).

    python benchmarks/placement_repair.py [--models rec,cls] [--effort fast,default,max] [--threads 1]

Prints a markdown table (one row per model and effort) with the load average it ran under.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import netquant
from netquant.api import zoo
from netquant.data.ocr import (
    cls_accuracy,
    cls_batch,
    ctc_greedy_decode,
    direction_samples,
    rec_batch,
    rec_score,
    score_lines,
)
from netquant.data.text_render import make_text_lines

CALIB_SEED, EVAL_SEED, METRIC_SEED = 1000, 2000, 3000


def rec_metric_data(n: int) -> tuple[list, object]:
    """(eval_data, metric) for placement's budget in exact-line points: n other lines (seed 3000) in batches of 8,
    metric = the share of lines the fake-quant model reads exactly (higher is better)."""
    dictionary = zoo.ppocr_rec_dictionary()
    lines = make_text_lines(n, seed=METRIC_SEED)
    x = rec_batch(lines)
    data = [({"x": torch.from_numpy(x[i:i + 8])}, [line.text for line in lines[i:i + 8]]) for i in range(0, n, 8)]

    def exact_lines(outputs: dict, truth: list) -> float:
        probs = next(iter(outputs.values())).detach().numpy()
        return score_lines(ctc_greedy_decode(probs, dictionary), truth).line_acc

    return data, exact_lines


def cases(n_calib: int, n_eval: int) -> dict[str, tuple[Path, list, object]]:
    dictionary = zoo.ppocr_rec_dictionary()
    calib_lines, eval_lines = make_text_lines(n_calib, seed=CALIB_SEED), make_text_lines(n_eval, seed=EVAL_SEED)
    truth = [line.text for line in eval_lines]
    rc, re_ = rec_batch(calib_lines), rec_batch(eval_lines)
    cd, ed = direction_samples(calib_lines), direction_samples(eval_lines)
    cc, ce = cls_batch([s.image for s in cd]), cls_batch([s.image for s in ed])
    labels = np.array([s.label for s in ed])

    def rec(path: Path) -> float:
        return 100 * rec_score(path, re_, truth, dictionary, threads=1).line_acc

    def cls(path: Path) -> float:
        return 100 * cls_accuracy(path, ce, labels, threads=1)

    return {"rec": (zoo.ppocr_model_path("rec"), [{"x": rc[i:i + 8]} for i in range(0, len(rc), 8)], rec),
            "cls": (zoo.ppocr_model_path("cls"), [{"x": cc[i:i + 8]} for i in range(0, len(cc), 8)], cls)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="rec,cls")
    ap.add_argument("--effort", default="default", help="comma-separated efforts; 'none' omits the keyword")
    ap.add_argument("--objective", default="balanced", help="comma-separated objectives")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--calib", type=int, default=128)
    ap.add_argument("--eval", type=int, default=400)
    ap.add_argument("--metric-lines", type=int, default=0,
                    help="rec: budget on this many other lines' exact-line accuracy (user metric), max_loss 0.005")
    args = ap.parse_args()
    data = cases(args.calib, args.eval)
    print(f"load average before: {os.getloadavg()}")
    print("| model | objective | effort | metric | FP32 | regions INT8 | loss all-INT8 | loss placed | repairs | quant s | note |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            path, calib, score = data[name]
            fp32 = score(path)
            for objective, effort in [(o, e) for o in args.objective.split(",") for e in args.effort.split(",")]:
                kw = {"objective": objective} | ({} if effort == "none" else {"effort": effort})
                if args.metric_lines and name == "rec":
                    eval_data, metric = rec_metric_data(args.metric_lines)
                    kw |= {"metric": metric, "eval_data": eval_data, "max_loss": 0.005}
                t, cpu = time.perf_counter(), time.process_time()
                qm = netquant.quantize_onnx(str(path), calib, quiet=True, threads=args.threads, **kw)
                took, cpu = time.perf_counter() - t, time.process_time() - cpu
                out = Path(tmp) / f"{name}_{objective}_{effort}.onnx"
                qm.export(out)
                p = qm.placement
                assert p is not None
                n8 = sum(r.decision != "float" for r in p.regions)
                repairs = getattr(p, "repairs", [])
                rep = "; ".join(r.describe() for r in repairs) or "-"
                print(f"| {name} | {objective} | {effort} | {score(out):.2f} | {fp32:.2f} | {n8}/{len(p.regions)} | "
                      f"{p.measured.get('loss_all_int8')} | {p.measured.get('loss_placed')} | {rep} | {took:.1f} ({cpu:.1f} CPU) | "
                      f"{p.note[:200]} |", flush=True)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
