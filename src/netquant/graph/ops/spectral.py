"""Windows and signal ops: Hann/Hamming/Blackman windows, DFT, STFT, MelWeightMatrix."""

from __future__ import annotations

import math
from typing import Any

import torch

from ._util import axis_of, onnx_dtype, opt
from .registry import OpContext, register_op

Tensor = torch.Tensor


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
