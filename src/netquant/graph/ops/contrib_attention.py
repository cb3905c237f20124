"""onnxruntime com.microsoft attention ops that onnxruntime.transformers.optimizer writes (float math only):
Attention (packed QKV projection inside), MultiHeadAttention (projected Q, K, V) and EmbedLayerNormalization.

Masks follow onnxruntime's CPU kernels: a mask entry that hides a key position adds `mask_filter_value` (default
-10000) to that score before the softmax, as does a key after the query's position under `unidirectional`;
attention_bias [B or 1, N or 1, S, T] is added as well. Past / present key-value caches are not supported, nor
unidirectional with a start / end ([2B]) or 3-D mask (onnxruntime combines those differently; not matched here).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from netquant.errors import UnsupportedOpError

from ._util import opt
from .quant import matmul_saturation, saturating_kernel
from .registry import OpContext, register_op

Tensor = torch.Tensor
MS = "com.microsoft"


def _heads(x: Tensor, n: int) -> Tensor:
    """[B, S, N * H] -> [B, N, S, H]."""
    b, s, d = x.shape
    return x.reshape(b, s, n, d // n).transpose(1, 2)


def _mask_bias(mask: Tensor | None, b: int, s: int, t: int, fill: float, ctx: OpContext) -> Tensor | None:
    """The additive [B, 1, S or 1, T] term of a mask_index / key_padding_mask (None: no mask)."""
    if mask is None:
        return None
    if mask.dim() == 1 and mask.numel() in (b, 2 * b):  # end positions [B] (and start positions [B] after them)
        pos = torch.arange(t, device=mask.device)[None, :]
        keep = pos < mask[:b, None].to(torch.int64)
        if mask.numel() == 2 * b:
            keep = keep & (pos >= mask[b:, None].to(torch.int64))
        return torch.where(keep, 0.0, fill)[:, None, None, :]
    if mask.dim() == 2 and tuple(mask.shape) == (b, t):  # raw 1 / 0 per key
        return torch.where(mask > 0, 0.0, fill)[:, None, None, :]
    if mask.dim() == 3 and tuple(mask.shape) == (b, s, t):
        return torch.where(mask > 0, 0.0, fill)[:, None, :, :]
    raise UnsupportedOpError(ctx.unsupported(f"mask of shape {tuple(mask.shape)} (supported: [B], [2B], [B, T], "
                                             "[B, S, T])"))


def _attend(q: Tensor, k: Tensor, v: Tensor, attrs: dict[str, Any], mask: Tensor | None,
            bias: Tensor | None, ctx: OpContext) -> Tensor:
    """softmax(q k^T * scale + mask terms + bias) v for q [B, N, S, H], k / v [B, N, T, H]; -> [B, S, N * Hv]."""
    b, _, s, h = q.shape
    t = k.shape[2]
    scale = attrs.get("scale", 0.0) or 1.0 / math.sqrt(h)
    fill = float(attrs.get("mask_filter_value", -10000.0))
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    extra = _mask_bias(mask, b, s, t, fill, ctx)
    if attrs.get("unidirectional", 0) and mask is not None and (mask.dim() == 3 or mask.numel() == 2 * b != t * b):
        raise UnsupportedOpError(ctx.unsupported("unidirectional with a [2B] or [B, S, T] mask"))
    if attrs.get("unidirectional", 0):  # a key after the query's position gets the fill value (not added twice)
        causal = torch.ones(s, t, dtype=torch.bool, device=q.device).triu(1 + t - s)
        extra = torch.where(causal, fill, 0.0 if extra is None else extra)
    if extra is not None:
        scores = scores + extra.to(scores.dtype)
    if bias is not None:
        scores = scores + bias
    y = torch.matmul(torch.softmax(scores, dim=-1), v)  # [B, N, S, Hv]
    return y.transpose(1, 2).reshape(b, s, -1)


def _no_past(inputs: list[Tensor | None], indices: tuple[int, ...], ctx: OpContext) -> None:
    if any(opt(inputs, i) is not None for i in indices):
        raise UnsupportedOpError(ctx.unsupported("past key / value inputs (KV cache)"))


@register_op("Attention", domain=MS)
def ms_attention(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """qkv = input @ weights + bias (split by qkv_hidden_sizes, default three equal parts), per head
    softmax(q k^T * scale + mask) v; inputs: input, weights, bias, mask_index, past, attention_bias."""
    x, w = inputs[0], inputs[1]
    _no_past(inputs, (4, 6), ctx)
    return _attend_projected(torch.matmul(x, w), opt(inputs, 2), opt(inputs, 3), opt(inputs, 5), attrs, ctx)


def _attend_projected(qkv: Tensor, bias: Tensor | None, mask: Tensor | None, attn_bias: Tensor | None,
                      attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """Attention after its projection qkv = input @ weights: + bias, split into q, k, v (qkv_hidden_sizes,
    default three equal parts), per head softmax(q k^T * scale + mask) v."""
    if attrs.get("do_rotary", 0):
        raise UnsupportedOpError(ctx.unsupported("do_rotary"))
    n = int(attrs["num_heads"])
    if bias is not None:
        qkv = qkv + bias
    sizes = list(attrs.get("qkv_hidden_sizes") or [qkv.shape[-1] // 3] * 3)
    q, k, v = torch.split(qkv, [int(z) for z in sizes], dim=-1)
    y = _attend(_heads(q, n), _heads(k, n), _heads(v, n), attrs, mask, attn_bias, ctx)
    return [y][: max(ctx.num_outputs, 1)]


@register_op("MultiHeadAttention", domain=MS)
def multi_head_attention(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """Attention of projected query [B, S, D], key / value [B, T, D] (or [B, N, T, H]); bias [D + D + Dv] added to
    q, k, v; inputs: query, key, value, bias, key_padding_mask, attention_bias, past_key, past_value."""
    q, k, v = inputs[0], opt(inputs, 1), opt(inputs, 2)
    bias, mask, attn_bias = opt(inputs, 3), opt(inputs, 4), opt(inputs, 5)
    _no_past(inputs, (6, 7), ctx)
    if k is None or v is None or q.dim() != 3:
        raise UnsupportedOpError(ctx.unsupported("packed QKV / KV inputs (query 3-D with key and value needed)"))
    n = int(attrs["num_heads"])
    if bias is not None:
        d = q.shape[-1]
        q = q + bias[:d]
        if k.dim() == 3:
            k = k + bias[d:2 * d]
            v = v + bias[2 * d:]
    kh = _heads(k, n) if k.dim() == 3 else k
    vh = _heads(v, n) if v.dim() == 3 else v
    y = _attend(_heads(q, n), kh, vh, attrs, mask, attn_bias, ctx)
    return [y][: max(ctx.num_outputs, 1)]


@register_op("EmbedLayerNormalization", domain=MS)
def embed_layer_norm(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """e = word[input_ids] + position[position_ids or 0..S-1] (+ segment[segment_ids]); y = LayerNorm(e) * gamma +
    beta; mask_index = the number of mask entries > 0 per row (int32; 0 without a mask); outputs y, mask_index, e.
    Inputs: input_ids, segment_ids, word_embedding, position_embedding, segment_embedding, gamma, beta, mask,
    position_ids."""
    ids, seg_ids = inputs[0], opt(inputs, 1)
    word, pos, seg = inputs[2], inputs[3], opt(inputs, 4)
    gamma, beta, mask, pos_ids = inputs[5], opt(inputs, 6), opt(inputs, 7), opt(inputs, 8)
    b, s = ids.shape
    if pos_ids is None:
        pos_ids = torch.arange(s, device=ids.device)[None, :].expand(b, s)
    elif pos_ids.shape[0] == 1:
        pos_ids = pos_ids.expand(b, s)
    e = word[ids.to(torch.int64)] + pos[pos_ids.to(torch.int64)]
    if seg is not None and seg_ids is not None:
        e = e + seg[seg_ids.to(torch.int64)]
    mean = e.mean(-1, keepdim=True)
    var = ((e - mean) ** 2).mean(-1, keepdim=True)
    y = (e - mean) * torch.rsqrt(var + attrs.get("epsilon", 1e-12)) * gamma
    if beta is not None:
        y = y + beta
    count = (mask > 0).sum(1).to(torch.int32) if mask is not None else torch.zeros(b, dtype=torch.int32)
    return [y, count, e][: max(ctx.num_outputs, 1)]


def _dequant(q: Tensor, scale: Tensor, zero: Tensor | None) -> Tensor:
    """(q - zero) * scale, per tensor or per last-axis column (scale / zero 1-D of that length)."""
    v = q.to(torch.float32)
    if zero is not None:
        v = v - zero.to(torch.float32)
    return v * scale.to(torch.float32)


@register_op("QAttention", domain=MS)
def q_attention(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """Attention on a uint8 / int8 input and int8 weights: the dequantized input (x_q - z_x) * s_x and weights
    (w_q - z_w) * s_w (per tensor or per column) through Attention; inputs: input, weight, bias, input_scale,
    weight_scale, mask_index, input_zero_point, weight_zero_point, past. An executor emulating x86 without VNNI
    (Accumulation.PAIRWISE_INT16) adds the projection's int16 pair saturation as onnxruntime's u8 x s8 kernel has
    it there: (saturated - exact sums of the raw codes) * s_x * s_w."""
    x_q, w_q, bias, s_x, s_w = inputs[0], inputs[1], inputs[2], inputs[3], inputs[4]
    mask, z_x, z_w = opt(inputs, 5), opt(inputs, 6), opt(inputs, 7)
    _no_past(inputs, (8,), ctx)
    w_scale = s_w.reshape(-1) if s_w.numel() > 1 else s_w.reshape(())
    x = _dequant(x_q, s_x.reshape(()), z_x.reshape(()) if z_x is not None else None)
    w = _dequant(w_q, w_scale, None if z_w is None else (z_w.reshape(-1) if z_w.numel() > 1 else z_w.reshape(())))
    qkv = torch.matmul(x, w)
    if saturating_kernel(ctx, x_q, w_q):
        sat = matmul_saturation(x_q, w_q) * s_x.reshape(()).to(torch.float64) * w_scale.to(torch.float64)
        qkv = qkv + sat.to(qkv.dtype)
    return _attend_projected(qkv, bias, mask, None, attrs, ctx)
