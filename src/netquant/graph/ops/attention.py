"""Attention ops: Attention, RotaryEmbedding, SwiGLU, FlexAttention and the recurrent-state
CausalConvWithState / LinearAttention."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from netquant.errors import UnsupportedOpError

from ._util import opt, subgraph_runner
from .registry import OpContext, register_op

Tensor = torch.Tensor


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
        scores = subgraph_runner(ctx)(attrs["score_mod"], [scores])[0].to(cdt)
    probs = torch.softmax(scores, dim=-1)
    if attrs.get("prob_mod") is not None:
        probs = subgraph_runner(ctx)(attrs["prob_mod"], [probs])[0].to(cdt)
    return [torch.matmul(probs, v.to(cdt)).to(v.dtype)]
