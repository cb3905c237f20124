"""Convolutions: Conv, ConvTranspose, ConvInteger (1-D to 3-D, groups, dilations, auto_pad)."""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F

from netquant.errors import UnsupportedOpError

from ._util import ints, opt
from .registry import OpContext, register_op

Tensor = torch.Tensor

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def same_pads(in_sizes: list[int], kernel: list[int], strides: list[int], dilations: list[int],
              auto_pad: str) -> list[int]:
    """ONNX SAME_UPPER / SAME_LOWER pads as [begin..., end...] so that out = ceil(in / stride)."""
    begin, end = [], []
    for n, k, s, d in zip(in_sizes, kernel, strides, dilations):
        out = -(-n // s)
        total = max((out - 1) * s + (k - 1) * d + 1 - n, 0)
        small = total // 2
        if auto_pad == "SAME_UPPER":
            begin.append(small)
            end.append(total - small)
        else:
            begin.append(total - small)
            end.append(small)
    return begin + end


def resolve_pads(attrs: dict[str, Any], in_sizes: list[int], kernel: list[int], strides: list[int],
                 dilations: list[int], ctx: OpContext) -> list[int]:
    """[begin..., end...] pads from `pads` / `auto_pad`."""
    nd = len(in_sizes)
    auto_pad = attrs.get("auto_pad", "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        return same_pads(in_sizes, kernel, strides, dilations, auto_pad)
    if auto_pad == "VALID":
        return [0] * (2 * nd)
    if auto_pad != "NOTSET":
        raise UnsupportedOpError(ctx.unsupported(f"auto_pad='{auto_pad}'"))
    pads = ints(attrs.get("pads", [0] * (2 * nd)))
    return pads


def torch_pad_arg(pads: list[int]) -> list[int]:
    """ONNX [b1, b2, ..., e1, e2, ...] -> F.pad's [b_last, e_last, ..., b1, e1]."""
    nd = len(pads) // 2
    out: list[int] = []
    for i in reversed(range(nd)):
        out += [pads[i], pads[i + nd]]
    return out


# On CPU, oneDNN convolutions run several times faster on channels-last (NHWC) tensors; the output stays
# channels-last, so following element-wise ops and convolutions keep the layout and only the first
# convolution of a chain pays the conversion.  Values (and autograd) are unchanged; set False to disable.
CHANNELS_LAST_ON_CPU = True


def _layout(x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    if CHANNELS_LAST_ON_CPU and x.dim() == 4 and x.device.type == "cpu" and x.dtype in (torch.float32,
                                                                                       torch.float64):
        return x.contiguous(memory_format=torch.channels_last), _channels_last_weight(w)
    return x, w


# channels-last copies of constant weights, one per weight tensor while it lives unmodified (id -> (weakref to the
# weight, its version counter, the copy)); weights that need gradients are converted on every call
_CHANNELS_LAST: dict[int, tuple[weakref.ref[Tensor], int, Tensor]] = {}


def _channels_last_weight(w: Tensor) -> Tensor:
    cl = torch.channels_last
    if w.requires_grad or w.is_inference() or w.is_contiguous(memory_format=cl):  # no version counter: no cache
        return w.contiguous(memory_format=cl)
    key = id(w)
    hit = _CHANNELS_LAST.get(key)
    if hit is not None and hit[0]() is w and hit[1] == w._version:
        return hit[2]
    out = w.contiguous(memory_format=cl)
    _CHANNELS_LAST[key] = (weakref.ref(w, lambda _, k=key: _CHANNELS_LAST.pop(k, None)), w._version, out)
    return out


def conv_nd(x: Tensor, w: Tensor, b: Tensor | None, attrs: dict[str, Any], ctx: OpContext) -> Tensor:
    nd = x.dim() - 2
    if nd not in _CONV:
        raise UnsupportedOpError(ctx.unsupported(f"{nd}-D convolution"))
    kernel = ints(attrs.get("kernel_shape", w.shape[2:]))
    strides = ints(attrs.get("strides", [1] * nd))
    dil = ints(attrs.get("dilations", [1] * nd))
    group = attrs.get("group", 1)
    pads = resolve_pads(attrs, list(x.shape[2:]), kernel, strides, dil, ctx)
    if pads[:nd] != pads[nd:]:
        x = F.pad(x, torch_pad_arg(pads))
        pads = [0] * (2 * nd)
    x, w = _layout(x, w)
    return _CONV[nd](x, w, b, strides, pads[:nd], dil, group)


@register_op("Conv")
def conv(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x, w, b = inputs[0], inputs[1], opt(inputs, 2)
    return [conv_nd(x, w, b, attrs, ctx)]


@register_op("ConvInteger")
def conv_integer(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """int32 y = conv(x - x_zero_point, w - w_zero_point) (exact in float64 for int8 ranges)."""
    x, w, xz, wz = inputs[0], inputs[1], opt(inputs, 2), opt(inputs, 3)
    xf = x.double() - (xz.double() if xz is not None else 0)
    wf = w.double()
    if wz is not None:
        wz = wz.double()
        wf = wf - (wz.reshape(-1, *([1] * (w.dim() - 1))) if wz.numel() > 1 else wz)
    # padding uses the zero point (i.e. 0 after the shift), so pad the shifted tensor
    y = conv_nd(xf, wf, None, attrs, ctx)
    return [torch.round(y).to(torch.int32)]


@register_op("ConvTranspose")
def conv_transpose(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x, w, b = inputs[0], inputs[1], opt(inputs, 2)
    nd = x.dim() - 2
    if nd not in _CONV_T:
        raise UnsupportedOpError(ctx.unsupported(f"{nd}-D transposed convolution"))
    kernel = ints(attrs.get("kernel_shape", w.shape[2:]))
    strides = ints(attrs.get("strides", [1] * nd))
    dil = ints(attrs.get("dilations", [1] * nd))
    group = attrs.get("group", 1)
    out_pad = ints(attrs.get("output_padding", [0] * nd))
    in_sizes = list(x.shape[2:])
    full = [s * (n - 1) + (k - 1) * d + 1 for n, k, s, d in zip(in_sizes, kernel, strides, dil)]
    auto_pad = attrs.get("auto_pad", "NOTSET")
    if "output_shape" in attrs:
        target = ints(attrs["output_shape"])[-nd:]
        totals = [f + op - t for f, op, t in zip(full, out_pad, target)]
    elif auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        target = [n * s for n, s in zip(in_sizes, strides)]
        totals = [f + op - t for f, op, t in zip(full, out_pad, target)]
    else:
        totals = None
    if totals is not None:
        if auto_pad == "SAME_UPPER":
            begin = [t // 2 for t in totals]
            end = [t - t // 2 for t in totals]
        else:
            begin = [t - t // 2 for t in totals]
            end = [t // 2 for t in totals]
        pads = begin + end
    elif auto_pad == "VALID":
        pads = [0] * (2 * nd)
    else:
        pads = ints(attrs.get("pads", [0] * (2 * nd)))
    begin, end = pads[:nd], pads[nd:]
    fast = begin == end and all(p >= 0 for p in begin) and all(
        0 <= op < max(s, d) for op, s, d in zip(out_pad, strides, dil))
    x, w = _layout(x, w)
    if fast:
        return [_CONV_T[nd](x, w, b, strides, begin, out_pad, group, dil)]
    y = _CONV_T[nd](x, w, None, strides, 0, 0, group, dil)
    for i in range(nd):
        out_len = full[i] + out_pad[i] - begin[i] - end[i]
        lo, hi = begin[i], begin[i] + out_len
        pad_lo, pad_hi = max(-lo, 0), max(hi - full[i], 0)
        if pad_lo or pad_hi:
            pa = [0, 0] * (nd - 1 - i) + [pad_lo, pad_hi]
            y = F.pad(y, pa)
            lo, hi = lo + pad_lo, hi + pad_lo
        y = y.narrow(2 + i, lo, hi - lo)
    if b is not None:
        y = y + b.reshape(1, -1, *([1] * nd))
    return [y]


@register_op("DeformConv")
def deform_conv(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """2-D deformable convolution (v1 / v2 with mask): each kernel tap samples x bilinearly at its
    grid position plus a learned offset (zeros outside), times the mask, then a grouped conv reduction."""
    x, w, offset, b, mask = inputs[0], inputs[1], inputs[2], opt(inputs, 3), opt(inputs, 4)
    if x.dim() != 4:
        raise UnsupportedOpError(ctx.unsupported(f"{x.dim() - 2}-D deformable convolution (only 2-D)"))
    n, c, h, wd = x.shape
    oc = w.shape[0]
    kh, kw = ints(attrs.get("kernel_shape", w.shape[2:]))
    sh, sw = ints(attrs.get("strides", [1, 1]))
    dh, dw = ints(attrs.get("dilations", [1, 1]))
    pads = ints(attrs.get("pads", [0, 0, 0, 0]))
    group, og = attrs.get("group", 1), attrs.get("offset_group", 1)
    oh, ow = offset.shape[2:]
    k = kh * kw
    off = offset.reshape(n, og, kh, kw, 2, oh, ow)
    dev, dt = x.device, x.dtype
    base_h = (-pads[0] + sh * torch.arange(oh, device=dev, dtype=dt)).reshape(1, 1, 1, 1, oh, 1) + \
        (dh * torch.arange(kh, device=dev, dtype=dt)).reshape(1, 1, kh, 1, 1, 1)
    base_w = (-pads[1] + sw * torch.arange(ow, device=dev, dtype=dt)).reshape(1, 1, 1, 1, 1, ow) + \
        (dw * torch.arange(kw, device=dev, dtype=dt)).reshape(1, 1, 1, kw, 1, 1)
    py = base_h + off[:, :, :, :, 0]  # (n, og, kh, kw, oh, ow)
    px = base_w + off[:, :, :, :, 1]
    y0, x0 = torch.floor(py), torch.floor(px)
    ly, lx = py - y0, px - x0
    xs = x.reshape(n, og, c // og, h * wd)
    sampled = torch.zeros(n, og, c // og, k * oh * ow, dtype=dt, device=dev)
    for yy, xx, wt in ((y0, x0, (1 - ly) * (1 - lx)), (y0, x0 + 1, (1 - ly) * lx),
                       (y0 + 1, x0, ly * (1 - lx)), (y0 + 1, x0 + 1, ly * lx)):
        valid = (yy >= 0) & (yy <= h - 1) & (xx >= 0) & (xx <= wd - 1)
        idx = (yy.clamp(0, h - 1) * wd + xx.clamp(0, wd - 1)).to(torch.int64).reshape(n, og, 1, -1)
        vals = torch.gather(xs, 3, idx.expand(n, og, c // og, idx.shape[-1]))
        sampled = sampled + vals * (wt * valid).reshape(n, og, 1, -1)
    if mask is not None:
        sampled = sampled * mask.reshape(n, og, 1, -1)
    cols = sampled.reshape(n, group, (c // group) * k, oh * ow)
    wg = w.reshape(group, oc // group, (c // group) * k)
    out = torch.einsum("ngkp,gok->ngop", cols, wg).reshape(n, oc, oh, ow)
    if b is not None:
        out = out + b.reshape(1, -1, 1, 1)
    return [out]
