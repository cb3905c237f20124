"""Pooling: MaxPool, AveragePool, LpPool, their Global forms, MaxUnpool, RoiAlign, MaxRoiPool.

Windows follow ONNX: out = floor_or_ceil((in + pad_begin + pad_end - ((k - 1) * d + 1)) / s) + 1, where in
ceil mode a window must start inside the input or the begin padding.  Padding is materialised explicitly
(-inf for max, zeros for sums) so asymmetric pads and ceil mode map onto torch's fused pooling.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from netquant.errors import UnsupportedOpError

from ._util import ints, opt
from .conv import same_pads, torch_pad_arg
from .registry import OpContext, register_op

Tensor = torch.Tensor

_MAX = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _geometry(x: Tensor, attrs: dict[str, Any], ctx: OpContext) -> tuple[list[int], ...]:
    """kernel, strides, dilations, begin pads, end pads (incl. ceil-mode overhang), explicit end pads."""
    nd = x.dim() - 2
    if nd not in _MAX:
        raise UnsupportedOpError(ctx.unsupported(f"{nd}-D pooling"))
    k = ints(attrs["kernel_shape"])
    s = ints(attrs.get("strides", [1] * nd))
    d = ints(attrs.get("dilations", [1] * nd))
    ceil = attrs.get("ceil_mode", 0)
    in_sizes = list(x.shape[2:])
    auto_pad = attrs.get("auto_pad", "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        pads = same_pads(in_sizes, k, s, d, auto_pad)
    elif auto_pad in ("NOTSET", "VALID"):
        pads = ints(attrs.get("pads", [0] * (2 * nd))) if auto_pad == "NOTSET" else [0] * (2 * nd)
    else:
        raise UnsupportedOpError(ctx.unsupported(f"auto_pad='{auto_pad}'"))
    begin, end = pads[:nd], pads[nd:]
    total_end = []
    for i in range(nd):
        keff = (k[i] - 1) * d[i] + 1
        span = in_sizes[i] + begin[i] + end[i] - keff
        if ceil:
            out = -(-span // s[i]) + 1
            if (out - 1) * s[i] >= in_sizes[i] + begin[i]:
                out -= 1
        else:
            out = span // s[i] + 1
        need = (out - 1) * s[i] + keff
        total_end.append(max(end[i], need - in_sizes[i] - begin[i]))
    return k, s, d, begin, total_end, end


@register_op("MaxPool")
def max_pool(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x = inputs[0]
    nd = x.dim() - 2
    k, s, d, begin, end, _ = _geometry(x, attrs, ctx)
    xin = x if x.is_floating_point() else x.double()
    want_idx = ctx.num_outputs > 1
    if any(begin) or any(end):
        xp = F.pad(xin, torch_pad_arg(begin + end), value=-math.inf)
    else:
        xp = xin
    if want_idx:
        y, idx = _MAX[nd](xp, k, s, 0, d, return_indices=True)
    else:
        y = _MAX[nd](xp, k, s, 0, d)
    y = y.to(x.dtype)
    if not want_idx:
        return [y]
    # map indices in the padded plane to flat indices of the unpadded input tensor
    pshape = list(xp.shape[2:])
    coords = []
    rem = idx
    for size in reversed(pshape):
        coords.append(rem % size)
        rem = rem // size
    coords = coords[::-1]
    coords = [c - b for c, b in zip(coords, begin)]
    in_sizes = list(x.shape[2:])
    flat = torch.zeros_like(idx)
    if attrs.get("storage_order", 0):
        for c, size in reversed(list(zip(coords, in_sizes))):
            flat = flat * size + c
    else:
        for c, size in zip(coords, in_sizes):
            flat = flat * size + c
    plane = math.prod(in_sizes)
    nc = torch.arange(x.shape[0] * x.shape[1], device=x.device).reshape(x.shape[0], x.shape[1],
                                                                        *([1] * nd))
    return [y, flat + nc * plane]


def _window_sum(x: Tensor, k: list[int], s: list[int], d: list[int]) -> Tensor:
    """Sum of each pooling window (depthwise conv with a ones kernel; supports dilation)."""
    nd = len(k)
    n, c = x.shape[:2]
    if all(v == 1 for v in d):
        return _AVG[nd](x, k, s) * math.prod(k)
    ones = torch.ones(1, 1, *k, dtype=x.dtype, device=x.device)
    y = _CONV[nd](x.reshape(n * c, 1, *x.shape[2:]), ones, None, s, 0, d)
    return y.reshape(n, c, *y.shape[2:])


@register_op("AveragePool")
def average_pool(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x = inputs[0]
    nd = x.dim() - 2
    k, s, d, begin, end, explicit_end = _geometry(x, attrs, ctx)
    cip = bool(attrs.get("count_include_pad", 0))
    dil1 = all(v == 1 for v in d)
    if dil1 and end == explicit_end and begin == end and all(p <= kk // 2 for p, kk in zip(begin, k)):
        return [_AVG[nd](x, k, s, begin, False, cip)]
    xp = F.pad(x, torch_pad_arg(begin + end))
    total = _window_sum(xp, k, s, d)
    mask = torch.ones(1, 1, *x.shape[2:], dtype=x.dtype, device=x.device)
    if cip:
        mask = F.pad(mask, torch_pad_arg(begin + explicit_end), value=1.0)
        overhang = [e - ee for e, ee in zip(end, explicit_end)]
        mask = F.pad(mask, torch_pad_arg([0] * nd + overhang))
    else:
        mask = F.pad(mask, torch_pad_arg(begin + end))
    count = _window_sum(mask, k, s, d)
    return [total / count]


@register_op("LpPool")
def lp_pool(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """y = (sum over window |x|^p)^(1/p); padding contributes zeros."""
    x = inputs[0]
    p = attrs.get("p", 2)
    k, s, d, begin, end, _ = _geometry(x, attrs, ctx)
    xp = F.pad(torch.abs(x) ** p, torch_pad_arg(begin + end))
    return [_window_sum(xp, k, s, d) ** (1.0 / p)]


@register_op("GlobalAveragePool")
def global_average_pool(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x = inputs[0]
    return [x.mean(dim=tuple(range(2, x.dim())), keepdim=True)]


@register_op("GlobalMaxPool")
def global_max_pool(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x = inputs[0]
    return [x.amax(dim=tuple(range(2, x.dim())), keepdim=True)]


@register_op("GlobalLpPool")
def global_lp_pool(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x = inputs[0]
    p = attrs.get("p", 2)
    return [(torch.abs(x) ** p).sum(dim=tuple(range(2, x.dim())), keepdim=True) ** (1.0 / p)]


@register_op("MaxUnpool")
def max_unpool(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """Scatter x to the flat positions `idx` of the unpooled tensor; a larger output_shape pads at the end."""
    x, idx, out_shape = inputs[0], inputs[1], opt(inputs, 2)
    nd = x.dim() - 2
    k = ints(attrs["kernel_shape"])
    s = ints(attrs.get("strides", [1] * nd))
    pads = ints(attrs.get("pads", [0] * (2 * nd)))
    shape = list(x.shape[:2]) + [(n - 1) * st + kk - pads[i] - pads[i + nd]
                                 for i, (n, st, kk) in enumerate(zip(x.shape[2:], s, k))]
    out = torch.zeros(math.prod(shape), dtype=x.dtype, device=x.device)
    out = out.scatter(0, idx.reshape(-1).to(torch.int64), x.reshape(-1)).reshape(shape)
    if out_shape is not None:
        target = ints(out_shape)
        extra = [t - c for t, c in zip(target[2:], shape[2:])]
        if any(extra):
            out = F.pad(out, torch_pad_arg([0] * nd + extra))
    return [out]


@register_op("RoiAlign")
def roi_align(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """Bilinear RoI pooling (Mask R-CNN); vectorised over bins and samples, one loop step per RoI."""
    x, rois, bidx = inputs[0], inputs[1], inputs[2]
    mode = attrs.get("mode", "avg")
    oh, ow = attrs.get("output_height", 1), attrs.get("output_width", 1)
    ratio = attrs.get("sampling_ratio", 0)
    scale = attrs.get("spatial_scale", 1.0)
    half = attrs.get("coordinate_transformation_mode", "half_pixel" if ctx.opset >= 16 else "output_half_pixel")
    half_pixel = half == "half_pixel"
    _, c, h, w = x.shape
    outs = []
    offset = 0.5 if half_pixel else 0.0
    for r in range(rois.shape[0]):
        x0, y0, x1, y1 = (float(v) * scale - offset for v in rois[r].tolist())
        rw, rh = x1 - x0, y1 - y0
        if not half_pixel:
            rw, rh = max(rw, 1.0), max(rh, 1.0)
        bh, bw = rh / oh, rw / ow
        gh = ratio if ratio > 0 else int(math.ceil(rh / oh))
        gw = ratio if ratio > 0 else int(math.ceil(rw / ow))
        gh, gw = max(gh, 1), max(gw, 1)
        f64 = {"dtype": torch.float64, "device": x.device}
        ys = y0 + torch.arange(oh, **f64).reshape(oh, 1) * bh + \
            (torch.arange(gh, **f64).reshape(1, gh) + 0.5) * bh / gh  # (oh, gh)
        xs = x0 + torch.arange(ow, **f64).reshape(ow, 1) * bw + \
            (torch.arange(gw, **f64).reshape(1, gw) + 0.5) * bw / gw  # (ow, gw)
        Y = ys.reshape(oh, gh, 1, 1).expand(oh, gh, ow, gw)
        X = xs.reshape(1, 1, ow, gw).expand(oh, gh, ow, gw)
        valid = (Y >= -1.0) & (h >= Y) & (X >= -1.0) & (w >= X)
        Y, X = Y.clamp(min=0), X.clamp(min=0)
        y_lo = Y.floor().to(torch.int64)
        x_lo = X.floor().to(torch.int64)
        y_edge, x_edge = y_lo >= h - 1, x_lo >= w - 1
        y_lo = torch.where(y_edge, torch.full_like(y_lo, h - 1), y_lo)
        x_lo = torch.where(x_edge, torch.full_like(x_lo, w - 1), x_lo)
        Y = torch.where(y_edge, y_lo.double(), Y)
        X = torch.where(x_edge, x_lo.double(), X)
        y_hi = torch.where(y_edge, y_lo, y_lo + 1)
        x_hi = torch.where(x_edge, x_lo, x_lo + 1)
        ly, lx = Y - y_lo, X - x_lo
        hy, hx = 1 - ly, 1 - lx
        vf = valid.double()
        ws = [hy * hx * vf, hy * lx * vf, ly * hx * vf, ly * lx * vf]
        pos = [y_lo * w + x_lo, y_lo * w + x_hi, y_hi * w + x_lo, y_hi * w + x_hi]
        plane = x[int(bidx[r])].reshape(c, h * w)
        terms = [plane[:, p.reshape(-1)].reshape(c, oh, gh, ow, gw) * wt.to(x.dtype) for p, wt in zip(pos, ws)]
        if mode == "avg":
            val = sum(terms).sum(dim=(2, 4)) / (gh * gw)
        elif mode == "max":
            val = torch.stack(terms).amax(0).amax(dim=(2, 4))
        else:
            raise UnsupportedOpError(ctx.unsupported(f"mode '{mode}'"))
        outs.append(val)
    if not outs:
        return [x.new_zeros(0, c, oh, ow)]
    return [torch.stack(outs)]


@register_op("MaxRoiPool")
def max_roi_pool(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x, rois = inputs[0], inputs[1]
    ph, pw = ints(attrs["pooled_shape"])
    scale = attrs.get("spatial_scale", 1.0)
    _, c, h, w = x.shape
    outs = []
    for r in range(rois.shape[0]):
        b, x0, y0, x1, y1 = rois[r].tolist()
        x0, y0, x1, y1 = (round(v * scale) for v in (x0, y0, x1, y1))
        rh, rw = max(y1 - y0 + 1, 1), max(x1 - x0 + 1, 1)
        out = x.new_zeros(c, ph, pw)
        for i in range(ph):
            hs = min(max(int(math.floor(i * rh / ph)) + y0, 0), h)
            he = min(max(int(math.ceil((i + 1) * rh / ph)) + y0, 0), h)
            for j in range(pw):
                ws_ = min(max(int(math.floor(j * rw / pw)) + x0, 0), w)
                we = min(max(int(math.ceil((j + 1) * rw / pw)) + x0, 0), w)
                if he > hs and we > ws_:
                    out[:, i, j] = x[int(b), :, hs:he, ws_:we].amax(dim=(1, 2))
        outs.append(out)
    return [torch.stack(outs)]
