"""File sizes of the torch path: weight-only (w4a16) and QAT exports before / after integer weight storage.

Run:  python benchmarks/torch_weight_storage.py

Cases (seeded, random weights: sizes and agreement, not accuracy):
  * w4a16 MLP (2 and 3 x Linear 1024x1024, group 128): nn.export_onnx with float weights + QuantizeLinear (the old
    form, integer_weights=False), with int4 initializers -> blocked DQ (now the default), export_weight_only as
    MatMulNBits, and quantize_weights of the float module (RTN, MatMulNBits, external data);
  * a CNN of about 11.8 M parameters QAT-trained a few LSQ steps with the int8 TensorRT preset: export before / after,
    next to graph PTQ of the same float model (quantize_torch, onnxruntime_int8).
Each file is run in onnxruntime (default session) and compared with the module's fake-quant forward.
Writes benchmarks/results/torch_weight_storage.md.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

import netquant
import netquant.nn as nqnn
from netquant.atomic import write_text_atomic
from netquant.core.ops import GradMode
from netquant.platforms.targets import host_info

RESULTS = Path(__file__).parent / "results" / "torch_weight_storage.md"
MB = 1e6


def _mlp(layers: int) -> nn.Module:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for i in range(layers):
        mods += [nn.Linear(1024, 1024)] + ([nn.ReLU()] if i < layers - 1 else [])
    return nn.Sequential(*mods)


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    chans = [3, 64, 128, 256, 512, 512, 512, 512]
    mods: list[nn.Module] = []
    for i in range(len(chans) - 1):
        mods += [nn.Conv2d(chans[i], chans[i + 1], 3, padding=1), nn.ReLU()]
        if i % 2 == 1:
            mods.append(nn.MaxPool2d(2))
    mods += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 100)]
    return nn.Sequential(*mods)


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in (path, path.with_name(path.name + ".data")) if p.exists())


def _params_bytes(model: nn.Module) -> int:
    return sum(p.numel() * 4 for p in model.parameters())


def _max_err(path: Path, x: torch.Tensor, ref: np.ndarray) -> float:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def _latency_ms(path: Path, x: torch.Tensor, rounds: int = 5, runs: int = 20) -> float:
    """Median over rounds of the mean onnxruntime run time (1 intra-op thread, default optimizations)."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    feed = {session.get_inputs()[0].name: x.numpy()}
    for _ in range(3):
        session.run(None, feed)
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(runs):
            session.run(None, feed)
        times.append((time.perf_counter() - t) / runs * 1e3)
    return sorted(times)[len(times) // 2]


def _fp32_file(model: nn.Module, x: torch.Tensor, path: Path) -> int:
    proto = nqnn.export.torch_to_onnx(model.eval(), (x,), input_names=["input"], dynamic_batch=True)
    path.write_bytes(proto.SerializeToString())
    return path.stat().st_size


def _row(name: str, path: Path, fp32: int, err: float | None, seconds: float, latency: float | None = None) -> str:
    size = _bytes(path)
    err_s = f"{err:.1e}" if err is not None else "n/a"
    lat = f"{latency:.2f}" if latency is not None else ""
    return f"| {name} | {size / MB:.2f} | {size / fp32:.3f} | {err_s} | {seconds:.1f} | {lat} |"


def mlp_rows(tmp: Path, layers: int) -> list[str]:
    model = _mlp(layers)
    x = torch.randn(2, 16, 1024)  # [batch, tokens, features]: what an LLM's Linear layers see
    x1 = x[:1]
    fp32_path = tmp / f"mlp{layers}_fp32.onnx"
    fp32 = _fp32_file(model, x, fp32_path)
    rows = [f"| **w4a16 MLP {layers} x Linear 1024x1024**: FP32 export | {fp32 / MB:.2f} | 1.000 | | | "
            f"{_latency_ms(fp32_path, x1):.2f} |"]
    q = nqnn.quantize_model(model, nqnn.ModelQuantConfig.w4a16())
    with torch.no_grad():
        ref = q(x).numpy()
    t = time.perf_counter()
    p = nqnn.export_onnx(q, x, tmp / f"mlp{layers}_before.onnx", integer_weights=False)
    rows.append(_row("nn.export_onnx, float weights + QuantizeLinear (before)", p, fp32, _max_err(p, x, ref),
                     time.perf_counter() - t, _latency_ms(p, x1)))
    t = time.perf_counter()
    p = nqnn.export_onnx(q, x, tmp / f"mlp{layers}_dq.onnx")
    rows.append(_row("nn.export_onnx, int4 initializers -> blocked DQ -> MatMul (now)", p, fp32,
                     _max_err(p, x, ref), time.perf_counter() - t, _latency_ms(p, x1)))
    t = time.perf_counter()
    p = netquant.export_weight_only(q, x, tmp / f"mlp{layers}_mnb.onnx", format="matmulnbits")
    rows.append(_row("export_weight_only, MatMulNBits (accuracy_level 0)", p, fp32, _max_err(p, x, ref),
                     time.perf_counter() - t, _latency_ms(p, x1)))
    t = time.perf_counter()
    p = netquant.export_weight_only(q, x, tmp / f"mlp{layers}_mnb4.onnx", format="matmulnbits", accuracy_level=4)
    rows.append(_row("export_weight_only, MatMulNBits accuracy_level 4 (int8 activations)", p, fp32,
                     _max_err(p, x, ref), time.perf_counter() - t, _latency_ms(p, x1)))
    t = time.perf_counter()
    result = netquant.quantize_weights(model, tmp / f"mlp{layers}_qw.onnx", example_inputs=x, format="matmulnbits")
    rows.append(_row(f"quantize_weights(module), RTN, MatMulNBits + .data (cosine vs FP32 "
                     f"{min(result.cosine.values()):.4f})", result.path, fp32, None, time.perf_counter() - t,
                     _latency_ms(result.path, x1)))
    return rows


def qat_rows(tmp: Path) -> list[str]:
    model = _cnn()
    x = torch.randn(16, 3, 32, 32)
    y = torch.randint(0, 100, (16,))
    fp32 = _fp32_file(model, x[:2], tmp / "cnn_fp32.onnx")
    rows = [f"| **CNN ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params), int8 TensorRT preset**: "
            f"FP32 export | {fp32 / MB:.2f} | 1.000 | | | |"]
    t = time.perf_counter()
    qm = netquant.quantize_torch(model, x[:2], [x[i:i + 2] for i in range(0, 16, 2)], "onnxruntime_int8", quiet=True)
    ptq = tmp / "cnn_ptq.onnx"
    qm.export(ptq)
    rows.append(f"| quantize_torch (graph PTQ, onnxruntime_int8) + export | {_bytes(ptq) / MB:.2f} | "
                f"{_bytes(ptq) / fp32:.3f} | | {time.perf_counter() - t:.1f} | |")
    q = nqnn.quantize_model(model, nqnn.ModelQuantConfig.int8_tensorrt())
    with nqnn.calibrate(q):
        q(x)
    nqnn.prepare_qat(q, grad_mode=GradMode.LSQ)
    opt = torch.optim.Adam(q.parameters(), lr=1e-4)
    q.train()
    for _ in range(3):
        opt.zero_grad()
        nn.functional.cross_entropy(q(x), y).backward()
        opt.step()
    q.eval()
    with torch.no_grad():
        ref = q(x).numpy()
    t = time.perf_counter()
    p = nqnn.export_onnx(q, x[:2], tmp / "cnn_qat_before.onnx", integer_weights=False)
    rows.append(_row("QAT (3 LSQ steps), nn.export_onnx float weights + QuantizeLinear (before)", p, fp32,
                     _max_err(p, x, ref), time.perf_counter() - t))
    t = time.perf_counter()
    p = nqnn.export_onnx(q, x[:2], tmp / "cnn_qat_after.onnx")
    rows.append(_row("QAT (3 LSQ steps), nn.export_onnx int8 initializers (now)", p, fp32, _max_err(p, x, ref),
                     time.perf_counter() - t))
    return rows


def main() -> None:
    torch.set_num_threads(1)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        rows = mlp_rows(tmp, 2) + mlp_rows(tmp, 3) + qat_rows(tmp)
    header = ["# Torch path file sizes: integer weight storage (w4a16, QAT)", "", host_info(torch_threads=1).markdown(),
              "", "Sizes are the .onnx file plus its .data file where there is one (MB = 10^6 bytes). Max error: "
              "onnxruntime (default session, this CPU) vs the module's fake-quant forward, relative to max |output|; "
              "onnxruntime fuses DequantizeLinear -> MatMul into MatMulNBits at its default accuracy level 4 (int8 "
              "activations), hence the DQ file's larger error. Latency: onnxruntime, 1 intra-op thread, input "
              "[1, 16, 1024], median of 5 rounds of 20 runs on a shared 2-core machine. "
              f"Total wall time {time.perf_counter() - start:.0f} s.", "",
              "| file | MB | x FP32 file | max error / max abs | seconds (export + quantize) | ms / run |",
              "|---|---|---|---|---|---|"]
    write_text_atomic(RESULTS, "\n".join(header + rows) + "\n")
    print(RESULTS.read_text())


if __name__ == "__main__":
    main()
