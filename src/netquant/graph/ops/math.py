"""Linear algebra, scans, sorting and signal ops."""

from __future__ import annotations

import math
from typing import Any

import torch

from netquant.errors import UnsupportedOpError

from ._util import axis_of, ints, onnx_dtype, opt, widen
from .registry import OpContext, register_op

Tensor = torch.Tensor


def _matmul(a: Tensor, b: Tensor) -> Tensor:
    if a.is_floating_point():
        return torch.matmul(a, b)
    dt = a.dtype
    # integer matmul: torch CPU lacks some int kernels; int64 is exact for the sizes ONNX tests use
    return torch.matmul(a.to(torch.int64), b.to(torch.int64)).to(dt)


@register_op("MatMul")
def matmul(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return [_matmul(inputs[0], inputs[1])]


@register_op("Gemm")
def gemm(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """Y = alpha * A' @ B' + beta * C."""
    a, b, c = inputs[0], inputs[1], opt(inputs, 2)
    alpha, beta = attrs.get("alpha", 1.0), attrs.get("beta", 1.0)
    if attrs.get("transA", 0):
        a = a.t()
    if attrs.get("transB", 0):
        b = b.t()
    if c is not None and alpha == 1.0 and beta == 1.0 and a.is_floating_point():
        return [torch.addmm(c, a, b) if c.dim() <= 2 else torch.mm(a, b) + c]
    y = _matmul(a, b)
    if alpha != 1.0:
        y = y * alpha
    if c is not None:
        y = y + (c * beta if beta != 1.0 else c)
    return [y]


@register_op("Einsum")
def einsum(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    eq = attrs["equation"].replace(" ", "")
    xs = [x for x in inputs if x is not None]
    dt = xs[0].dtype
    if not xs[0].is_floating_point():
        return [torch.einsum(eq, *[x.to(torch.int64) for x in xs]).to(dt)]
    return [torch.einsum(eq, *xs)]


@register_op("Det")
def det(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return [torch.linalg.det(inputs[0])]


def _cum(op_type: str, fn) -> None:
    @register_op(op_type)
    def impl(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
        x, axis = inputs[0], inputs[1]
        a = axis_of(int(axis.reshape(-1)[0]), x.dim())
        dt = x.dtype
        y = widen(x)
        rev = attrs.get("reverse", 0)
        if rev:
            y = y.flip(a)
        out = fn(y, a)
        if attrs.get("exclusive", 0):
            ident = torch.zeros_like if op_type == "CumSum" else torch.ones_like
            first = ident(out.narrow(a, 0, 1))
            out = torch.cat([first, out.narrow(a, 0, out.shape[a] - 1)], dim=a)
        if rev:
            out = out.flip(a)
        return [out.to(dt)]

    impl.__name__ = op_type.lower()


_cum("CumSum", lambda x, a: torch.cumsum(x, a))
_cum("CumProd", lambda x, a: torch.cumprod(x, a))


@register_op("TopK")
def topk_v1(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return _topk(inputs[0], attrs["k"], attrs.get("axis", -1), True, True)


@register_op("TopK", since=10)
def topk(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return _topk(inputs[0], int(inputs[1].reshape(-1)[0]), attrs.get("axis", -1),
                 bool(attrs.get("largest", 1)), bool(attrs.get("sorted", 1)))


def _topk(x: Tensor, k: int, axis: int, largest: bool, sort: bool) -> list[Tensor]:
    """Ties resolve to the lower index (ONNX); torch.topk does not promise that, so use a stable sort."""
    a = axis_of(axis, x.dim())
    xs = widen(x)
    order = torch.sort(xs, dim=a, descending=largest, stable=True)
    vals = order.values.narrow(a, 0, k).to(x.dtype)
    idx = order.indices.narrow(a, 0, k)
    return [vals, idx]


# ---------------------------------------------------------------- windows / signal
def _window(op_type: str, coeffs: tuple[float, ...]) -> None:
    @register_op(op_type)
    def impl(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
        n = int(inputs[0].reshape(-1)[0])
        periodic = attrs.get("periodic", 1)
        dt = onnx_dtype(attrs.get("output_datatype", 1), ctx)
        denom = n if periodic else n - 1
        k = torch.arange(n, dtype=torch.float64)
        w = torch.zeros(n, dtype=torch.float64)
        for j, c in enumerate(coeffs):
            w = w + ((-1) ** j) * c * torch.cos(2 * math.pi * j * k / denom)
        return [w.to(dt)]

    impl.__name__ = op_type.lower()


_window("HannWindow", (0.5, 0.5))
_window("HammingWindow", (25.0 / 46.0, 21.0 / 46.0))
_window("BlackmanWindow", (0.42, 0.5, 0.08))


@register_op("DFT")
def dft_v17(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x = inputs[0]
    n = opt(inputs, 1)
    axis = attrs.get("axis", 1)
    if ctx.opset >= 20:
        ax = opt(inputs, 2)
        axis = int(ax.reshape(-1)[0]) if ax is not None else -2
    return [_dft(x, None if n is None else int(n.reshape(-1)[0]), axis, attrs.get("inverse", 0),
                 attrs.get("onesided", 0))]


def _dft(x: Tensor, n: int | None, axis: int, inverse: int, onesided: int) -> Tensor:
    """x: [..., 1 | 2] real or (re, im); returns [..., 2] (or [..., 1] for an inverse one-sided DFT).

    CPU tensors outside autograd go through numpy's pocketfft, the library the ONNX reference uses (torch's
    FFT differs from it by float32 round-off); otherwise torch.fft (differentiable, any device)."""
    xc = x if x.dtype in (torch.float32, torch.float64) else x.float()
    a = axis_of(axis, x.dim())
    if x.device.type == "cpu" and not (torch.is_grad_enabled() and x.requires_grad):
        return _dft_numpy(xc, n, a, inverse, onesided).to(x.dtype)
    c = torch.complex(xc[..., 0], xc[..., 1]) if x.shape[-1] == 2 else xc[..., 0]
    if inverse and onesided:
        return torch.fft.irfft(c if c.is_complex() else c.to(torch.complex64), n=n, dim=a)[..., None].to(x.dtype)
    if inverse:
        y = torch.fft.ifft(c, n=n, dim=a)
    elif onesided:
        y = torch.fft.rfft(c.real if c.is_complex() else c, n=n, dim=a)
    else:
        y = torch.fft.fft(c, n=n, dim=a)
    return torch.stack([y.real, y.imag], dim=-1).to(x.dtype)


def _dft_numpy(x: Tensor, n: int | None, a: int, inverse: int, onesided: int) -> Tensor:
    import numpy as np

    xn = x.detach().numpy()
    c = xn[..., 0] + 1j * xn[..., 1] if xn.shape[-1] == 2 else xn[..., 0]
    if inverse and onesided:
        return torch.from_numpy(np.ascontiguousarray(np.fft.irfft(c, n=n, axis=a)[..., None]))
    if inverse:
        y = np.fft.ifft(c, n=n, axis=a)
    elif onesided:
        y = np.fft.rfft(c.real if np.iscomplexobj(c) else c, n=n, axis=a)
    else:
        y = np.fft.fft(c, n=n, axis=a)
    return torch.from_numpy(np.ascontiguousarray(np.stack([y.real, y.imag], axis=-1)))


@register_op("STFT")
def stft(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x, step, window, length = inputs[0], int(inputs[1].reshape(-1)[0]), opt(inputs, 2), opt(inputs, 3)
    onesided = attrs.get("onesided", 1)
    flen = int(length.reshape(-1)[0]) if length is not None else window.shape[0]
    sig = x[..., 0].double() if x.shape[-1] == 1 else torch.complex(x[..., 0].double(), x[..., 1].double())
    frames = sig.unfold(1, flen, step)  # (B, frames, flen)
    if window is not None:
        frames = frames * window.double()
    y = torch.fft.rfft(frames, dim=-1) if onesided and not frames.is_complex() else torch.fft.fft(frames, dim=-1)
    return [torch.stack([y.real, y.imag], dim=-1).to(x.dtype)]


@register_op("MelWeightMatrix")
def mel_weight_matrix(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    num_mel, dft_len, sr, lo, hi = (x.reshape(-1)[0].item() for x in inputs[:5])
    num_mel, dft_len, sr = int(num_mel), int(dft_len), int(sr)
    dt = onnx_dtype(attrs.get("output_datatype", 1), ctx)
    num_spec = dft_len // 2 + 1
    lo_mel = 2595 * math.log10(1 + lo / 700)
    hi_mel = 2595 * math.log10(1 + hi / 700)
    mel_step = (hi_mel - lo_mel) / (num_mel + 2)
    pts = torch.arange(num_mel + 2, dtype=torch.float64) * mel_step + lo_mel
    hz = 700 * (torch.pow(10.0, pts / 2595) - 1)
    bins = torch.floor((dft_len + 1) * hz / sr).to(torch.int64).tolist()
    out = torch.zeros(num_spec, num_mel, dtype=torch.float64)
    for i in range(num_mel):
        lower, center, upper = bins[i], bins[i + 1], bins[i + 2]
        low_len = center - lower + 1
        if low_len == 1:
            out[center, i] = 1.0
        else:
            for j in range(lower, center + 1):
                out[j, i] = (j - lower) / (low_len - 1)
        up_len = upper - center
        for j in range(center + 1, upper + 1):
            out[j, i] = (upper - j) / up_len
    return [out.to(dt)]


@register_op("Bernoulli")
def bernoulli(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x = inputs[0]
    dt = onnx_dtype(attrs["dtype"], ctx) if "dtype" in attrs else x.dtype
    gen = None
    if "seed" in attrs:
        gen = torch.Generator(device=x.device).manual_seed(int(attrs["seed"]))
    return [torch.bernoulli(x.double(), generator=gen).to(dt)]


def _random(op_type: str, like: bool, normal: bool) -> None:
    @register_op(op_type)
    def impl(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
        if like:
            x = inputs[0]
            shape, device = list(x.shape), x.device
            dt = onnx_dtype(attrs["dtype"], ctx) if "dtype" in attrs else x.dtype
        else:
            shape, device = ints(attrs["shape"]), torch.device("cpu")
            dt = onnx_dtype(attrs.get("dtype", 1), ctx)
        gen = torch.Generator(device=device)
        if "seed" in attrs:
            gen.manual_seed(int(attrs["seed"]))
        else:
            gen.seed()
        if normal:
            out = torch.randn(shape, generator=gen, device=device, dtype=torch.float64)
            out = out * attrs.get("scale", 1.0) + attrs.get("mean", 0.0)
        else:
            lo, hi = attrs.get("low", 0.0), attrs.get("high", 1.0)
            out = torch.rand(shape, generator=gen, device=device, dtype=torch.float64) * (hi - lo) + lo
        return [out.to(dt)]

    impl.__name__ = op_type.lower()


_random("RandomUniform", False, False)
_random("RandomNormal", False, True)
_random("RandomUniformLike", True, False)
_random("RandomNormalLike", True, True)


@register_op("Multinomial")
def multinomial(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x = inputs[0]
    gen = torch.Generator(device=x.device)
    if "seed" in attrs:
        gen.manual_seed(int(attrs["seed"]))
    probs = torch.softmax(x.double(), -1)
    out = torch.multinomial(probs, attrs.get("sample_size", 1), replacement=True, generator=gen)
    dt = onnx_dtype(attrs.get("dtype", 6), ctx)
    if dt not in (torch.int32, torch.int64):
        raise UnsupportedOpError(ctx.unsupported(f"dtype {dt}"))
    return [out.to(dt)]
