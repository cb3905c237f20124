"""Transformer encoders: netquant's default vs onnxruntime's quantize_dynamic / quantize_static and NNCF, one run.

Encoders (issue 21): the BERT-style fused-QKV encoder (zoo.bert_model_path: 6 layers, width 384, 12 heads of 32, token
Embedding inside, additive mask, TorchScript export at opset 17) with a fixed [1, 64] shape (torch.onnx's default
without dynamic_axes), with dynamic batch / sequence axes, and the latter after onnxruntime.transformers.optimizer
(SkipLayerNormalization, BiasGelu); and the built-in nn.TransformerEncoder
(zoo.encoder_model_path, float inputs [batch, 64, 384]). Random (seeded) weights: output cosine vs FP32 is the metric.

Methods: FP32 (the source file), netquant default (quantize_onnx, objective balanced, onnxruntime_int8), ORT
quantize_dynamic (per_channel, QInt8 weights, reduce_range True and False), ORT quantize_static (QDQ, per-channel,
MinMax, QUInt8 activations, after quant_pre_process) and NNCF (nncf.quantize, model_type TRANSFORMER) where it imports.
Latency: batch 1, one onnxruntime thread, every method of a model interleaved round by round (medians); speed = FP32
latency / method latency. Quantization time: quantize (+ export with its validation for netquant) wall seconds.

    python benchmarks/transformers.py [--quick] [--models bert64,bert,bert_ortopt,encoder] [--calib 16] [--eval 16]

Writes benchmarks/results/transformers.md and prints it.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from netquant.analysis.timing import interleaved_ms
from netquant.api import zoo
from netquant.atomic import write_text_atomic
from netquant.export.ort_kernels import ort_int8_kernels
from netquant.platforms.targets import host_info

RESULTS = Path(__file__).parent / "results" / "transformers.md"
Feeds = dict[str, np.ndarray]


@dataclass
class Case:
    name: str
    path: Path
    calib: list[Feeds]
    evals: dict[int, list[Feeds]]  # sequence length -> evaluation batches (batch 1)


@dataclass
class Result:
    method: str
    path: Path | None = None
    quant_s: float | None = None
    note: str = ""
    cosine: dict[int, float] = field(default_factory=dict)
    ms: dict[int, float] = field(default_factory=dict)
    speed: dict[int, float] = field(default_factory=dict)
    kernels: str = ""


def session(path: Path, threads: int = 1) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def cases(wanted: list[str], n_calib: int, n_eval: int) -> list[Case]:
    out = []
    if "bert64" in wanted:
        out.append(Case("fused-QKV BERT-style 6x384, fixed [1, 64]", zoo.bert_model_path(seq=64),
                        [zoo.bert_inputs(1, 64, seed=i) for i in range(n_calib)],
                        {64: [zoo.bert_inputs(1, 64, seed=1000 + i) for i in range(n_eval)]}))
    if "bert" in wanted:
        calib = [zoo.bert_inputs(1, 64 if i % 2 else 128, seed=i) for i in range(n_calib)]
        out.append(Case("fused-QKV BERT-style 6x384, dynamic batch / seq", zoo.bert_model_path(), calib,
                        {s: [zoo.bert_inputs(1, s, seed=1000 + i) for i in range(n_eval)] for s in (64, 128)}))
    if "bert_ortopt" in wanted:
        calib = [zoo.bert_inputs(1, 64 if i % 2 else 128, seed=i) for i in range(n_calib)]
        out.append(Case("fused-QKV BERT-style 6x384, dynamic, after onnxruntime.transformers.optimizer",
                        ort_optimized(zoo.bert_model_path()), calib,
                        {s: [zoo.bert_inputs(1, s, seed=1000 + i) for i in range(n_eval)] for s in (64, 128)}))
    if "encoder" in wanted:
        out.append(Case("built-in nn.TransformerEncoder 6x384, [batch, 64, 384]", zoo.encoder_model_path(),
                        [zoo.encoder_inputs(1, seed=i) for i in range(n_calib)],
                        {zoo.ENCODER_SEQ: [zoo.encoder_inputs(1, seed=1000 + i) for i in range(n_eval)]}))
    return out


def ort_optimized(path: Path) -> Path:
    """`path` after onnxruntime.transformers.optimizer (model_type bert, 12 heads, hidden 384, opt_level 0): the
    graph form users get from that tool (SkipLayerNormalization, BiasGelu; this model's fused-QKV attention is not a
    pattern the optimizer fuses into Attention), cached next to `path`."""
    from onnxruntime.transformers import optimizer

    target = path.with_name(path.stem + "_ortopt.onnx")
    if not target.exists():
        optimizer.optimize_model(str(path), model_type="bert", num_heads=zoo.BERT_HEADS, hidden_size=zoo.BERT_DIM,
                                 opt_level=0).save_model_to_file(str(target))
    return target


# ---- methods: each writes `out` and returns a note -------------------------------------------------------------
def netquant_default(case: Case, out: Path) -> str:
    import netquant

    qm = netquant.quantize_onnx(str(case.path), case.calib, quiet=True)
    qm.export(out)
    p = qm.placement
    if p is None:
        return ""
    s = p.summary()
    return (f"placement: {s['int8_regions']} int8 (static), {s['dynamic_regions']} dynamic, {s['float_regions']} "
            "float regions")


def ort_dynamic(reduce_range: bool) -> Callable[[Case, Path], str]:
    def run(case: Case, out: Path) -> str:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantize_dynamic(str(case.path), str(out), per_channel=True, reduce_range=reduce_range,
                         weight_type=QuantType.QInt8)
        return ""

    return run


class _Reader:
    def __init__(self, batches: list[Feeds]) -> None:
        self.batches, self.i = batches, 0

    def get_next(self) -> Feeds | None:
        self.i += 1
        return self.batches[self.i - 1] if self.i <= len(self.batches) else None

    def rewind(self) -> None:
        self.i = 0


def ort_static(case: Case, out: Path) -> str:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    pre = out.parent / f"{out.stem}.pre.onnx"
    note = ""
    cwd = os.getcwd()
    os.chdir(out.parent)
    try:
        try:
            quant_pre_process(str(case.path), str(pre))
        except Exception:  # noqa: BLE001 - its symbolic shape inference asserts on some models (documented fallback)
            quant_pre_process(str(case.path), str(pre), skip_symbolic_shape=True)
            note = "quant_pre_process needed skip_symbolic_shape=True"
        quantize_static(str(pre), str(out), _Reader(case.calib), quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                        calibrate_method=CalibrationMethod.MinMax)
    finally:
        os.chdir(cwd)
    return note


def nncf_transformer(case: Case, out: Path) -> str:
    import nncf

    model = onnx.load(str(case.path))
    q = nncf.quantize(model, nncf.Dataset(case.calib), model_type=nncf.ModelType.TRANSFORMER,
                      subset_size=len(case.calib))
    onnx.save(q, str(out))
    return ""


def methods() -> list[tuple[str, Callable[[Case, Path], str]]]:
    out: list[tuple[str, Callable[[Case, Path], str]]] = [
        ("netquant default", netquant_default),
        ("ORT quantize_dynamic per-channel, reduce_range", ort_dynamic(True)),
        ("ORT quantize_dynamic per-channel", ort_dynamic(False)),
        ("ORT quantize_static QDQ per-channel MinMax", ort_static),
    ]
    try:
        import nncf  # noqa: F401
    except ImportError:
        return out
    return [*out, ("NNCF model_type=TRANSFORMER", nncf_transformer)]


# ---- measuring ------------------------------------------------------------------------------------------------------
def cosine_vs(ref: list[np.ndarray], out: list[np.ndarray]) -> float:
    a = np.concatenate([r.ravel() for r in ref]).astype(np.float64)
    b = np.concatenate([r.ravel() for r in out]).astype(np.float64)
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-300))


def bench(case: Case, work: Path, per_round: int, rounds: int) -> list[Result]:
    results = [Result("FP32", case.path, note="source file")]
    for label, fn in methods():
        out = work / f"{abs(hash((case.name, label)))}.onnx"
        t = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                note = fn(case, out)
        except Exception as exc:  # noqa: BLE001 - a peer failing is a result to report, not a crash
            traceback.print_exc()
            results.append(Result(label, None, note=f"failed: {type(exc).__name__}: {str(exc)[:160]}"))
            continue
        results.append(Result(label, out, time.perf_counter() - t, note))
    ok = [r for r in results if r.path is not None]
    for r in ok:
        counts = ort_int8_kernels(r.path)
        r.kernels = ", ".join(f"{k} x{v}" for k, v in counts.items()) or "none"
    for seq, batches in case.evals.items():
        sessions = [session(r.path) for r in ok]  # type: ignore[arg-type]
        outs = [[s.run(None, b)[0] for b in batches] for s in sessions]
        for r, o in zip(ok, outs, strict=True):
            r.cosine[seq] = cosine_vs(outs[0], o)
        ms = interleaved_ms([functools.partial(s.run, None, batches[0]) for s in sessions], per_round=per_round,
                            rounds=rounds)
        for r, m in zip(ok, ms, strict=True):
            r.ms[seq], r.speed[seq] = m, ms[0] / m
        print(f"{case.name} seq {seq}: " + ", ".join(f"{r.method} {r.ms[seq]:.1f} ms" for r in ok), flush=True)
    return results


def render(rows: list[tuple[Case, list[Result]]], args: argparse.Namespace, seconds: float) -> str:
    lines = ["# Transformer encoders: netquant default vs onnxruntime quantize_dynamic / quantize_static and NNCF", "",
             host_info(ort_threads=1).markdown(),
             f"onnxruntime {ort.__version__}; one run of `python benchmarks/transformers.py` ({seconds:.0f} s). "
             f"Calibration: {args.calib} batch-1 samples (BERT-style: zoo.bert_inputs, Zipf-like token ids, padded "
             f"rows; dynamic-shape model: seq 64 and 128 alternating; built-in encoder: zoo.encoder_inputs); "
             f"evaluation: {args.eval} other samples per sequence length, output cosine vs the FP32 file in "
             f"onnxruntime over all of them. Latency: batch 1, one onnxruntime intra-op thread, every method of a "
             f"model interleaved in {args.rounds} rounds of {args.repeats} runs, medians; speed = FP32 / method. "
             "The machine (2 cores) is shared with other jobs: absolute times are noisy, ratios within one model "
             "and sequence length are the comparable numbers. Weights are random (seeded): cosine is the metric.", ""]
    for case, results in rows:
        seqs = list(case.evals)
        head = ["method"] + [f"cosine seq {s}" for s in seqs] + [f"ms seq {s}" for s in seqs] + \
            [f"speed seq {s}" for s in seqs] + ["file MB", "quant s", "int8 kernels onnxruntime runs", "note"]
        lines += [f"## {case.name}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in results:
            size = f"{r.path.stat().st_size / 1e6:.2f}" if r.path is not None else "-"
            cells = [r.method] + [f"{r.cosine[s]:.5f}" if s in r.cosine else "-" for s in seqs] + \
                [f"{r.ms[s]:.2f}" if s in r.ms else "-" for s in seqs] + \
                [f"{r.speed[s]:.2f}x" if s in r.speed else "-" for s in seqs] + \
                [size, "-" if r.quant_s is None else f"{r.quant_s:.1f}", r.kernels or "-", r.note.replace("|", "/")]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="bert64,bert,bert_ortopt,encoder")
    ap.add_argument("--calib", type=int, default=16)
    ap.add_argument("--eval", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="small sets, results not written")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.quick:
        args.calib, args.eval, args.repeats, args.rounds = 4, 2, 2, 3
    start = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="netquant_transformers_") as tmp:
        for case in cases(args.models.split(","), args.calib, args.eval):
            rows.append((case, bench(case, Path(tmp), args.repeats, args.rounds)))
        text = render(rows, args, time.perf_counter() - start)
    if not args.quick:
        write_text_atomic(args.out, text, "benchmark results")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
