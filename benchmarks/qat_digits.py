"""W4A4 PTQ and LSQ QAT of a small CNN on scikit-learn's digits, next to torch.ao eager PTQ (x86).

Run:  python benchmarks/qat_digits.py [--seeds 0 1 2] [--qat-epochs 6] [--quiet]

One run trains the FP32 model, folds BatchNorm, then measures:
  * netquant W8A8 PTQ (INT8 TensorRT-style preset) and its QDQ ONNX export in onnxruntime,
  * netquant W4A4 PTQ (int4 per-channel weights, uint4 activations, MSE calibration),
  * netquant W4A4 QAT with LSQ (learned scales, plain Adam loop, a short schedule), once on the
    BN-folded model and once with QuantConvBn2d (BN statistics kept alive during QAT),
  * torch.ao eager post-training static quantization (x86 backend, int8 kernels) of the same model,
and writes benchmarks/results/qat_digits.md.
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import onnxruntime as ort
import torch
from rich.console import Console
from rich.progress import Progress
from torch import nn

import netquant.nn as nqnn
from netquant.atomic import write_text_atomic
from netquant.core.ops import GradMode
from netquant.platforms.targets import host_info

RESULTS = Path(__file__).parent / "results" / "qat_digits.md"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "nn"))
from digits import DigitsCNN, digits_data  # noqa: E402  (the model and data the tests check)


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, epochs: int, lr: float, seed: int,
          progress: Progress | None = None, label: str = "train") -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs * ((len(x) + 31) // 32))
    task = progress.add_task(label, total=epochs) if progress else None
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=gen)
        for i in range(0, len(x), 32):
            idx = order[i:i + 32]
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            sched.step()
        if progress and task is not None:
            progress.advance(task)
    model.eval()
    return model


@torch.no_grad()
def accuracy(model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> float:
    if isinstance(model, nn.Module):
        model.eval()
    return float((model(x).argmax(1) == y).float().mean()) * 100.0


def timed(fn: Callable[[], object], repeats: int = 5) -> float:
    """Median wall time of fn() in milliseconds."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# ---- netquant ----------------------------------------------------------------------------------
def netquant_ptq(model: nn.Module, cfg: nqnn.ModelQuantConfig, calib: torch.Tensor) -> nn.Module:
    q = nqnn.quantize_model(model, cfg)
    with nqnn.calibrate(q):
        for i in range(0, len(calib), 128):
            q(calib[i:i + 128])
    return q


def netquant_qat(ptq_model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, epochs: int, seed: int,
                 progress: Progress | None) -> nn.Module:
    q = copy.deepcopy(ptq_model)
    nqnn.prepare_qat(q, grad_mode=GradMode.LSQ)
    return train(q, x, y, epochs=epochs, lr=1e-3, seed=seed, progress=progress, label="LSQ QAT")


# ---- torch.ao eager PTQ (the peer) -------------------------------------------------------------
class AoDigits(nn.Module):
    def __init__(self, folded: nn.Module) -> None:
        super().__init__()
        self.quant = torch.ao.quantization.QuantStub()
        f = folded.features
        self.conv1, self.relu1, self.conv2, self.relu2, self.pool = f[0], f[2], f[3], f[5], f[6]
        self.head = folded.head
        self.dequant = torch.ao.quantization.DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quant(x)
        x = self.pool(self.relu2(self.conv2(self.relu1(self.conv1(x)))))
        return self.dequant(self.head(torch.flatten(x, 1)))


def torch_ao_ptq(folded: nn.Module, calib: torch.Tensor) -> nn.Module:
    torch.backends.quantized.engine = "x86"
    model = AoDigits(copy.deepcopy(folded)).eval()
    model = torch.ao.quantization.fuse_modules(model, [["conv1", "relu1"], ["conv2", "relu2"]])
    model.qconfig = torch.ao.quantization.get_default_qconfig("x86")
    torch.ao.quantization.prepare(model, inplace=True)
    with torch.no_grad():
        for i in range(0, len(calib), 128):
            model(calib[i:i + 128])
    return torch.ao.quantization.convert(model)


# ---- one seed ----------------------------------------------------------------------------------
def run_seed(seed: int, qat_epochs: int, progress: Progress | None, threads: int) -> dict[str, float]:
    torch.manual_seed(seed)
    x_tr, y_tr, x_te, y_te = digits_data(seed)
    fp32 = train(DigitsCNN(), x_tr, y_tr, epochs=12, lr=2e-3, seed=seed, progress=progress, label="FP32 train")
    folded = nqnn.fold_batchnorm(fp32)
    calib = x_tr[:512]
    r: dict[str, float] = {"fp32": accuracy(fp32, x_te, y_te)}

    t0 = time.perf_counter()
    w8a8 = netquant_ptq(folded, nqnn.ModelQuantConfig.int8_tensorrt(), calib)
    r["w8a8_calib_ms"] = (time.perf_counter() - t0) * 1e3
    r["w8a8"] = accuracy(w8a8, x_te, y_te)
    with tempfile.TemporaryDirectory() as tmp:
        path = nqnn.export_onnx(w8a8, x_te[:4], Path(tmp) / "digits_w8a8.onnx")
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name
        feed = {name: x_te.numpy()}
        logits = session.run(None, feed)[0]
        r["w8a8_ort"] = float((logits.argmax(1) == y_te.numpy()).mean()) * 100.0
        r["ort_infer_ms"] = timed(lambda: session.run(None, feed))

    w4a4 = netquant_ptq(folded, nqnn.ModelQuantConfig.w4a4(activation_observer="mse"), calib)
    r["w4a4_ptq"] = accuracy(w4a4, x_te, y_te)
    t0 = time.perf_counter()
    qat = netquant_qat(w4a4, x_tr, y_tr, epochs=qat_epochs, seed=seed, progress=progress)
    r["qat_s"] = time.perf_counter() - t0
    r["w4a4_qat"] = accuracy(qat, x_te, y_te)
    # the same schedule with BatchNorm kept alive during QAT (ConvBn pairs, BN folded into the weight)
    w4a4_bn = netquant_ptq(nqnn.fuse_conv_bn(fp32), nqnn.ModelQuantConfig.w4a4(activation_observer="mse"), calib)
    r["w4a4_qat_bn"] = accuracy(netquant_qat(w4a4_bn, x_tr, y_tr, epochs=qat_epochs, seed=seed, progress=progress),
                                x_te, y_te)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao announces its own deprecation
        t0 = time.perf_counter()
        ao = torch_ao_ptq(folded, calib)
        r["ao_calib_ms"] = (time.perf_counter() - t0) * 1e3
        r["ao_int8"] = accuracy(ao, x_te, y_te)
        with torch.no_grad():
            r["ao_infer_ms"] = timed(lambda: ao(x_te))
    with torch.no_grad():
        r["nq_infer_ms"] = timed(lambda: w8a8(x_te))
        r["fp32_infer_ms"] = timed(lambda: folded(x_te))
    return r


def mean(rows: list[dict[str, float]], key: str) -> float:
    return statistics.fmean(row[key] for row in rows)


def spread(rows: list[dict[str, float]], key: str) -> str:
    vals = [row[key] for row in rows]
    return f"{statistics.fmean(vals):.2f}" + (f" ± {statistics.stdev(vals):.2f}" if len(vals) > 1 else "")


def delta(rows: list[dict[str, float]], key: str) -> str:
    d = round(mean(rows, key) - mean(rows, "fp32"), 2)
    return f"{d + 0.0:+.2f}"  # + 0.0 turns -0.0 into 0.0


def report(rows: list[dict[str, float]], seeds: list[int], qat_epochs: int, wall_s: float) -> str:
    fp32 = mean(rows, "fp32")
    lines = [
        "# W4A4 PTQ + LSQ QAT on scikit-learn digits (netquant.nn) vs torch.ao eager PTQ",
        "",
        host_info().markdown(),
        f"Model: 2x(Conv3x3+BN+ReLU) -> AvgPool -> Linear, BN folded before quantization (except the "
        f"QuantConvBn2d row); 1347 train / 450 "
        f"test images (8x8); PTQ calibration on 512 training images; QAT: {qat_epochs} epochs of LSQ "
        f"(Adam, lr 1e-3, cosine). Seeds {seeds}; mean ± stdev over seeds. Machine: {platform.machine()}, "
        f"{torch.get_num_threads()} thread(s) for torch and onnxruntime on a shared 2-core box; torch {torch.__version__}, "
        f"onnxruntime {ort.__version__}. Total wall time {wall_s:.0f} s.",
        "",
        "| method | bits (W/A) | test accuracy % | Δ vs FP32 (points) |",
        "|---|---|---|---|",
        f"| FP32 | 32/32 | {spread(rows, 'fp32')} | 0.00 |",
        f"| netquant PTQ, INT8 TensorRT preset (fake-quant) | 8/8 | {spread(rows, 'w8a8')} | "
        f"{delta(rows, 'w8a8')} |",
        f"| netquant PTQ, INT8 exported QDQ ONNX in onnxruntime | 8/8 | {spread(rows, 'w8a8_ort')} | "
        f"{delta(rows, 'w8a8_ort')} |",
        f"| **torch.ao eager PTQ, x86 backend (peer)** | 8/8 | {spread(rows, 'ao_int8')} | "
        f"{delta(rows, 'ao_int8')} |",
        f"| netquant PTQ, W4A4 (MSE calibration) | 4/4 | {spread(rows, 'w4a4_ptq')} | "
        f"{delta(rows, 'w4a4_ptq')} |",
        f"| netquant QAT, W4A4 LSQ (BN folded before QAT) | 4/4 | {spread(rows, 'w4a4_qat')} | "
        f"{delta(rows, 'w4a4_qat')} |",
        f"| netquant QAT, W4A4 LSQ with QuantConvBn2d (BN statistics live during QAT) | 4/4 | "
        f"{spread(rows, 'w4a4_qat_bn')} | {delta(rows, 'w4a4_qat_bn')} |",
        "",
        f"W4A4 QAT target (within 2 points of FP32): "
        f"{'met' if fp32 - mean(rows, 'w4a4_qat') <= 2.0 else 'NOT met'}.",
        "",
        "| cost (median ms unless noted) | netquant | torch.ao | ratio netquant / torch.ao |",
        "|---|---|---|---|",
        f"| INT8 PTQ: quantize + calibrate (512 images) | {mean(rows, 'w8a8_calib_ms'):.1f} | "
        f"{mean(rows, 'ao_calib_ms'):.1f} | {mean(rows, 'w8a8_calib_ms') / mean(rows, 'ao_calib_ms'):.2f} |",
        f"| INT8 inference, 450 images: netquant fake-quant (PyTorch) vs torch.ao int8 kernels | "
        f"{mean(rows, 'nq_infer_ms'):.2f} | {mean(rows, 'ao_infer_ms'):.2f} | "
        f"{mean(rows, 'nq_infer_ms') / mean(rows, 'ao_infer_ms'):.2f} |",
        f"| INT8 inference, 450 images: netquant QDQ ONNX in onnxruntime vs torch.ao | "
        f"{mean(rows, 'ort_infer_ms'):.2f} | {mean(rows, 'ao_infer_ms'):.2f} | "
        f"{mean(rows, 'ort_infer_ms') / mean(rows, 'ao_infer_ms'):.2f} |",
        f"| FP32 inference, 450 images (PyTorch) | {mean(rows, 'fp32_infer_ms'):.2f} | | |",
        f"| W4A4 LSQ QAT, {qat_epochs} epochs (s) | {mean(rows, 'qat_s'):.1f} | n/a (no eager W4A4) | |",
        "",
        "Per seed (FP32 / W8A8 / W8A8 ORT / torch.ao / W4A4 PTQ / W4A4 QAT / W4A4 QAT ConvBn):",
        "",
    ]
    for seed, row in zip(seeds, rows):
        lines.append(f"- seed {seed}: {row['fp32']:.2f} / {row['w8a8']:.2f} / {row['w8a8_ort']:.2f} / "
                     f"{row['ao_int8']:.2f} / {row['w4a4_ptq']:.2f} / {row['w4a4_qat']:.2f} / {row['w4a4_qat_bn']:.2f}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--qat-epochs", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    console = Console(quiet=args.quiet)
    start = time.perf_counter()
    rows = []
    with Progress(console=console, transient=True, disable=args.quiet) as progress:
        for seed in args.seeds:
            rows.append(run_seed(seed, args.qat_epochs, progress, args.threads))
    text = report(rows, args.seeds, args.qat_epochs, time.perf_counter() - start)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out, text)
    console.print(text, markup=False, highlight=False)


if __name__ == "__main__":
    main()
