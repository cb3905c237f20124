"""Quantize, dequantize and fake-quantize with gradients.

Integer formats (bit-exact with torch's fake-quant kernels for ROUND_HALF_EVEN):

    q  = clamp(round(x * (1/s)) + z, qmin, qmax)      # 1/s in float32, as torch's kernels
    x' = (q - z) * s

Rounding happens before z is added (ONNX QuantizeLinear, torch fake-quant). torch.quantize_per_tensor
/ quantize_per_channel (fbgemm) instead round x/s + z in float32, so on exact ties with an odd zero
point (and, for qint32, beyond 2^24) their int_repr differs from `quantize`; elsewhere it is equal.

FP8 formats (as torchao): q = cast_fp8(clamp(x / s, -fmax, fmax)), x' = float(q) * s.

Scale / zero point broadcast by `spec.granularity`: shape () (or any 1-element shape) per tensor,
(C,) per channel along `spec.axis`, and per group the tensor's shape with dim `axis` replaced by
ceil(L / group_size) (a last, shorter group is allowed).

Non-finite inputs (documented, tested): for integer formats +Inf saturates to qmax, -Inf to qmin
and NaN maps to qmin (the convention of torch.fake_quantize_per_tensor_affine); their STE_CLIP
gradient is 0. For FP8, +-Inf saturate to +-fmax and NaN stays NaN (FP8 has a NaN encoding).

Backward modes (`GradMode`): STE_CLIP (default) passes the gradient where
qmin <= round(x/s) + z <= qmax and 0 elsewhere; STE passes it everywhere; LSQ additionally gives
scale (LSQ) and a floating zero point (LSQ+) gradients, exactly as
torch.ao.quantization._LearnableFakeQuantize computes them:

    inside:  dL/ds = dy * (x' - x) / s * g          dL/dz = 0
    below:   dL/ds = dy * (qmin - z) * g            dL/dz = -dy * s * g
    above:   dL/ds = dy * (qmax - z) * g            dL/dz = -dy * s * g
    g = 1 / sqrt(numel(x) * qmax)   (LSQ gradient scale; override with `lsq_grad_scale`)
"""

from __future__ import annotations

import enum

import torch

from netquant.core.amax_quant import fake_tensor_quant, tensor_quant
from netquant.core.rounding import round_with_policy, round_with_policy_
from netquant.core.spec import Granularity, QuantSpec, RoundingPolicy
from netquant.errors import ConfigError, DataError

__all__ = [
    "GradMode",
    "dequantize",
    "fake_quantize",
    "quantize",
    "fake_tensor_quant",
    "round_with_policy",
    "tensor_quant",
]

# Per-tensor ROUND_HALF_EVEN / STE_CLIP / float32 calls can go to torch's fused kernel, which computes
# exactly our formula. Off by default: our in-place kernel is faster on CPU (benchmarks/fake_quant.py),
# mostly because torch's scalar loop also writes a mask in no-grad mode. Tests run both paths.
_DISPATCH_TO_TORCH = False
# torch.fake_quantize_per_channel_affine casts out-of-range values (|x/s| >= 2^63, +-Inf) to int64
# with undefined behaviour (+Inf comes back as qmin), so the per-channel path uses our own kernel.
_USE_TORCH_PER_CHANNEL = False


class GradMode(enum.Enum):
    """Backward rule of fake_quantize."""

    STE_CLIP = "ste_clip"  # gradient 1 where qmin <= round(x/s)+z <= qmax, else 0
    STE = "ste"  # gradient 1 everywhere
    LSQ = "lsq"  # STE_CLIP for x, plus learned-step-size gradients for scale (and zero point)


# ---------------------------------------------------------------------------------------------
# parameter broadcasting
# ---------------------------------------------------------------------------------------------
def _norm_axis(spec: QuantSpec, x: torch.Tensor) -> int:
    axis = spec.axis
    assert axis is not None
    if not -x.ndim <= axis < x.ndim:
        raise ConfigError(f"{spec.granularity.value} axis={axis} is out of range for a tensor of shape "
                          f"{tuple(x.shape)}; pick an axis in [-{x.ndim}, {x.ndim - 1}]")
    return axis % x.ndim


def _as_param(v: torch.Tensor | float | int | None, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if v is None:
        return torch.zeros((), dtype=dtype, device=like.device)
    if isinstance(v, torch.Tensor):
        return v
    return torch.tensor(v, dtype=dtype, device=like.device)


def param_shape(x_shape: tuple[int, ...] | torch.Size, spec: QuantSpec) -> tuple[int, ...]:
    """Shape of scale / zero point for a tensor of `x_shape` under `spec` (QParams shapes)."""
    if spec.granularity is Granularity.PER_TENSOR:
        return ()
    axis = spec.axis % len(x_shape) if spec.axis is not None and len(x_shape) else 0
    if spec.granularity is Granularity.PER_CHANNEL:
        return (x_shape[axis],)
    assert spec.group_size is not None
    shape = list(x_shape)
    shape[axis] = -(-shape[axis] // spec.group_size)
    return tuple(shape)


def _view_shape(p: torch.Tensor, x: torch.Tensor, spec: QuantSpec, what: str) -> list[int]:
    """Shape to reshape `p` to so that it broadcasts against x (per-group: against groups)."""
    g = spec.granularity
    if g is Granularity.PER_TENSOR:
        if p.numel() != 1:
            raise DataError(f"per-tensor {what} must have one element, got shape {tuple(p.shape)}")
        return []
    axis = _norm_axis(spec, x)
    if what == "zero_point" and p.numel() == 1:  # one zero point shared by all channels / groups
        return []
    n = x.shape[axis] if g is Granularity.PER_CHANNEL else -(-x.shape[axis] // spec.group_size)
    shape = [1] * x.ndim
    shape[axis] = n
    if p.ndim == x.ndim and p.shape[axis] == n and all(
            p.shape[d] in (1, x.shape[d]) for d in range(x.ndim) if d != axis):
        return list(p.shape)
    if p.numel() == n:
        return shape
    want = param_shape(x.shape, spec)
    raise DataError(f"{g.value} {what} has shape {tuple(p.shape)} but a tensor of shape {tuple(x.shape)} "
                    f"needs {want} (axis={spec.axis}"
                    f"{', group_size=' + str(spec.group_size) if spec.group_size else ''})")


def _grouped_view(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor | None:
    """Per-group with whole groups: x viewed as (..., n_groups, group_size, ...), else None."""
    if spec.granularity is not Granularity.PER_GROUP or x.ndim == 0:
        return None
    axis = _norm_axis(spec, x)
    length, gs = x.shape[axis], spec.group_size
    if length % gs:
        return None
    return x.reshape(*x.shape[:axis], length // gs, gs, *x.shape[axis + 1:])


def _expand(p: torch.Tensor, x: torch.Tensor, spec: QuantSpec, what: str, grouped: bool = False) -> torch.Tensor:
    """`p` reshaped so it broadcasts elementwise against `x` (per-group: repeated along axis), or
    with `grouped`, against `_grouped_view(x, spec)` (no copy)."""
    shape = _view_shape(p, x, spec, what)
    p = p.reshape(shape)
    if grouped and shape:
        axis = _norm_axis(spec, x)
        return p.unsqueeze(axis + 1)
    if spec.granularity is Granularity.PER_GROUP and shape:
        axis = _norm_axis(spec, x)
        p = p.repeat_interleave(spec.group_size, dim=axis)
        if p.shape[axis] != x.shape[axis]:
            p = p.narrow(axis, 0, x.shape[axis])
    return p


def _reduce_to(g: torch.Tensor, p: torch.Tensor, x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Sum an x-shaped gradient back to the shape of parameter `p`."""
    gran = spec.granularity
    if gran is Granularity.PER_TENSOR or p.numel() == 1:
        return g.sum().reshape(p.shape)
    axis = _norm_axis(spec, x)
    shape = _view_shape(p, x, spec, "param")
    if gran is Granularity.PER_CHANNEL:
        dims = [d for d in range(x.ndim) if shape[d] == 1]
        return (g.sum(dims) if dims else g).reshape(p.shape)
    gs = spec.group_size
    n_groups = shape[axis]
    length = x.shape[axis]
    if n_groups * gs != length:
        pad_shape = list(g.shape)
        pad_shape[axis] = n_groups * gs - length
        g = torch.cat([g, g.new_zeros(pad_shape)], dim=axis)
    grouped = list(g.shape)
    grouped[axis:axis + 1] = [n_groups, gs]
    g = g.reshape(grouped).sum(axis + 1)
    dims = [d for d in range(x.ndim) if shape[d] == 1 and x.shape[d] != 1]
    if dims:
        g = g.sum(dims, keepdim=True)
    return g.reshape(p.shape)


# ---------------------------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------------------------
def _check_scale(scale: torch.Tensor, what: str = "scale") -> None:
    if not scale.is_floating_point():
        raise DataError(f"{what} must be a floating tensor, got {scale.dtype}")
    s = scale.detach()
    if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
        raise DataError(f"{what} must be finite and > 0 everywhere, got min={s.min().item()}, "
                        f"max={s.max().item()}; recompute it with netquant.choose_qparams")


def _int_zero_point(zero_point: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Zero point as float32 integers: float zero points are rounded (half-even) and clamped, as torch
    learnable fake-quant does; integer zero points must lie in [qmin, qmax]."""
    z = zero_point.detach()
    if z.is_floating_point():
        if not bool(torch.isfinite(z).all()):
            raise DataError("zero_point contains NaN or Inf")
        return torch.round(z).clamp_(spec.qmin, spec.qmax).to(torch.float32)
    if bool(((z < spec.qmin) | (z > spec.qmax)).any()):
        raise DataError(f"zero_point must lie in [{spec.qmin}, {spec.qmax}] for {spec.describe()}, "
                        f"got values in [{z.min().item()}, {z.max().item()}]")
    return z.to(torch.float32)


def _check_input(x: torch.Tensor, fn: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise DataError(f"{fn}: expected a torch.Tensor input, got {type(x).__name__}")
    if not x.is_floating_point():
        raise DataError(f"{fn}: input must be a floating tensor, got {x.dtype}; convert it with .float()")


# ---------------------------------------------------------------------------------------------
# forward kernels (float32 in, float32 out; params already expanded)
# ---------------------------------------------------------------------------------------------
_EXACT_INT = 2**24  # integers up to here are exact in float32


def _is_wide(spec: QuantSpec) -> bool:
    """Ranges beyond float32's exact integers (int32 bias) clamp in float64."""
    return spec.qmax > _EXACT_INT or spec.qmin < -_EXACT_INT


def _int_codes(x: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None, spec: QuantSpec,
               want_mask: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(q, mask): q = clamp(round(x * (1/s)) + z, qmin, qmax) as float (NaN -> qmin, +-Inf saturate)
    and mask = qmin <= round(x * (1/s)) + z <= qmax.

    One fresh float buffer (plus one bool buffer for the mask); every other step is in place,
    because on CPU the cost of fresh pages dominates these memory-bound loops.
    """
    t = torch.mul(x, torch.reciprocal(s))
    t = round_with_policy_(t, spec.rounding, sign_source=x)  # t = x / s has the signs of x
    if _is_wide(spec):
        t = t.to(torch.float64)
    if z is not None:
        t.add_(z)
    qmin, qmax = float(spec.qmin), float(spec.qmax)
    mask = None
    if want_mask:
        mask = t.ge(qmin)
        mask &= t.le(qmax)
    t.nan_to_num_(nan=qmin)
    t.clamp_(qmin, qmax)
    return t, mask


def _quant_int(x: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None, spec: QuantSpec) -> torch.Tensor:
    """q = clamp(round(x * (1/s)) + z, qmin, qmax) in spec.storage_dtype."""
    q, _ = _int_codes(x, s, z, spec, False)
    return q.to(spec.storage_dtype)


def _fake_int(x: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None, spec: QuantSpec,
              want_mask: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x' = (q - z) * s in float32, and the STE_CLIP mask."""
    t, mask = _int_codes(x, s, z, spec, want_mask)
    if z is not None:
        t.sub_(z)
    if t.dtype != torch.float32:
        t = t.to(torch.float32)
    return t.mul_(s), mask


def _scaled_fp8(x: torch.Tensor, s: torch.Tensor, spec: QuantSpec,
                want_mask: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    t = torch.div(x, s)
    fmax = spec.fp_max
    mask = None
    if want_mask:
        mask = t.ge(-fmax)
        mask &= t.le(fmax)
    t.clamp_(-fmax, fmax)
    return t, mask


def _fake_fp8(x: torch.Tensor, s: torch.Tensor, spec: QuantSpec,
              want_mask: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    t, mask = _scaled_fp8(x, s, spec, want_mask)
    out = t.to(spec.storage_dtype).to(torch.float32)
    return out.mul_(s), mask


# ---------------------------------------------------------------------------------------------
# autograd function
# ---------------------------------------------------------------------------------------------
class _FakeQuantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, spec: QuantSpec,
                grad_mode: GradMode, grad_factor: float) -> torch.Tensor:  # type: ignore[override]
        xg = _grouped_view(x, spec)
        grouped = xg is not None
        s = _expand(scale.detach().to(torch.float32), x, spec, "scale", grouped)
        z = None
        if not spec.is_float:
            zf = _int_zero_point(zero_point, spec)
            if bool((zf != 0).any()):
                z = _expand(zf, x, spec, "zero_point", grouped)
        want_mask = grad_mode is GradMode.STE_CLIP and ctx.needs_input_grad[0]
        xin = xg if grouped else x
        if spec.is_float:
            out, mask = _fake_fp8(xin, s, spec, want_mask)
        else:
            out, mask = _fake_int(xin, s, z, spec, want_mask)
        if grouped:
            out = out.reshape(x.shape)
            mask = mask.reshape(x.shape) if mask is not None else None
        ctx.spec, ctx.grad_mode, ctx.grad_factor = spec, grad_mode, grad_factor
        if grad_mode is GradMode.STE_CLIP:
            ctx.save_for_backward(mask)
        elif grad_mode is GradMode.LSQ:
            ctx.save_for_backward(x, scale, zero_point)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        mode = ctx.grad_mode
        if mode is GradMode.STE:
            return grad, None, None, None, None, None
        if mode is GradMode.STE_CLIP:
            (mask,) = ctx.saved_tensors
            return (grad * mask if mask is not None else None), None, None, None, None, None
        x, scale, zero_point = ctx.saved_tensors
        spec: QuantSpec = ctx.spec
        dx, ds_full, dz_full = _lsq_backward(x, grad, scale, zero_point, spec, ctx.grad_factor)
        ds = _reduce_to(ds_full, scale, x, spec).to(scale.dtype) if ctx.needs_input_grad[1] else None
        dz = None
        if ctx.needs_input_grad[2] and dz_full is not None:
            dz = _reduce_to(dz_full, zero_point, x, spec).to(zero_point.dtype)
        return dx if ctx.needs_input_grad[0] else None, ds, dz, None, None, None


def _lsq_backward(x: torch.Tensor, dy: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
                  spec: QuantSpec, gf: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Elementwise LSQ / LSQ+ gradients, operation for operation as torch's learnable kernels."""
    s = _expand(scale.detach().to(torch.float32), x, spec, "scale")
    dy = dy.to(torch.float32)
    if spec.is_float:
        fmax = spec.fp_max
        t, _ = _scaled_fp8(x, s, spec, False)
        raw = torch.div(x, s)
        below = ~(raw >= -fmax)
        above = raw > fmax
        inside = ~(below | above)
        xfq = t.to(spec.storage_dtype).to(torch.float32).mul_(s)
        ds_in = dy * (xfq - x) / s * gf
        ds = torch.where(below, dy * (-fmax) * gf, torch.where(above, dy * fmax * gf, ds_in))
        return dy * inside, ds, None
    z = _expand(_int_zero_point(zero_point, spec), x, spec, "zero_point")
    inv = torch.reciprocal(s)
    # torch's CPU kernels are compiled with FMA contraction: round(fma(x, 1/s, z)) and
    # fma(q - z, s, -x) round once; float64 intermediates reproduce that single rounding.
    x64 = x.to(torch.float64)
    xq = round_with_policy_(torch.mul(x64, inv.to(torch.float64)).add_(z).to(torch.float32), spec.rounding)
    below = ~(xq >= spec.qmin)  # NaN counts as below (torch casts it to INT64_MIN)
    above = xq > spec.qmax
    inside = ~(below | above)
    dx = dy * inside
    diff = (xq.clamp(spec.qmin, spec.qmax) - z).to(torch.float64).mul_(s).sub_(x64).to(torch.float32)
    ds_in = dy * diff * inv * gf
    ds_lo = dy * (spec.qmin - z) * gf
    ds_hi = dy * (spec.qmax - z) * gf
    ds = torch.where(below, ds_lo, torch.where(above, ds_hi, ds_in))
    dz = None
    if zero_point.is_floating_point():
        dz = torch.where(inside, torch.zeros((), dtype=dy.dtype, device=dy.device), dy * (-1) * s * gf)
    return dx, ds, dz


def _torch_fast_path(x: torch.Tensor, spec: QuantSpec, grad_mode: GradMode) -> bool:
    """True when torch's fused fake-quant kernel has exactly our semantics."""
    return (_DISPATCH_TO_TORCH and not spec.is_float and spec.rounding is RoundingPolicy.ROUND_HALF_EVEN
            and grad_mode is GradMode.STE_CLIP and x.dtype == torch.float32
            and (spec.granularity is Granularity.PER_TENSOR
                 or (_USE_TORCH_PER_CHANNEL and spec.granularity is Granularity.PER_CHANNEL)))


def default_lsq_grad_scale(x: torch.Tensor, spec: QuantSpec) -> float:
    """LSQ gradient scale 1 / sqrt(numel(x) * qmax) (torch.ao's _LearnableFakeQuantize)."""
    qmax = spec.fp_max if spec.is_float else (spec.qmax if spec.qmax > 0 else spec.qmax - spec.qmin)
    return 1.0 / (max(x.numel(), 1) * qmax) ** 0.5


# ---------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------
def fake_quantize(x: torch.Tensor, scale: torch.Tensor | float, zero_point: torch.Tensor | int | None,
                  spec: QuantSpec, grad_mode: GradMode = GradMode.STE_CLIP,
                  lsq_grad_scale: float | None = None) -> torch.Tensor:
    """Differentiable x' = dequantize(quantize(x)) in x's dtype (computed in float32).

    With grad_mode=LSQ, `scale` (and a floating `zero_point`, LSQ+) receive gradients.
    """
    _check_input(x, "fake_quantize")
    if not isinstance(grad_mode, GradMode):
        raise ConfigError(f"grad_mode must be a netquant GradMode, got {grad_mode!r}")
    scale = _as_param(scale, x, torch.float32)
    zero_point = _as_param(zero_point, x, torch.int32)
    _check_scale(scale)
    _view_shape(scale, x, spec, "scale")
    if not spec.is_float:
        _view_shape(zero_point, x, spec, "zero_point")
    if x.numel() == 0:  # no values; a learned scale / zero point stays in the graph with a zero gradient (DDP
        out = x.clone()  # needs every parameter used on every rank, also on a rank whose share is empty)
        for p in (scale, zero_point):
            if p.requires_grad:
                out = out + (p.sum() * 0).to(out.dtype)
        return out
    if _torch_fast_path(x, spec, grad_mode) and not zero_point.is_floating_point():
        z = zero_point.detach()
        if bool(((z >= spec.qmin) & (z <= spec.qmax)).all()):
            if spec.granularity is Granularity.PER_TENSOR:
                return torch.fake_quantize_per_tensor_affine(
                    x, scale.detach().reshape(()).to(torch.float32), z.reshape(()).to(torch.int32),
                    spec.qmin, spec.qmax)
            return torch.fake_quantize_per_channel_affine(
                x, scale.detach().reshape(-1).to(torch.float32), z.reshape(-1).to(torch.int32),
                _norm_axis(spec, x), spec.qmin, spec.qmax)
    gf = default_lsq_grad_scale(x, spec) if lsq_grad_scale is None else float(lsq_grad_scale)
    x32 = x if x.dtype == torch.float32 else x.to(torch.float32)
    out = _FakeQuantize.apply(x32, scale, zero_point, spec, grad_mode, gf)
    return out if out.dtype == x.dtype else out.to(x.dtype)


@torch.no_grad()
def quantize(x: torch.Tensor, scale: torch.Tensor | float, zero_point: torch.Tensor | int | None,
             spec: QuantSpec) -> torch.Tensor:
    """q = clamp(round(x * (1/s)) + z, qmin, qmax) as `spec.storage_dtype` (FP8: cast of clamp(x/s))."""
    _check_input(x, "quantize")
    scale = _as_param(scale, x, torch.float32)
    zero_point = _as_param(zero_point, x, torch.int32)
    _check_scale(scale)
    x32 = x.detach().to(torch.float32)
    xg = _grouped_view(x32, spec)
    grouped = xg is not None
    s = _expand(scale.detach().to(torch.float32), x32, spec, "scale", grouped)
    xin = xg if grouped else x32
    if spec.is_float:
        t, _ = _scaled_fp8(xin, s, spec, False)
        return t.to(spec.storage_dtype).reshape(x.shape)
    zf = _int_zero_point(zero_point, spec)
    z = _expand(zf, x32, spec, "zero_point", grouped) if bool((zf != 0).any()) else None
    return _quant_int(xin, s, z, spec).reshape(x.shape)


def dequantize(q: torch.Tensor, scale: torch.Tensor | float, zero_point: torch.Tensor | int | None,
               spec: QuantSpec) -> torch.Tensor:
    """x' = (q - z) * s in float32 (FP8: float(q) * s); differentiable w.r.t. scale."""
    if not isinstance(q, torch.Tensor):
        raise DataError(f"dequantize: expected a torch.Tensor, got {type(q).__name__}")
    scale = _as_param(scale, q, torch.float32)
    zero_point = _as_param(zero_point, q, torch.int32)
    qg = _grouped_view(q, spec)
    grouped = qg is not None
    qin = qg if grouped else q
    s = _expand(scale.to(torch.float32), q, spec, "scale", grouped)
    if spec.is_float:
        return (qin.to(torch.float32) * s).reshape(q.shape)
    if _is_wide(spec):  # exact integer difference, then one rounding to float32 (as torch's int32 path)
        z64 = _expand(zero_point.detach().to(torch.float64), q, spec, "zero_point", grouped)
        return ((qin.to(torch.float64) - z64).to(torch.float32) * s).reshape(q.shape)
    z = _expand(zero_point.to(torch.float32), q, spec, "zero_point", grouped)
    return ((qin.to(torch.float32) - z) * s).reshape(q.shape)
