"""Everything else: Constant, Dropout, attention ops, losses, grid sampling, NMS, sequences/optionals,
training optimisers, a few ai.onnx.ml ops."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from netquant.errors import UnsupportedOpError

from ._util import axis_of, ints, opt, scalar
from .registry import OpContext, register_op

Tensor = torch.Tensor
TRAINING = "ai.onnx.preview.training"


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


@register_op("Dropout")
def dropout(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """Inference: identity with an all-true mask.  Training mode: y = x * mask / (1 - ratio)."""
    x = inputs[0]
    if ctx.opset >= 12:
        ratio = scalar(opt(inputs, 1), 0.5)
        training = bool(scalar(opt(inputs, 2), False))
    else:
        ratio = attrs.get("ratio", 0.5)
        training = False
    if not training or ratio == 0:
        mask = torch.ones_like(x, dtype=torch.bool)
        return [x, mask if ctx.opset >= 12 else mask.to(x.dtype)]
    gen = torch.Generator(device=x.device)
    if "seed" in attrs:
        gen.manual_seed(int(attrs["seed"]))
    else:
        gen.seed()
    mask = torch.rand(x.shape, generator=gen, device=x.device) >= ratio
    return [x * mask / (1.0 - ratio), mask]


# ---------------------------------------------------------------- attention family
@register_op("Attention")
def attention(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """softmax(Q K^T * scale + bias) V with GQA, KV cache, causal / sliding window masks and softcap."""
    q, k, v = inputs[0], inputs[1], inputs[2]
    mask, past_k, past_v, nonpad = opt(inputs, 3), opt(inputs, 4), opt(inputs, 5), opt(inputs, 6)
    is_causal = attrs.get("is_causal", 0)
    qh, kvh = attrs.get("q_num_heads"), attrs.get("kv_num_heads")
    softcap = attrs.get("softcap", 0.0)
    mode = attrs.get("qk_matmul_output_mode", 0)
    left, right = attrs.get("left_window_size", -1), attrs.get("right_window_size", -1)
    rank3 = q.dim() == 3
    b = q.shape[0]
    if rank3:
        q = q.reshape(b, q.shape[1], qh, -1).transpose(1, 2)
        k = k.reshape(b, k.shape[1], kvh, -1).transpose(1, 2)
        v = v.reshape(b, v.shape[1], kvh, -1).transpose(1, 2)
    scale = attrs.get("scale")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[3])
    present_k = torch.cat([past_k, k], dim=2) if past_k is not None else k
    present_v = torch.cat([past_v, v], dim=2) if past_v is not None else v
    k, v = present_k, present_v
    lq, lk = q.shape[2], k.shape[2]
    dt = q.dtype
    neg_inf = torch.tensor(-math.inf, dtype=dt, device=q.device)
    zero = torch.tensor(0.0, dtype=dt, device=q.device)
    bias = torch.zeros(lq, lk, dtype=dt, device=q.device)
    if mask is not None:
        pad = lk - mask.shape[-1]
        if pad > 0:
            mask = F.pad(mask, [0, pad], value=False if mask.dtype == torch.bool else -math.inf)
        if mask.dtype == torch.bool:
            mask = torch.where(mask, zero, neg_inf)
    i_idx = torch.arange(lq, device=q.device).reshape(lq, 1)
    j_idx = torch.arange(lk, device=q.device).reshape(1, lk)
    if past_k is None and nonpad is not None:
        offset = (nonpad.reshape(-1, 1, 1, 1).to(torch.int64) - lq)
    else:
        offset = past_k.shape[2] if past_k is not None else 0
    if is_causal:
        base = bias if mask is None else mask
        bias = base + torch.where(j_idx <= i_idx + offset, zero, neg_inf)
    elif mask is not None:
        bias = bias + mask
    if left >= 0 or right >= 0:
        diff = (i_idx + offset) - j_idx
        allowed = torch.ones_like(diff, dtype=torch.bool)
        if left >= 0:
            allowed = allowed & (diff <= left)
        if right >= 0:
            allowed = allowed & (-diff <= right)
        bias = bias + torch.where(allowed, zero, neg_inf)
    if nonpad is not None:
        pm = torch.arange(lk, device=q.device).reshape(1, lk) < nonpad.reshape(-1, 1)
        bias = bias + torch.where(pm, zero, neg_inf).reshape(b, 1, 1, lk)
    nq, nk = q.shape[1], k.shape[1]
    if nq != nk and nq % nk == 0:
        k = k.repeat_interleave(nq // nk, dim=1)
        v = v.repeat_interleave(nq // nk, dim=1)
    root = torch.tensor(math.sqrt(scale), dtype=dt, device=q.device)  # applied to q and k, as the reference
    qk = torch.matmul(q * root, (k * root).transpose(-1, -2))
    if softcap and softcap > 0:
        qk = softcap * torch.tanh(qk / softcap)
    qk_bias = qk + bias
    qk_out = qk_bias if mode == 2 else qk
    sm_in = qk_bias
    if attrs.get("softmax_precision"):
        from ._util import onnx_dtype
        sm_in = sm_in.to(onnx_dtype(attrs["softmax_precision"], ctx))
    row_max = sm_in.amax(dim=-1, keepdim=True)
    safe = torch.where(torch.isneginf(row_max), torch.zeros_like(row_max), row_max)
    e = torch.exp(sm_in - safe)
    s = e.sum(dim=-1, keepdim=True)
    probs = e / torch.where(s == 0, torch.ones_like(s), s)
    all_masked = torch.isneginf(bias.amax(dim=-1, keepdim=True))
    probs = torch.where(all_masked, torch.zeros_like(probs), probs)
    if mode == 3:
        qk_out = probs
    probs = probs.to(dt)
    y = torch.matmul(probs, v)
    if rank3:
        y = y.transpose(1, 2).reshape(b, y.shape[2], -1)
    return [y, present_k, present_v, qk_out.to(dt)][: max(ctx.num_outputs, 1)]


@register_op("RotaryEmbedding")
def rotary_embedding(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x, cos, sin, pos = inputs[0], inputs[1], inputs[2], opt(inputs, 3)
    orig = x.shape
    if x.dim() == 4:
        x = x.transpose(1, 2)  # (B, S, H, D)
    else:
        x = x.reshape(x.shape[0], x.shape[1], attrs["num_heads"], -1)
    d = x.shape[3]
    rd = attrs.get("rotary_embedding_dim", 0) or d
    xr, xp = x[..., :rd], x[..., rd:]
    if pos is not None:
        cos, sin = cos[pos.to(torch.int64)], sin[pos.to(torch.int64)]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    interleaved = attrs.get("interleaved", 0)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    else:
        x1, x2 = xr.chunk(2, dim=-1)
    real = cos * x1 - sin * x2
    imag = sin * x1 + cos * x2
    rot = torch.stack([real, imag], dim=-1).reshape(xr.shape) if interleaved else torch.cat([real, imag], -1)
    out = torch.cat([rot, xp], dim=-1)
    return [out.reshape(orig) if len(orig) == 3 else out.transpose(1, 2)]


@register_op("SwiGLU")
def swiglu(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """y = a * sigmoid(alpha * a) * b."""
    a, b = inputs[0], inputs[1]
    alpha = attrs.get("alpha", 1.0)
    return [a * torch.sigmoid(alpha * a) * b]


# ---------------------------------------------------------------- losses
def _nll(logp: Tensor, target: Tensor, weight: Tensor | None, reduction: str, ignore: int | None,
         ctx: OpContext) -> Tensor:
    if reduction not in ("none", "sum", "mean"):
        raise UnsupportedOpError(ctx.unsupported(f"reduction '{reduction}'"))
    t = target.to(torch.int64)
    ignore_index = -100 if ignore is None else ignore
    if ignore is None and bool((t == -100).any()):
        ignore_index = -(2**62)
    return F.nll_loss(logp, t, weight, ignore_index=ignore_index, reduction=reduction)


@register_op("NegativeLogLikelihoodLoss")
def nll_loss(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x, target, w = inputs[0], inputs[1], opt(inputs, 2)
    return [_nll(x, target, w, attrs.get("reduction", "mean"), attrs.get("ignore_index"), ctx)]


@register_op("SoftmaxCrossEntropyLoss")
def softmax_cross_entropy_loss(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x, target, w = inputs[0], inputs[1], opt(inputs, 2)
    logp = torch.log_softmax(x, dim=1)
    loss = _nll(logp, target, w, attrs.get("reduction", "mean"), attrs.get("ignore_index"), ctx)
    return [loss, logp][: max(ctx.num_outputs, 1)]


# ---------------------------------------------------------------- spatial sampling
_GRID_MODES = {"bilinear": "bilinear", "linear": "bilinear", "nearest": "nearest", "bicubic": "bicubic",
               "cubic": "bicubic"}


@register_op("GridSample")
def grid_sample(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x, grid = inputs[0], inputs[1]
    mode = attrs.get("mode", "linear" if ctx.opset >= 20 else "bilinear")
    pad = attrs.get("padding_mode", "zeros")
    if mode not in _GRID_MODES or pad not in ("zeros", "border", "reflection"):
        raise UnsupportedOpError(ctx.unsupported(f"mode '{mode}' / padding_mode '{pad}'"))
    m = _GRID_MODES[mode]
    if x.dim() == 5 and m == "bicubic":
        raise UnsupportedOpError(ctx.unsupported("cubic mode on volumetric (5-D) input"))
    return [F.grid_sample(x, grid.to(x.dtype), mode=m, padding_mode=pad,
                          align_corners=bool(attrs.get("align_corners", 0)))]


@register_op("AffineGrid")
def affine_grid(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    theta, size = inputs[0], ints(inputs[1])
    return [F.affine_grid(theta, size, align_corners=bool(attrs.get("align_corners", 0)))]


@register_op("NonMaxSuppression")
def non_max_suppression(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """Greedy per-(batch, class) NMS; returns int64 [num_selected, 3] = (batch, class, box)."""
    device = inputs[0].device
    boxes, scores = inputs[0].detach().cpu(), inputs[1].detach().cpu()  # greedy selection runs on the CPU
    max_out = int(scalar(opt(inputs, 2), 0))
    iou_thr = float(scalar(opt(inputs, 3), 0.0))
    score_thr = opt(inputs, 4)
    if boxes.shape[1] == 0 or max_out <= 0:
        return [torch.zeros((0, 3), dtype=torch.int64, device=device)]
    b = boxes.double()
    if attrs.get("center_point_box", 0):
        cx, cy, w, h = b.unbind(-1)
        y1, x1, y2, x2 = cy - h / 2, cx - w / 2, cy + h / 2, cx + w / 2
    else:
        ya, xa, yb, xb = b.unbind(-1)
        y1, y2 = torch.minimum(ya, yb), torch.maximum(ya, yb)
        x1, x2 = torch.minimum(xa, xb), torch.maximum(xa, xb)
    area = (y2 - y1) * (x2 - x1)
    selected = []
    for bi in range(scores.shape[0]):
        iy1 = torch.maximum(y1[bi, :, None], y1[bi, None, :])
        ix1 = torch.maximum(x1[bi, :, None], x1[bi, None, :])
        iy2 = torch.minimum(y2[bi, :, None], y2[bi, None, :])
        ix2 = torch.minimum(x2[bi, :, None], x2[bi, None, :])
        inter = (iy2 - iy1).clamp(min=0) * (ix2 - ix1).clamp(min=0)
        union = area[bi, :, None] + area[bi, None, :] - inter
        iou = torch.where(union > 0, inter / union, torch.zeros_like(inter))
        for ci in range(scores.shape[1]):
            sc = scores[bi, ci].double()
            order = torch.sort(sc, descending=True, stable=True).indices
            if score_thr is not None:
                order = order[sc[order] > float(scalar(score_thr))]
            keep: list[int] = []
            suppressed = torch.zeros(sc.shape[0], dtype=torch.bool)
            for idx in order.tolist():
                if len(keep) >= max_out:
                    break
                if suppressed[idx]:
                    continue
                keep.append(idx)
                suppressed |= iou[idx] > iou_thr
            selected += [[bi, ci, k] for k in keep]
    if not selected:
        return [torch.zeros((0, 3), dtype=torch.int64, device=device)]
    return [torch.tensor(selected, dtype=torch.int64, device=device)]


# ---------------------------------------------------------------- sequences and optionals (python lists / None)
@register_op("SequenceEmpty")
def sequence_empty(inputs: list[Any], attrs: dict[str, Any], ctx: OpContext) -> list[Any]:
    return [[]]


@register_op("SequenceConstruct")
def sequence_construct(inputs: list[Any], attrs: dict[str, Any], ctx: OpContext) -> list[Any]:
    return [list(inputs)]


@register_op("SequenceLength")
def sequence_length(inputs: list[Any], attrs: dict[str, Any], ctx: OpContext) -> list[Any]:
    return [torch.tensor(len(inputs[0]), dtype=torch.int64)]


def _pos(p: Tensor | None, n: int, default: int) -> int:
    if p is None:
        return default
    i = int(p.reshape(-1)[0])
    return i + n if i < 0 else i


@register_op("SequenceAt")
def sequence_at(inputs: list[Any], attrs: dict[str, Any], ctx: OpContext) -> list[Any]:
    seq = inputs[0]
    return [seq[_pos(inputs[1], len(seq), 0)]]


@register_op("SequenceInsert")
def sequence_insert(inputs: list[Any], attrs: dict[str, Any], ctx: OpContext) -> list[Any]:
    seq = list(inputs[0])
    seq.insert(_pos(opt(inputs, 2), len(seq), len(seq)), inputs[1])
    return [seq]


@register_op("SequenceErase")
def sequence_erase(inputs: list[Any], attrs: dict[str, Any], ctx: OpContext) -> list[Any]:
    seq = list(inputs[0])
    del seq[_pos(opt(inputs, 1), len(seq), len(seq) - 1)]
    return [seq]


@register_op("ConcatFromSequence")
def concat_from_sequence(inputs: list[Any], attrs: dict[str, Any], ctx: OpContext) -> list[Any]:
    seq = inputs[0]
    a = attrs["axis"]
    if attrs.get("new_axis", 0):
        return [torch.stack(seq, dim=axis_of(a, seq[0].dim() + 1))]
    return [torch.cat(seq, dim=a)]


@register_op("SplitToSequence")
def split_to_sequence(inputs: list[Any], attrs: dict[str, Any], ctx: OpContext) -> list[Any]:
    x, split = inputs[0], opt(inputs, 1)
    a = axis_of(attrs.get("axis", 0), x.dim())
    if split is None:
        parts = list(torch.split(x, 1, dim=a))
        if not attrs.get("keepdims", 1):
            parts = [p.squeeze(a) for p in parts]
        return [parts]
    if split.dim() == 0:
        return [list(torch.split(x, int(split), dim=a))]
    return [list(torch.split(x, ints(split), dim=a))]


@register_op("Optional")
def optional(inputs: list[Any], attrs: dict[str, Any], ctx: OpContext) -> list[Any]:
    return [opt(inputs, 0)]


@register_op("OptionalHasElement")
def optional_has_element(inputs: list[Any], attrs: dict[str, Any], ctx: OpContext) -> list[Any]:
    return [torch.tensor(opt(inputs, 0) is not None)]


@register_op("OptionalGetElement")
def optional_get_element(inputs: list[Any], attrs: dict[str, Any], ctx: OpContext) -> list[Any]:
    if inputs[0] is None:
        raise UnsupportedOpError(ctx.unsupported("reading an empty optional"))
    return [inputs[0]]


# ---------------------------------------------------------------- training optimisers (preview domain)
@register_op("Adagrad", domain=TRAINING)
def adagrad(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    r, t = inputs[0], inputs[1]
    n = (len(inputs) - 2) // 3
    xs, gs, hs = inputs[2:2 + n], inputs[2 + n:2 + 2 * n], inputs[2 + 2 * n:]
    decay, eps, norm = attrs.get("decay_factor", 0.0), attrs.get("epsilon", 0.0), attrs.get("norm_coefficient", 0.0)
    lr = r / (1 + t * decay)
    new_x, new_h = [], []
    for x, g, h in zip(xs, gs, hs):
        g = norm * x + g
        h2 = h + g * g
        new_x.append((x - lr * g / (torch.sqrt(h2) + eps)).to(x.dtype))
        new_h.append(h2.to(h.dtype))
    return new_x + new_h


@register_op("Momentum", domain=TRAINING)
def momentum(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    r, t = inputs[0], inputs[1]
    n = (len(inputs) - 2) // 3
    xs, gs, vs = inputs[2:2 + n], inputs[2 + n:2 + 2 * n], inputs[2 + 2 * n:]
    alpha, beta, norm = attrs["alpha"], attrs["beta"], attrs.get("norm_coefficient", 0.0)
    mode = attrs.get("mode", "standard")
    beta_adj = beta if int(t) > 0 else 1.0
    new_x, new_v = [], []
    for x, g, v in zip(xs, gs, vs):
        g = norm * x + g
        v2 = alpha * v + beta_adj * g
        step = v2 if mode == "standard" else g + alpha * v2
        new_x.append((x - r * step).to(x.dtype))
        new_v.append(v2.to(v.dtype))
    return new_x + new_v


@register_op("Adam", domain=TRAINING)
def adam(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    r, t = inputs[0], inputs[1]
    n = (len(inputs) - 2) // 4
    xs, gs = inputs[2:2 + n], inputs[2 + n:2 + 2 * n]
    vs, hs = inputs[2 + 2 * n:2 + 3 * n], inputs[2 + 3 * n:]
    alpha, beta = attrs.get("alpha", 0.9), attrs.get("beta", 0.999)
    eps, norm, post = attrs.get("epsilon", 1e-6), attrs.get("norm_coefficient", 0.0), \
        attrs.get("norm_coefficient_post", 0.0)
    tt = float(t)
    lr = r * math.sqrt(1 - beta**tt) / (1 - alpha**tt) if tt > 0 else r
    new_x, new_v, new_h = [], [], []
    for x, g, v, h in zip(xs, gs, vs, hs):
        g = norm * x + g
        v2 = alpha * v + (1 - alpha) * g
        h2 = beta * h + (1 - beta) * g * g
        x2 = (x - lr * (v2 / (torch.sqrt(h2) + eps))) * (1 - post)
        new_x.append(x2.to(x.dtype))
        new_v.append(v2.to(v.dtype))
        new_h.append(h2.to(h.dtype))
    return new_x + new_v + new_h


# ---------------------------------------------------------------- recurrent-state sequence ops (opset 25+)
@register_op("CausalConvWithState")
def causal_conv_with_state(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """Depthwise causal conv1d over [past_state, input]; returns (y, last k-1 steps as present_state)."""
    x, w, b, past = inputs[0], inputs[1], opt(inputs, 2), opt(inputs, 3)
    act = attrs.get("activation", "none")
    if act not in ("none", "silu", "swish"):
        raise UnsupportedOpError(ctx.unsupported(f"activation '{act}'"))
    k = w.shape[2]
    if past is None:
        past = x.new_zeros(x.shape[0], x.shape[1], k - 1)
    padded = torch.cat([past, x], dim=2)
    y = F.conv1d(padded, w, b, groups=x.shape[1])
    if act != "none":
        y = F.silu(y.float()).to(x.dtype)
    return [y, padded[:, :, padded.shape[2] - (k - 1):]]


@register_op("LinearAttention")
def linear_attention(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """Recurrent linear attention: S <- S * exp(g) (gated); v <- beta * (v - S^T k) (delta);
    S <- S + k v^T; o = scale * q^T S.  Float32 state; one step per token."""
    q, k, v = inputs[0], inputs[1], inputs[2]
    past, decay, beta = opt(inputs, 3), opt(inputs, 4), opt(inputs, 5)
    rule = attrs.get("update_rule", "gated_delta")
    if rule not in ("linear", "gated", "delta", "gated_delta"):
        raise UnsupportedOpError(ctx.unsupported(f"update_rule '{rule}'"))
    hq, hkv = attrs["q_num_heads"], attrs["kv_num_heads"]
    gating, delta = rule in ("gated", "gated_delta"), rule in ("delta", "gated_delta")
    b, t, _ = q.shape
    dk, dv = q.shape[-1] // hq, v.shape[-1] // hkv
    group = hq // hkv

    def heads(x: Tensor, h: int) -> Tensor:
        return x.reshape(b, t, h, -1).transpose(1, 2).float()

    q4, k4, v4 = heads(q, hq), heads(k, hkv), heads(v, hkv)
    g4 = beta4 = None
    if gating:
        g4 = heads(decay, hkv)  # (B, H, T, 1 or dk)
    if delta:
        beta4 = beta.reshape(b, t, beta.shape[-1], 1).transpose(1, 2).float()
    state = past.float().clone() if past is not None else q.new_zeros(b, hkv, dk, dv, dtype=torch.float32)
    scale = attrs.get("scale") or 1.0 / math.sqrt(dk)
    outs = []
    for i in range(t):
        kt, vt = k4[:, :, i], v4[:, :, i]
        if gating:
            state = state * torch.exp(g4[:, :, i]).unsqueeze(-1)
        if delta:
            vt = beta4[:, :, i] * (vt - torch.einsum("bhdm,bhd->bhm", state, kt))
        state = state + kt.unsqueeze(-1) * vt.unsqueeze(-2)
        read = state if group == 1 else state.repeat_interleave(group, dim=1)
        outs.append(scale * torch.einsum("bhd,bhdm->bhm", q4[:, :, i], read))
    y = torch.stack(outs, dim=2).transpose(1, 2).reshape(b, t, hq * dv).to(q.dtype)
    return [y, state.to(past.dtype if past is not None else q.dtype)]


def _subgraph_runner(ctx: OpContext):  # noqa: ANN202
    if ctx.run_subgraph is None:
        raise UnsupportedOpError(ctx.unsupported("running a subgraph outside an Executor"))
    return ctx.run_subgraph


@register_op("FlexAttention", domain="ai.onnx.preview")
def flex_attention(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """softmax(score_mod(Q K^T * scale)) V, then optional prob_mod on the probabilities (GQA aware)."""
    q, k, v = inputs[0], inputs[1], inputs[2]
    hq, hkv = q.shape[1], k.shape[1]
    if hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    scale = attrs.get("scale")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[3])
    root = torch.tensor(math.sqrt(scale), dtype=torch.float32).to(q.dtype)
    scores = torch.matmul(q * root, (k * root).transpose(-1, -2))
    if attrs.get("softmax_precision"):
        from ._util import onnx_dtype
        cdt = onnx_dtype(attrs["softmax_precision"], ctx)
    else:
        cdt = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    scores = scores.to(cdt)
    if attrs.get("score_mod") is not None:
        scores = _subgraph_runner(ctx)(attrs["score_mod"], [scores])[0].to(cdt)
    probs = torch.softmax(scores, dim=-1)
    if attrs.get("prob_mod") is not None:
        probs = _subgraph_runner(ctx)(attrs["prob_mod"], [probs])[0].to(cdt)
    return [torch.matmul(probs, v.to(cdt)).to(v.dtype)]


@register_op("SequenceMap")
def sequence_map(inputs: list[Any], attrs: dict[str, Any], ctx: OpContext) -> list[Any]:
    """Run `body` once per element of the input sequence; extra inputs are indexed when sequences."""
    seq, extra = inputs[0], list(inputs[1:])
    run = _subgraph_runner(ctx)
    outs: list[list[Any]] | None = None
    for i, item in enumerate(seq):
        args = [item] + [a[i] if isinstance(a, list) else a for a in extra]
        res = run(attrs["body"], args)
        if outs is None:
            outs = [[] for _ in res]
        for acc, r in zip(outs, res):
            acc.append(r)
    return outs if outs is not None else [[] for _ in range(ctx.num_outputs)]


@register_op("ImageDecoder")
def image_decoder(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """Decode an encoded image (uint8 bytes) with Pillow into HWC uint8 (RGB, BGR or Grayscale)."""
    import io

    import numpy as np
    from PIL import Image

    fmt = attrs.get("pixel_format", "RGB")
    img = Image.open(io.BytesIO(inputs[0].detach().cpu().numpy().tobytes()))
    if fmt == "RGB":
        arr = np.array(img.convert("RGB"))
    elif fmt == "BGR":
        arr = np.array(img.convert("RGB"))[:, :, ::-1]
    elif fmt == "Grayscale":
        arr = np.array(img.convert("L"))[:, :, None]
    else:
        raise UnsupportedOpError(ctx.unsupported(f"pixel_format '{fmt}'"))
    return [torch.from_numpy(np.ascontiguousarray(arr)).to(inputs[0].device)]
