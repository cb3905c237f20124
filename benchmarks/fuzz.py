"""Fuzz table: seeded malformed and unusual ONNX models and calibration data through netquant's front doors.

Runs the cases of tests/fuzz/fuzzgen.py (the generator the fuzz test tier uses) through the loader, the
executor, quantize_onnx + export and `netquant quantize`, and counts per category how each ended: a result
(onnxruntime agrees / refuses the model), a NetquantError, or a failure (another exception, a hang, a
disagreement with onnxruntime, a leftover file).  Writes benchmarks/results/fuzz.md (whole or not at all).

    python benchmarks/fuzz.py --cases 5300
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "fuzz"))

import fuzzgen  # noqa: E402  (the generator lives with the tests that run it)

from netquant.atomic import write_text_atomic  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "fuzz.md"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=5300, help="seeds 0 .. cases-1 (the test tiers: 0-5299)")
    parser.add_argument("--limit-s", type=float, default=30.0, help="a case running longer is a hang")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    start = time.perf_counter()
    doors: Counter[str] = Counter()
    with tempfile.TemporaryDirectory(prefix="netquant_fuzz_") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tally = fuzzgen.Tally()
        for seed in range(args.cases):
            case = fuzzgen.make_case(seed)
            doors[case.door.value] += 1
            tally.add(fuzzgen.run_case(case, Path(tmp), args.limit_s))
    wall = time.perf_counter() - start
    bad = "\n".join(f"- seed {r.case.seed} ({r.case.category.value}, {r.case.door.value}): {r.case.what}: "
                    f"{r.outcome.value} {r.detail}" for r in tally.bad) or "none"
    text = f"""# Fuzzing netquant's front doors

`python benchmarks/fuzz.py --cases {args.cases}`: seeds 0-{args.cases - 1} of `tests/fuzz/fuzzgen.py`, the same
cases the test tier runs (seeds 0-299 by default, 300-5299 with `pytest -m slow`). {platform.processor() or
platform.machine()}, Python {platform.python_version()}, {wall:.0f} s wall.

Each seed builds one of three small models (Conv-Relu-Conv, Gemm-swish with a dynamic batch, an If with two
branches), mutates the model or the calibration data by its category, and sends it through one door:
{", ".join(f"{k} {v}" for k, v in doors.most_common())}.
A result counts when onnxruntime agrees with it: the executor's outputs match onnxruntime's (rtol 1e-4; for inputs
near float32's max, where the summation order decides what overflows, only outputs finite in both are compared); an export
is written only after netquant's own validation in onnxruntime.  "ORT refuses" marks results for models that
onnx's full checker or onnxruntime will not load (netquant runs them; there is nothing to compare with).

{tally.markdown()}

Failures (other exception, hang, disagreement, leftover file, input or unnamed file overwritten, invalid file
accepted, model ORT runs refused):

{bad}

A valid model would end in a NetquantError when the export's own validation refuses the result (an ExportError,
no file written); since exports target every CPU by default (int8 weights whose int16 pair sums cannot saturate on
x86 without VNNI), none does.

What the categories do: truncated bytes (cut anywhere), bit flips (1-3 random bits), missing fields (graph,
op_type, outputs, names, opset_import, elem_type, type), wrong types (int32 weights, string inputs, a string
attribute, an int64-declared output), cycles, dangling inputs (undefined value, unproduced output), huge dims
(2**40 initializer dims over small data, > 2**31 input dims), zero-size tensors, odd dtypes (float16, bfloat16,
double, int8, uint64, bool, complex64, float8, int4, an unknown elem_type), unknown ops and domains, nested
subgraphs (the graph wrapped in an If, broken If branches); data: one NaN/Inf, denormals, constant (0, 1,
3e38), zero samples, wrong rank, wrong dtype (int64, strings, objects).

Families added for issue 19, each with its own rule for a wrong ending:
- placement files: the gemm model's saved placement file edited ({", ".join(fuzzgen.PLACEMENT_EDITS)}) and
  re-applied (`quantize_onnx(placement_from=)` + export, or `--placement-from`). Only the unedited file may give
  a result: a result from an edited one is "invalid file accepted".
- companion files, outputs over inputs: {", ".join(fuzzgen.COMPANION_SCENARIOS)}. Only the overwrite scenarios
  may write; a result elsewhere is "invalid file accepted", and any file that existed before the run (model,
  calibration file, image, stale companion) must come out unchanged, else "input or unnamed file overwritten".
- tiny magnitudes: weights x {{{", ".join(f"{w:g}" for w in fuzzgen.W_SCALES)}}} and data x
  {{{", ".join(f"{x:g}" for x in fuzzgen.X_SCALES)}}} (not both 1); a written file must reach cosine >= 0.9 vs
  the FP32 model in onnxruntime (unless FP32's own output is below float32's normal range), else "disagrees".
- initializers as graph inputs: every initializer also a graph input (IR 4-8, as
  `torch.onnx.export(keep_initializers_as_inputs=True)` writes).
For valid models, tiny magnitudes and initializer inputs a NetquantError on a model onnxruntime runs is "model ORT
runs refused".
"""
    write_text_atomic(args.out, text, "fuzz table")
    print(text)


if __name__ == "__main__":
    main()
