"""Shape, layout, indexing and data-movement ops, and Constant / ConstantOfShape."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from netquant.errors import UnsupportedOpError

from ._util import WIDE_UNSIGNED, axes_of, axis_of, broadcast_shape, ints, onnx_dtype, opt, widen
from .registry import OpContext, register_op

Tensor = torch.Tensor


def _index(idx: Tensor, dim_size: int) -> Tensor:
    """ONNX indices (negative allowed) as non-negative int64."""
    idx = idx.to(torch.int64)
    return torch.where(idx < 0, idx + dim_size, idx)


# ---------------------------------------------------------------- reshape family
@register_op("Reshape")
def reshape_v1(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return [_reshape(inputs[0], ints(attrs.get("shape", [])), 0)]


@register_op("Reshape", since=5)
def reshape(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return [_reshape(inputs[0], ints(inputs[1]), attrs.get("allowzero", 0))]


def _reshape(x: Tensor, shape: list[int], allowzero: int) -> Tensor:
    if not allowzero:
        shape = [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]
    return x.reshape(shape)


@register_op("Flatten")
def flatten(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x = inputs[0]
    a = axis_of(attrs.get("axis", 1), x.dim())
    return [x.reshape(math.prod(x.shape[:a]), math.prod(x.shape[a:]))]


@register_op("Squeeze")
def squeeze_v1(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return [_squeeze(inputs[0], attrs.get("axes"))]


@register_op("Squeeze", since=13)
def squeeze(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return [_squeeze(inputs[0], opt(inputs, 1))]


def _squeeze(x: Tensor, axes: Any) -> Tensor:
    if axes is None or len(ints(axes)) == 0:
        return x.reshape([s for s in x.shape if s != 1])
    ax = set(axes_of(ints(axes), x.dim()))
    return x.reshape([s for i, s in enumerate(x.shape) if i not in ax])


@register_op("Unsqueeze")
def unsqueeze_v1(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return [_unsqueeze(inputs[0], ints(attrs["axes"]))]


@register_op("Unsqueeze", since=13)
def unsqueeze(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return [_unsqueeze(inputs[0], ints(inputs[1]))]


def _unsqueeze(x: Tensor, axes: list[int]) -> Tensor:
    rank = x.dim() + len(axes)
    ax = set(axes_of(axes, rank))
    it = iter(x.shape)
    return x.reshape([1 if i in ax else next(it) for i in range(rank)])


@register_op("Transpose")
def transpose(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x = inputs[0]
    perm = attrs.get("perm")
    perm = list(range(x.dim()))[::-1] if perm is None else ints(perm)
    return [x.permute(perm)]


@register_op("Expand")
def expand(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """Broadcast x against `shape` (numpy rules, shape dims of 1 keep x's dim)."""
    x, shape = inputs[0], ints(inputs[1])
    out_shape = broadcast_shape(x.shape, shape)
    return [x.expand(out_shape)]


@register_op("Tile")
def tile(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return [inputs[0].repeat(ints(inputs[1]))]


@register_op("Shape")
def shape(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x = inputs[0]
    r = x.dim()
    start = attrs.get("start", 0)
    end = attrs.get("end", r)
    start = min(max(start + r if start < 0 else start, 0), r)
    end = min(max(end + r if end < 0 else end, 0), r)
    return [torch.tensor(list(x.shape)[start:end], dtype=torch.int64, device=x.device)]


@register_op("Size")
def size(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x = inputs[0]
    return [torch.tensor(x.numel(), dtype=torch.int64, device=x.device)]


@register_op("ConstantOfShape")
def constant_of_shape(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    value = attrs.get("value")
    shp = ints(inputs[0])
    if value is None:
        return [torch.zeros(shp, dtype=torch.float32, device=inputs[0].device)]
    value = value.to(inputs[0].device)
    return [value.reshape(()).expand(shp).clone()]


@register_op("Range")
def range_(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """[start, start + delta, ...) with max(ceil((limit - start) / delta), 0) elements."""
    start, limit, delta = inputs[0], inputs[1], inputs[2]
    s, lim, d = start.item(), limit.item(), delta.item()
    n = max(math.ceil((lim - s) / d), 0)
    out = torch.arange(n, dtype=torch.float64 if start.is_floating_point() else torch.int64, device=start.device)
    return [(out * d + s).to(start.dtype)]


@register_op("EyeLike")
def eye_like(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x = inputs[0]
    dt = onnx_dtype(attrs["dtype"], ctx) if "dtype" in attrs else x.dtype
    k = attrs.get("k", 0)
    n, m = x.shape
    out = torch.ones(n, m, device=x.device).triu(k).tril(k)
    return [out.to(dt)]


# ---------------------------------------------------------------- concat / split
@register_op("Concat")
def concat(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    xs = [x for x in inputs if x is not None]
    return [torch.cat(xs, dim=attrs.get("axis", 1 if ctx.opset < 4 else 0))]


@register_op("Split")
def split_v1(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    split = attrs.get("split")
    if split is None and len(inputs) > 1 and inputs[1] is not None:
        split = inputs[1]
    return _split(inputs[0], attrs.get("axis", 0), split, ctx.num_outputs)


@register_op("Split", since=13)
def split(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    n = attrs.get("num_outputs", ctx.num_outputs)
    return _split(inputs[0], attrs.get("axis", 0), opt(inputs, 1), n)


def _split(x: Tensor, axis: int, split: Any, n: int) -> list[Tensor]:
    a = axis_of(axis, x.dim())
    if split is not None and len(ints(split)) > 0:
        return list(torch.split(x, ints(split), dim=a))
    size = x.shape[a]
    chunk = math.ceil(size / n)
    return list(torch.split(x, chunk, dim=a))


# ---------------------------------------------------------------- slicing
@register_op("Slice")
def slice_v1(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x = inputs[0]
    starts, ends = ints(attrs["starts"]), ints(attrs["ends"])
    axes = ints(attrs["axes"]) if "axes" in attrs else list(range(len(starts)))
    return [_slice(x, starts, ends, axes, [1] * len(starts))]


@register_op("Slice", since=10)
def slice_(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x = inputs[0]
    starts, ends = ints(inputs[1]), ints(inputs[2])
    axes = ints(inputs[3]) if opt(inputs, 3) is not None else list(range(len(starts)))
    steps = ints(inputs[4]) if opt(inputs, 4) is not None else [1] * len(starts)
    return [_slice(x, starts, ends, axes, steps)]


def _slice(x: Tensor, starts: list[int], ends: list[int], axes: list[int], steps: list[int]) -> Tensor:
    idx: list[Any] = [slice(None)] * x.dim()
    flips = []
    for s, e, a, st in zip(starts, ends, axes_of(axes, x.dim()), steps):
        n = x.shape[a]
        if st > 0:
            s = min(max(s + n if s < 0 else s, 0), n)
            e = min(max(e + n if e < 0 else e, 0), n)
            idx[a] = slice(s, max(e, s), st)
        else:
            s = min(max(s + n if s < 0 else s, -1), n - 1)
            e = min(max(e + n if e < 0 else e, -1), n - 1)
            # elements s, s+st, ... > e: take them from the flipped axis
            count = max(0, math.ceil((e - s) / st))
            if count == 0:
                idx[a] = slice(0, 0)
            else:
                fs = n - 1 - s
                idx[a] = slice(fs, fs + (count - 1) * (-st) + 1, -st)
                flips.append(a)
    if flips:
        x = x.flip(flips)
    return x[tuple(idx)]


# ---------------------------------------------------------------- gather / scatter
@register_op("Gather")
def gather(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x, idx = inputs[0], inputs[1]
    a = axis_of(attrs.get("axis", 0), x.dim())
    i = _index(idx, x.shape[a])
    if i.dim() == 0:
        return [x.select(a, int(i))]
    out = torch.index_select(x, a, i.reshape(-1))
    return [out.reshape(*x.shape[:a], *idx.shape, *x.shape[a + 1:])]


@register_op("GatherElements")
def gather_elements(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x, idx = inputs[0], inputs[1]
    a = axis_of(attrs.get("axis", 0), x.dim())
    return [torch.gather(x, a, _index(idx, x.shape[a]))]


@register_op("GatherND")
def gather_nd(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x, idx = inputs[0], inputs[1]
    b = attrs.get("batch_dims", 0)
    k = idx.shape[-1]
    batch = x.shape[:b]
    nb = math.prod(batch)
    xs = x.reshape(nb, *x.shape[b:])
    ii = idx.reshape(nb, -1, k).to(torch.int64)
    dims = torch.tensor(x.shape[b:b + k], dtype=torch.int64, device=x.device)
    ii = torch.where(ii < 0, ii + dims, ii)
    bidx = torch.arange(nb, device=x.device).reshape(nb, 1).expand(nb, ii.shape[1])
    out = xs[(bidx, *ii.unbind(-1))]  # (nb, m, rest...)
    return [out.reshape(*idx.shape[:-1], *x.shape[b + k:])]


def _scatter_reduce_fn(reduction: str, ctx: OpContext) -> str | None:
    table = {"none": None, "add": "sum", "mul": "prod", "max": "amax", "min": "amin"}
    if reduction not in table:
        raise UnsupportedOpError(ctx.unsupported(f"reduction '{reduction}'"))
    return table[reduction]


@register_op("ScatterElements")
def scatter_elements(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x, idx, upd = inputs[0], inputs[1], inputs[2]
    a = axis_of(attrs.get("axis", 0), x.dim())
    i = _index(idx, x.shape[a])
    red = _scatter_reduce_fn(attrs.get("reduction", "none"), ctx)
    if red is None:
        return [torch.scatter(x, a, i, upd)]
    return [torch.scatter_reduce(x, a, i, upd, red, include_self=True)]


register_op("Scatter")(scatter_elements)


@register_op("ScatterND")
def scatter_nd(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x, idx, upd = inputs[0], inputs[1], inputs[2]
    k = idx.shape[-1]
    ii = idx.reshape(-1, k).to(torch.int64)
    dims = torch.tensor(x.shape[:k], dtype=torch.int64, device=x.device)
    ii = torch.where(ii < 0, ii + dims, ii)
    strides = torch.tensor([math.prod(x.shape[j + 1:k]) for j in range(k)], dtype=torch.int64, device=x.device)
    flat_idx = (ii * strides).sum(-1)
    rest = x.shape[k:]
    xf = x.reshape(math.prod(x.shape[:k]), *rest)
    uf = upd.reshape(-1, *rest)
    red = _scatter_reduce_fn(attrs.get("reduction", "none"), ctx)
    if red is None:
        out = xf.index_copy(0, flat_idx, uf)
    else:
        expand_idx = flat_idx.reshape(-1, *([1] * len(rest))).expand_as(uf)
        out = xf.scatter_reduce(0, expand_idx, uf, red, include_self=True)
    return [out.reshape(x.shape)]


@register_op("TensorScatter")
def tensor_scatter(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """Write `update` into a cache along axis at per-batch offsets write_indices (linear or circular)."""
    past, upd, wi = inputs[0], inputs[1], opt(inputs, 2)
    a = axis_of(attrs.get("axis", -2), past.dim())
    mode = attrs.get("mode", "linear")
    b = past.shape[0]
    seq = upd.shape[a]
    maxlen = past.shape[a]
    start = wi.to(torch.int64) if wi is not None else torch.zeros(b, dtype=torch.int64, device=past.device)
    pos = start.reshape(b, 1) + torch.arange(seq, device=past.device).reshape(1, seq)
    if mode == "circular":
        pos = pos % maxlen
    elif mode != "linear":
        raise UnsupportedOpError(ctx.unsupported(f"mode '{mode}'"))
    shape = [1] * past.dim()
    shape[0], shape[a] = b, seq
    index = pos.reshape(shape).expand_as(upd)
    return [past.scatter(a, index, upd)]


# ---------------------------------------------------------------- pad
_PAD_MODES = {"constant": "constant", "reflect": "reflect", "edge": "replicate", "wrap": "circular"}


@register_op("Pad")
def pad_v1(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    pads = ints(attrs.get("pads", attrs.get("paddings")))
    return [_pad(inputs[0], pads, None, attrs.get("mode", "constant"), attrs.get("value", 0.0), ctx)]


@register_op("Pad", since=11)
def pad(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x = inputs[0]
    value = opt(inputs, 2)
    v = 0 if value is None or value.numel() == 0 else value.reshape(()).item()
    axes = ints(opt(inputs, 3)) if opt(inputs, 3) is not None else None
    return [_pad(x, ints(inputs[1]), axes, attrs.get("mode", "constant"), v, ctx)]


def _pad(x: Tensor, pads: list[int], axes: list[int] | None, mode: str, value: Any, ctx: OpContext) -> Tensor:
    r = x.dim()
    axes = list(range(r)) if axes is None else axes_of(axes, r)
    n = len(axes)
    begin = [0] * r
    end = [0] * r
    for j, a in enumerate(axes):
        begin[a], end[a] = pads[j], pads[j + n]
    if mode not in _PAD_MODES:
        raise UnsupportedOpError(ctx.unsupported(f"mode '{mode}'"))
    # negative pads crop first
    if any(p < 0 for p in begin + end):
        x = x[tuple(slice(max(-b, 0), x.shape[i] - max(-e, 0)) for i, (b, e) in enumerate(zip(begin, end)))]
        begin = [max(b, 0) for b in begin]
        end = [max(e, 0) for e in end]
    if not any(begin) and not any(end):
        return x
    if mode == "constant":
        flat = []
        for i in reversed(range(r)):
            flat += [begin[i], end[i]]
        if x.dtype == torch.bool or x.dtype in WIDE_UNSIGNED:
            return F.pad(widen(x.to(torch.int64) if x.dtype == torch.bool else x), flat, value=int(value)).to(x.dtype)
        return F.pad(x, flat, value=value)
    # non-constant modes: pad one axis at a time via index gathering (any rank, any axis)
    for i in range(r):
        if begin[i] == 0 and end[i] == 0:
            continue
        nsz = x.shape[i]
        pos = torch.arange(-begin[i], nsz + end[i], device=x.device)
        if mode == "edge":
            pos = pos.clamp(0, nsz - 1)
        elif mode == "wrap":
            pos = pos % nsz
        else:  # reflect
            if nsz == 1:
                pos = torch.zeros_like(pos)
            else:
                period = 2 * (nsz - 1)
                pos = pos % period
                pos = torch.where(pos >= nsz, period - pos, pos)
        x = torch.index_select(x, i, pos)
    return x


@register_op("CenterCropPad")
def center_crop_pad(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x, shp = inputs[0], ints(inputs[1])
    axes = axes_of(ints(attrs["axes"]), x.dim()) if "axes" in attrs else list(range(x.dim()))
    for a, target in zip(axes, shp):
        n = x.shape[a]
        if target < n:
            s = (n - target) // 2
            x = x.narrow(a, s, target)
        elif target > n:
            before = (target - n) // 2
            after = target - n - before
            pshape = list(x.shape)
            pshape[a] = before
            z1 = torch.zeros(pshape, dtype=x.dtype, device=x.device)
            pshape[a] = after
            z2 = torch.zeros(pshape, dtype=x.dtype, device=x.device)
            x = torch.cat([z1, x, z2], dim=a)
    return [x]


# ---------------------------------------------------------------- layout
@register_op("DepthToSpace")
def depth_to_space(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x = inputs[0]
    b = attrs["blocksize"]
    n, c, h, w = x.shape
    if attrs.get("mode", "DCR") == "DCR":
        y = x.reshape(n, b, b, c // (b * b), h, w).permute(0, 3, 4, 1, 5, 2)
    else:
        y = x.reshape(n, c // (b * b), b, b, h, w).permute(0, 1, 4, 2, 5, 3)
    return [y.reshape(n, c // (b * b), h * b, w * b)]


@register_op("SpaceToDepth")
def space_to_depth(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x = inputs[0]
    b = attrs["blocksize"]
    n, c, h, w = x.shape
    y = x.reshape(n, c, h // b, b, w // b, b)
    if attrs.get("mode", "DCR") == "CRD":
        y = y.permute(0, 1, 3, 5, 2, 4)
    else:
        y = y.permute(0, 3, 5, 1, 2, 4)
    return [y.reshape(n, c * b * b, h // b, w // b)]


@register_op("Trilu")
def trilu(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x = inputs[0]
    k = int(opt(inputs, 1).item()) if opt(inputs, 1) is not None else 0
    if x.numel() == 0:
        return [x.clone()]
    return [torch.triu(x, k) if attrs.get("upper", 1) else torch.tril(x, k)]


@register_op("OneHot")
def one_hot(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    idx, depth, values = inputs[0], inputs[1], inputs[2]
    d = int(depth.reshape(-1)[0].item())
    i = idx.to(torch.int64) if not idx.is_floating_point() else idx.to(torch.int64)
    i = torch.where(i < 0, i + d, i)
    valid = (i >= 0) & (i < d)
    oh = F.one_hot(torch.where(valid, i, torch.zeros_like(i)), d) * valid.unsqueeze(-1).to(torch.int64)
    a = axis_of(attrs.get("axis", -1), idx.dim() + 1)
    oh = oh.movedim(-1, a).bool()
    return [torch.where(oh, values[1], values[0])]


@register_op("Compress")
def compress(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x, cond = inputs[0], inputs[1].to(torch.bool)
    if "axis" not in attrs:
        x = x.reshape(-1)
        a = 0
    else:
        a = axis_of(attrs["axis"], x.dim())
    sel = torch.nonzero(cond[: x.shape[a]]).reshape(-1)
    return [torch.index_select(x, a, sel)]


@register_op("ReverseSequence")
def reverse_sequence(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x, lens = inputs[0], inputs[1].to(torch.int64)
    ta, ba = attrs.get("time_axis", 0), attrs.get("batch_axis", 1)
    t = x.shape[ta]
    pos = torch.arange(t, device=x.device).reshape(t, 1)
    L = lens.reshape(1, -1)
    src = torch.where(pos < L, L - 1 - pos, pos)  # (T, B)
    shape = [1] * x.dim()
    shape[ta], shape[ba] = t, lens.numel()
    return [torch.gather(x, ta, src.reshape(shape).expand_as(x) if ta < ba else src.t().reshape(shape).expand_as(x))]


@register_op("NonZero")
def non_zero(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x = inputs[0]
    if x.dim() == 0:
        return [torch.nonzero(x.reshape(1)).t()[:0] if x.item() == 0 else
                torch.zeros((0, 1), dtype=torch.int64, device=x.device)]
    return [torch.nonzero(x).t().contiguous()]


@register_op("Unique")
def unique(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """Y, indices (first occurrence), inverse_indices, counts; sorted=0 keeps first-occurrence order."""
    x = inputs[0]
    a = attrs.get("axis")
    srt = attrs.get("sorted", 1)
    if a is None:
        xx = x.reshape(-1)
        dim = 0
    else:
        dim = axis_of(a, x.dim())
        xx = x
    u, inv, cnt = torch.unique(xx, sorted=True, return_inverse=True, return_counts=True, dim=dim)
    n = xx.shape[dim]
    pos = torch.arange(n, device=x.device)
    first = torch.full((u.shape[dim],), n, dtype=torch.int64, device=x.device).scatter_reduce(
        0, inv, pos, "amin", include_self=True)
    if not srt:
        order = torch.argsort(first)
        u = torch.index_select(u, dim, order)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel(), device=x.device)
        inv = rank[inv]
        cnt = cnt[order]
        first = first[order]
    return [u, first, inv, cnt]


@register_op("Identity")
def identity(inputs: list[Any], attrs: dict[str, Any], ctx: OpContext) -> list[Any]:
    return [inputs[0]]


@register_op("Col2Im")
def col2im(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """Sum column blocks [N, C * prod(block), L] back into an image [N, C, *image_shape] (N-D F.fold)."""
    x, image, block = inputs[0], ints(inputs[1]), ints(inputs[2])
    nd = len(image)
    dil = ints(attrs.get("dilations", [1] * nd))
    pads = ints(attrs.get("pads", [0] * 2 * nd))
    strides = ints(attrs.get("strides", [1] * nd))
    if nd == 2 and pads[:2] == pads[2:]:
        return [F.fold(x, image, block, dilation=dil, padding=pads[:nd], stride=strides)]
    padded = [image[i] + pads[i] + pads[i + nd] for i in range(nd)]
    counts = [(padded[i] - (dil[i] * (block[i] - 1) + 1)) // strides[i] + 1 for i in range(nd)]
    dev = x.device
    kgrid = torch.meshgrid(*[torch.arange(k, device=dev) for k in block], indexing="ij")
    bgrid = torch.meshgrid(*[torch.arange(c, device=dev) for c in counts], indexing="ij")
    flat = torch.zeros(math.prod(block), math.prod(counts), dtype=torch.int64, device=dev)
    for i in range(nd):
        coord = kgrid[i].reshape(-1, 1) * dil[i] + bgrid[i].reshape(1, -1) * strides[i]
        flat = flat * padded[i] + coord
    n = x.shape[0]
    c = x.shape[1] // math.prod(block)
    cols = x.reshape(n, c, -1)
    out = torch.zeros(n, c, math.prod(padded), dtype=x.dtype, device=dev)
    out = out.scatter_add(2, flat.reshape(1, 1, -1).expand(n, c, -1), cols)
    out = out.reshape(n, c, *padded)
    return [out[(slice(None), slice(None), *[slice(pads[i], pads[i] + image[i]) for i in range(nd)])]]


@register_op("Constant")
def constant(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    if "value" in attrs:
        v = attrs["value"]
        return [v if isinstance(v, torch.Tensor) else torch.as_tensor(v)]
    if "value_float" in attrs:
        return [torch.tensor(attrs["value_float"], dtype=torch.float32)]
    if "value_floats" in attrs:
        return [torch.tensor(list(attrs["value_floats"]), dtype=torch.float32)]
    if "value_int" in attrs:
        return [torch.tensor(attrs["value_int"], dtype=torch.int64)]
    if "value_ints" in attrs:
        return [torch.tensor(list(attrs["value_ints"]), dtype=torch.int64)]
    raise UnsupportedOpError(ctx.unsupported(f"attribute(s) {sorted(attrs)} (string / sparse constants)"))
