"""FP32 vs INT8 in the target engine (export.fidelity) for the models the default min_cosine was chosen from.

Each model is quantized with netquant's defaults (objective balanced) on the calibration batches of
benchmarks/placement.py and exported to ONNX QDQ; the export compares every output, run in onnxruntime, with the
FP32 model in onnxruntime on the validation batches and times both. Also: two broken files that must fall below the
default (weights x1e-6 with the old eps scale floor is measured by the safety work; here an all-zero output and an
output with random sign flips). Writes benchmarks/results/fidelity.md.

python benchmarks/fidelity.py [--models rec,cls,encoder,resnet50,...] [--calib 64]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

import netquant  # noqa: E402
from netquant.api import zoo  # noqa: E402
from netquant.export.fidelity import DEFAULT_MIN_COSINE, compare_output  # noqa: E402
from netquant.platforms.targets import host_info  # noqa: E402
from placement import encoder_case, light_case, ocr_cases  # noqa: E402


def run_case(case, work: Path) -> list[str]:
    t0 = time.perf_counter()
    qm = netquant.quantize_onnx(str(case.path), case.calib, quiet=True, allow_float=True)
    t1 = time.perf_counter()
    rep = qm.export(work / "q.onnx")
    t2 = time.perf_counter()
    c = rep.vs_fp32
    share = qm.int8_share()
    worst = min(c.outputs, key=lambda o: o.cosine)
    top1 = "-" if worst.top1_agreement is None else f"{100 * worst.top1_agreement:.1f}%"
    speed = f"{c.speedup:.2f}x" if c.speedup is not None else "-"
    return [case.name, f"{share.int8}/{share.total}", f"{worst.cosine:.5f}", f"{worst.max_abs_err:.3g}", top1, speed,
            f"{t1 - t0:.1f}", f"{t2 - t1:.1f}", f"{c.seconds:.2f}"]


def broken_rows() -> list[list[str]]:
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((16, 1000)).astype(np.float32)
    flips = ref * np.where(rng.random(ref.shape) < 0.3, -1.0, 1.0).astype(np.float32)
    rows = []
    for what, y in (("all-zero output", np.zeros_like(ref)), ("30% of values sign-flipped", flips),
                    ("output x1e-6 with noise", ref * 0 + rng.standard_normal(ref.shape).astype(np.float32))):
        o = compare_output("y", [y], [ref])
        rows.append([what, "-", f"{o.cosine:.5f}", f"{o.max_abs_err:.3g}", f"{100 * (o.top1_agreement or 0):.1f}%",
                     "-", "-", "-", "-"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="rec,cls,encoder," + ",".join(zoo.LIGHT_MODELS))
    ap.add_argument("--calib", type=int, default=64)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "fidelity.md"))
    args = ap.parse_args()
    wanted = args.models.split(",")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cases = []
        if "rec" in wanted or "cls" in wanted:
            rec, cls = ocr_cases(args.calib, 8)
            cases += [c for c, n in ((rec, "rec"), (cls, "cls")) if n in wanted]
        if "encoder" in wanted:
            cases.append(encoder_case(args.calib, 8))
        cases += [light_case(n, 8, 1) for n in wanted if n in zoo.LIGHT_MODELS]
        for case in cases:
            row = run_case(case, work)
            print(" | ".join(row), flush=True)
            rows.append(row)
    rows += broken_rows()
    header = ["model", "regions INT8", "lowest output cosine vs FP32", "max abs err", "top-1 agreement", "speed vs FP32",
              "quantize s", "export s", "of which FP32 comparison s"]
    text = (f"# FP32 vs INT8 in onnxruntime (export.fidelity)\n\nCPU: {host_info().cpu.describe()}; default settings "
            f"(objective balanced), {args.calib} calibration samples (rec / cls: rendered text lines; light models: "
            "random normal input, 8 samples). The export runs the file and the FP32 model in onnxruntime on the "
            "validation batches (calibration batches) and times both at the calibration batch size (default threads, "
            f"median of interleaved rounds). Default refusal threshold min_cosine = {DEFAULT_MIN_COSINE}.\n\n"
            "| " + " | ".join(header) + " |\n|" + "---|" * len(header) + "\n"
            + "\n".join("| " + " | ".join(r) + " |" for r in rows) + "\n")
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
