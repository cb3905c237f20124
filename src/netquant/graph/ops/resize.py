"""Resize / Upsample: nearest, linear and cubic, every coordinate_transformation_mode, antialias,
exclude_outside, axes and keep_aspect_ratio_policy.

Each resized axis is separable: output index x maps to x_original (by the coordinate transformation),
nearest picks one input index, linear / cubic mix n taps around it (edge-clamped).  Nearest uses
index_select; linear / cubic apply a dense (out x in) weight matrix per axis, with a fused
F.interpolate fast path where torch's arithmetic is the same.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from netquant.errors import UnsupportedOpError

from ._util import axes_of, floats, ints, opt
from .registry import OpContext, register_op

Tensor = torch.Tensor

_CTMS = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric",
         "tf_half_pixel_for_nn", "tf_crop_and_resize")


def _source_coords(out_len: int, in_len: int, scale: float, ctm: str, roi: tuple[float, float]) -> Tensor:
    x = torch.arange(out_len, dtype=torch.float64)
    out_w = scale * in_len  # the reference uses the un-floored output width
    if ctm == "half_pixel":
        return (x + 0.5) / scale - 0.5
    if ctm == "half_pixel_symmetric":
        adjustment = out_len / out_w
        offset = in_len / 2 * (1 - adjustment)
        return offset + (x + 0.5) / scale - 0.5
    if ctm == "pytorch_half_pixel":
        return (x + 0.5) / scale - 0.5 if out_w != 1 else torch.full_like(x, -0.5)
    if ctm == "align_corners":
        return x * (in_len - 1) / (out_w - 1) if out_w != 1 else torch.zeros_like(x)
    if ctm == "asymmetric":
        return x / scale
    if ctm == "tf_half_pixel_for_nn":
        return (x + 0.5) / scale
    if ctm == "tf_crop_and_resize":
        s, e = roi
        if out_w == 1:
            return torch.full_like(x, (e - s) * (in_len - 1) / 2 + s * (in_len - 1))
        return x * (e - s) * (in_len - 1) / (out_w - 1) + s * (in_len - 1)
    raise ValueError(ctm)


def _cubic_kernel(d: Tensor, a: float) -> Tensor:
    d = d.abs()
    d2, d3 = d * d, d * d * d
    near = (a + 2) * d3 - (a + 3) * d2 + 1
    far = a * d3 - 5 * a * d2 + 8 * a * d - 4 * a
    return torch.where(d <= 1, near, torch.where(d < 2, far, torch.zeros_like(d)))


def _weights(xo: Tensor, in_len: int, scale: float, mode: str, antialias: bool, a: float,
             exclude_outside: bool) -> Tensor:
    """(out, in) interpolation matrix for linear / cubic."""
    base = torch.ceil(xo) - 1  # ratio in (0, 1]
    ratio = xo - base
    s = min(scale, 1.0) if antialias else 1.0
    if mode == "linear":
        start = int(math.floor(-1 / s) + 1) if antialias else 0
        n = 2 - 2 * start
        offs = torch.arange(start, start + n, dtype=torch.float64)
        coeff = (1 - ((offs[None, :] - ratio[:, None]) * s).abs()).clamp(0, 1) if antialias else \
            torch.stack([1 - ratio, ratio], dim=1)
    else:
        start = int(math.floor(-2 / s) + 1) if antialias else -1
        n = 2 - 2 * start
        offs = torch.arange(start, start + n, dtype=torch.float64)
        coeff = _cubic_kernel((offs[None, :] - ratio[:, None]) * s, a)
    if antialias:
        coeff = coeff / coeff.sum(dim=1, keepdim=True)
    taps = (base[:, None] + offs[None, :]).to(torch.int64)
    if exclude_outside:
        inside = (taps >= 0) & (taps < in_len)
        coeff = torch.where(inside, coeff, torch.zeros_like(coeff))
        coeff = coeff / coeff.sum(dim=1, keepdim=True)
    taps = taps.clamp(0, in_len - 1)
    w = torch.zeros(xo.shape[0], in_len, dtype=torch.float64)
    return w.scatter_add_(1, taps, coeff)


def _nearest_index(xo: Tensor, in_len: int, nearest_mode: str) -> Tensor:
    base = torch.ceil(xo) - 1
    ratio = xo - base
    if nearest_mode == "round_prefer_floor":
        up = ratio > 0.5
    elif nearest_mode == "round_prefer_ceil":
        up = ratio >= 0.5
    elif nearest_mode == "floor":
        up = ratio == 1
    elif nearest_mode == "ceil":
        up = torch.ones_like(ratio, dtype=torch.bool)
    else:
        raise ValueError(nearest_mode)
    return (base + up.to(torch.float64)).to(torch.int64).clamp(0, in_len - 1)


def resize_tensor(x: Tensor, out_sizes: list[int], scales: list[float], *, mode: str = "nearest",
                  ctm: str = "half_pixel", nearest_mode: str = "round_prefer_floor", cubic_a: float = -0.75,
                  exclude_outside: bool = False, extrapolation: float = 0.0, antialias: bool = False,
                  roi: list[float] | None = None, fused: bool = True) -> Tensor:
    """Resize every axis of x to out_sizes (scales[i] = the axis' scale factor).  fused=False forces the
    separable weight-matrix path even where F.interpolate computes the same thing."""
    r = x.dim()
    roi = roi or ([0.0] * r + [1.0] * r)
    resized = [i for i in range(r) if out_sizes[i] != x.shape[i] or scales[i] != 1.0]
    if fused and mode != "nearest" and _fast_ok(x, out_sizes, scales, mode, ctm, cubic_a, exclude_outside, antialias,
                                      resized):
        spatial = r - 2
        tmode = {1: "linear", 2: "bilinear", 3: "trilinear"}[spatial] if mode == "linear" else "bicubic"
        kw: dict[str, Any] = {"align_corners": ctm == "align_corners"}
        if ctm == "align_corners":
            kw["size"] = out_sizes[2:]
        else:
            kw["scale_factor"] = scales[2:]
            kw["recompute_scale_factor"] = False
        xin = x if x.is_floating_point() else x.double()
        return F.interpolate(xin, mode=tmode, **kw).to(x.dtype)
    invalid = None
    y = x
    repeats: dict[int, int] = {}
    for ax in resized:
        in_len, out_len = x.shape[ax], out_sizes[ax]
        xo = _source_coords(out_len, in_len, scales[ax], ctm, (roi[ax], roi[ax + r]))
        if ctm == "tf_crop_and_resize":
            bad = (xo < 0) | (xo > in_len - 1)
            if bool(bad.any()):
                shape = [1] * r
                shape[ax] = out_len
                bad = bad.reshape(shape).to(x.device)
                invalid = bad if invalid is None else invalid | bad
        if mode == "nearest":
            idx = _nearest_index(xo, in_len, nearest_mode)
            k = out_len // in_len
            if k > 1 and out_len == k * in_len and torch.equal(idx, torch.arange(out_len) // k):
                repeats[ax] = k  # integer upsampling: done for all such axes in one copy below
                continue
            y = _take(y, ax, idx)
        else:
            w = _weights(xo, in_len, scales[ax], mode, antialias, cubic_a, exclude_outside)
            yf = y if y.is_floating_point() else y.double()
            w = w.to(device=x.device, dtype=yf.dtype)
            yf = torch.movedim(torch.matmul(torch.movedim(yf, ax, -1), w.t()), -1, ax)
            y = yf if x.is_floating_point() else _round_cast(yf, x.dtype)
    if repeats:
        y = _repeat_each(y, repeats)
    if invalid is not None:
        y = torch.where(invalid, torch.tensor(extrapolation, dtype=y.dtype, device=y.device), y)
    return y


def _repeat_each(x: Tensor, repeats: dict[int, int]) -> Tensor:
    """Repeat every element k times along the given axes (nearest upsampling by integer factors) with one
    copy, written in x's physical layout so channels-last tensors stay channels-last."""
    r = x.dim()
    perm = [0, 2, 3, 1] if r == 4 and x.is_contiguous(memory_format=torch.channels_last) \
        and not x.is_contiguous() else list(range(r))
    xp = x.permute(perm)
    view, expand, merged = [], [], []
    for j, ax in enumerate(perm):
        n, k = xp.shape[j], repeats.get(ax, 1)
        view += [n, 1] if k > 1 else [n]
        expand += [n, k] if k > 1 else [n]
        merged.append(n * k)
    y = xp.reshape(view).expand(expand).reshape(merged)
    inverse = [perm.index(i) for i in range(r)]
    return y.permute(inverse)


def _take(x: Tensor, axis: int, idx: Tensor) -> Tensor:
    """x.index_select(axis, idx), as a strided view when idx = a + k * i (integer downsampling)."""
    n = idx.numel()
    if n > 1:
        step = int(idx[1] - idx[0])
        if step > 0 and torch.equal(idx, idx[0] + step * torch.arange(n)):
            return x.narrow(axis, int(idx[0]), (n - 1) * step + 1)[(slice(None),) * axis + (slice(None, None, step),)]
    return torch.index_select(x, axis, idx.to(x.device))


def _round_cast(y: Tensor, dtype: torch.dtype) -> Tensor:
    info = torch.iinfo(dtype)
    return torch.round(y).clamp(info.min, info.max).to(dtype)


def _fast_ok(x: Tensor, out_sizes: list[int], scales: list[float], mode: str, ctm: str, a: float,
             exclude: bool, antialias: bool, resized: list[int]) -> bool:
    r = x.dim()
    if r < 3 or r > 5 or any(ax < 2 for ax in resized) or not x.is_floating_point():
        return False
    if mode == "cubic" and (r != 4 or a != -0.75 or exclude):
        return False
    if antialias and any(scales[i] < 1 for i in resized):
        return False
    exact = all(out_sizes[i] == scales[i] * x.shape[i] for i in range(2, r))
    if ctm == "half_pixel":
        return True
    if ctm in ("half_pixel_symmetric", "align_corners"):
        return exact
    if ctm == "pytorch_half_pixel":
        return all(o > 1 for o in out_sizes[2:])
    return False


def _resize(x: Tensor, roi: Tensor | None, scales: Tensor | None, sizes: Tensor | None,
            attrs: dict[str, Any], ctx: OpContext) -> Tensor:
    r = x.dim()
    mode = attrs.get("mode", "nearest")
    ctm = attrs.get("coordinate_transformation_mode", "half_pixel")
    nearest_mode = attrs.get("nearest_mode", "round_prefer_floor")
    if mode not in ("nearest", "linear", "cubic"):
        raise UnsupportedOpError(ctx.unsupported(f"mode '{mode}'"))
    if ctm not in _CTMS:
        raise UnsupportedOpError(ctx.unsupported(f"coordinate_transformation_mode '{ctm}'"))
    if nearest_mode not in ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil"):
        raise UnsupportedOpError(ctx.unsupported(f"nearest_mode '{nearest_mode}'"))
    axes = axes_of(ints(attrs["axes"]), r) if "axes" in attrs else list(range(r))
    policy = attrs.get("keep_aspect_ratio_policy", "stretch")
    roi_l = floats(roi) if roi is not None and roi.numel() > 0 else None
    if roi_l is not None and len(axes) != r:
        full = [0.0] * r + [1.0] * r
        for i, d in enumerate(axes):
            full[d], full[r + d] = roi_l[i], roi_l[len(axes) + i]
        roi_l = full
    if sizes is not None and sizes.numel() > 0:
        sz = ints(sizes)
        out = list(x.shape)
        sc = [1.0] * r
        for i, d in enumerate(axes):
            out[d] = sz[i]
            sc[d] = sz[i] / x.shape[d]
        if policy != "stretch":
            if policy not in ("not_larger", "not_smaller"):
                raise UnsupportedOpError(ctx.unsupported(f"keep_aspect_ratio_policy '{policy}'"))
            pick = min if policy == "not_larger" else max
            s = pick(sc[d] for d in axes)
            for d in axes:
                sc[d] = s
                out[d] = int(s * x.shape[d] + 0.5)
    elif scales is not None and scales.numel() > 0:
        sl = floats(scales)
        sc = [1.0] * r
        for i, d in enumerate(axes):
            sc[d] = sl[i]
        out = [int(math.floor(s * n)) for s, n in zip(sc, x.shape)]
    else:
        raise UnsupportedOpError(ctx.unsupported("neither scales nor sizes given"))
    return resize_tensor(x, out, sc, mode=mode, ctm=ctm, nearest_mode=nearest_mode,
                         cubic_a=attrs.get("cubic_coeff_a", -0.75),
                         exclude_outside=bool(attrs.get("exclude_outside", 0)),
                         extrapolation=attrs.get("extrapolation_value", 0.0),
                         antialias=bool(attrs.get("antialias", 0)), roi=roi_l)


def _legacy(x: Tensor, scales: list[float], attrs: dict[str, Any], ctx: OpContext) -> Tensor:
    """Upsample / Resize-10: asymmetric coordinates, nearest = floor."""
    mode = attrs.get("mode", "nearest")
    if mode not in ("nearest", "linear", "bilinear"):
        raise UnsupportedOpError(ctx.unsupported(f"mode '{mode}'"))
    out = [int(math.floor(s * n)) for s, n in zip(scales, x.shape)]
    return resize_tensor(x, out, scales, mode="nearest" if mode == "nearest" else "linear", ctm="asymmetric",
                         nearest_mode="floor")


@register_op("Resize")
def resize_v10(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return [_legacy(inputs[0], floats(inputs[1]), attrs, ctx)]


@register_op("Resize", since=11)
def resize(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return [_resize(inputs[0], opt(inputs, 1), opt(inputs, 2), opt(inputs, 3), attrs, ctx)]


@register_op("Upsample")
def upsample_v7(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return [_legacy(inputs[0], floats(attrs["scales"]), attrs, ctx)]


@register_op("Upsample", since=9)
def upsample(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return [_legacy(inputs[0], floats(inputs[1]), attrs, ctx)]
