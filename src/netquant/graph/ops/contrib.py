"""onnxruntime com.microsoft fused ops that optimised transformer exports contain (float math only)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from netquant.errors import UnsupportedOpError

from ._util import axis_of, opt
from .registry import OpContext, register_op

Tensor = torch.Tensor
MS = "com.microsoft"


@register_op("Gelu", domain=MS)
def ms_gelu(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """y = x * Phi(x) (erf form)."""
    return [F.gelu(inputs[0])]


@register_op("BiasGelu", domain=MS)
def bias_gelu(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return [F.gelu(inputs[0] + inputs[1])]


@register_op("FastGelu", domain=MS)
def fast_gelu(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """tanh approximation of gelu on x (+ optional bias)."""
    x = inputs[0] if opt(inputs, 1) is None else inputs[0] + inputs[1]
    return [F.gelu(x, approximate="tanh")]


@register_op("QuickGelu", domain=MS)
def quick_gelu(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """y = x * sigmoid(alpha * x), alpha default 1.702."""
    x = inputs[0]
    return [x * torch.sigmoid(attrs.get("alpha", 1.702) * x)]


@register_op("FusedMatMul", domain=MS)
def fused_matmul(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """y = alpha * op(A) @ op(B), op = transpose of the last two dims when transA / transB."""
    a, b = inputs[0], inputs[1]
    if attrs.get("transBatchA", 0) or attrs.get("transBatchB", 0):
        raise UnsupportedOpError(ctx.unsupported("transBatchA / transBatchB"))
    if attrs.get("transA", 0):
        a = a.transpose(-1, -2)
    if attrs.get("transB", 0):
        b = b.transpose(-1, -2)
    y = torch.matmul(a, b)
    alpha = attrs.get("alpha", 1.0)
    return [y * alpha if alpha != 1.0 else y]


def _skip_norm(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext, rms: bool) -> list[Tensor]:
    """s = input + skip (+ bias); y = norm(s) * gamma (+ beta); outputs y, mean, inv_std_var, s."""
    x, skip, gamma = inputs[0], inputs[1], inputs[2]
    beta = None if rms else opt(inputs, 3)
    bias = opt(inputs, 3 if rms else 4)
    eps = attrs.get("epsilon", 1e-12)
    s = x + skip
    if bias is not None:
        s = s + bias
    sf = s.float() if s.dtype in (torch.float16, torch.bfloat16) else s
    if rms:
        mean = torch.zeros_like(sf[..., :1])
        inv = torch.rsqrt((sf * sf).mean(-1, keepdim=True) + eps)
        y = sf * inv
    else:
        mean = sf.mean(-1, keepdim=True)
        inv = torch.rsqrt(((sf - mean) ** 2).mean(-1, keepdim=True) + eps)
        y = (sf - mean) * inv
    y = y.to(x.dtype) * gamma
    if beta is not None:
        y = y + beta
    return [y, mean, inv, s][: max(ctx.num_outputs, 1)]


@register_op("SkipLayerNormalization", domain=MS)
def skip_layer_norm(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return _skip_norm(inputs, attrs, ctx, rms=False)


@register_op("SkipSimplifiedLayerNormalization", domain=MS)
def skip_simplified_layer_norm(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return _skip_norm(inputs, attrs, ctx, rms=True)


@register_op("SimplifiedLayerNormalization")
def simplified_layer_norm(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """RMS norm over [axis, rank) (onnxruntime registers it in the ai.onnx domain): y = x / rms * scale."""
    x, scale = inputs[0], inputs[1]
    a = axis_of(attrs.get("axis", -1), x.dim())
    dims = tuple(range(a, x.dim()))
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    inv = torch.rsqrt((xf * xf).mean(dim=dims, keepdim=True) + attrs.get("epsilon", 1e-5))
    return [(xf * inv).to(x.dtype) * scale, inv][: max(ctx.num_outputs, 1)]


@register_op("BiasAdd", domain=MS)
def bias_add(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return [inputs[0] + inputs[1] + inputs[2]]


@register_op("BiasSoftmax", domain=MS)
def bias_softmax(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return [torch.softmax(inputs[0] + inputs[1], dim=attrs.get("axis", 1))]


def _unpack_nibbles(packed: Tensor) -> Tensor:
    p = packed.to(torch.int32)
    return torch.stack([p & 0x0F, p >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


@register_op("MatMulNBits", domain=MS)
def matmul_nbits(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """Y = A @ W (+ bias), W [K, N] from block codes: B uint8 [N, n_blocks, blob] (4-bit: two codes a byte, low
    nibble first), scales [N * n_blocks], zero points uint8 packed like B (default 2^(bits-1)) or float;
    w = (q - zp) * s per block of `block_size` along K (float compute: accuracy_level 0 semantics)."""
    a, b, scales = inputs[0], inputs[1], inputs[2]
    zp, g_idx, bias = opt(inputs, 3), opt(inputs, 4), opt(inputs, 5)
    k, n, bits, bs = attrs["K"], attrs["N"], attrs.get("bits", 4), attrs["block_size"]
    if bits not in (4, 8):
        raise UnsupportedOpError(ctx.unsupported(f"bits={bits}"))
    if g_idx is not None:
        raise UnsupportedOpError(ctx.unsupported("g_idx (act-order column groups)"))
    nb = (k + bs - 1) // bs
    q = (_unpack_nibbles(b) if bits == 4 else b.to(torch.int32)).reshape(n, nb, bs).to(torch.float32)
    s = scales.reshape(n, nb, 1).to(torch.float32)
    if zp is None:
        z: Tensor | float = float(1 << (bits - 1))
    elif zp.dtype == torch.uint8:
        zq = _unpack_nibbles(zp.reshape(n, -1)) if bits == 4 else zp.reshape(n, -1).to(torch.int32)
        z = zq[:, :nb].reshape(n, nb, 1).to(torch.float32)
    else:
        z = zp.reshape(n, nb, 1).to(torch.float32)
    w = ((q - z) * s).reshape(n, nb * bs)[:, :k].t().to(a.dtype)
    y = torch.matmul(a, w)
    return [y + bias if bias is not None else y]


@register_op("GatherBlockQuantized", domain=MS)
def gather_block_quantized(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """Rows of a block-quantized table: data uint8 [V, D * bits / 8] (4-bit codes two a byte, low nibble first),
    scales [V, n_blocks], zero points packed like data (default 2^(bits-1)); blocks of `block_size` along
    quantize_axis 1, gathered along gather_axis 0: y = (q[idx] - zp[idx]) * s[idx]."""
    data, idx, scales, zp = inputs[0], inputs[1], inputs[2], opt(inputs, 3)
    bits, bs = attrs.get("bits", 4), attrs.get("block_size", 128)
    if attrs.get("gather_axis", 0) != 0 or attrs.get("quantize_axis", 1) not in (1, -1) or data.dim() != 2:
        raise UnsupportedOpError(ctx.unsupported("gather_axis != 0, quantize_axis != 1 or a table that is not 2-D"))
    if data.dtype != torch.uint8 or bits not in (4, 8):
        raise UnsupportedOpError(ctx.unsupported(f"data {data.dtype} with bits={bits} (uint8 storage only)"))
    q = (_unpack_nibbles(data) if bits == 4 else data.to(torch.int32)).to(torch.float32)
    v, d = q.shape
    nb = scales.shape[1]
    if zp is None:
        z = torch.full((v, nb), float(1 << (bits - 1)))
    else:
        z = (_unpack_nibbles(zp) if bits == 4 else zp.to(torch.int32))[:, :nb].to(torch.float32)
    pad = nb * bs - d
    qp = torch.nn.functional.pad(q, (0, pad)).reshape(v, nb, bs)
    table = ((qp - z.unsqueeze(-1)) * scales.to(torch.float32).unsqueeze(-1)).reshape(v, nb * bs)[:, :d]
    idx = idx.to(torch.int64)
    idx = torch.where(idx < 0, idx + v, idx)
    return [table[idx].to(scales.dtype)]


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """x [B, S, H, D] rotated on its first 2 * cos.shape[-1] dims; cos / sin [B or 1, S, rd / 2]."""
    rd = cos.shape[-1] * 2
    xr, xp = x[..., :rd], x[..., rd:]
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack([c * x1 - s * x2, s * x1 + c * x2], dim=-1).reshape(xr.shape)
    else:
        x1, x2 = xr.chunk(2, dim=-1)
        rot = torch.cat([c * x1 - s * x2, s * x1 + c * x2], dim=-1)
    return torch.cat([rot, xp], dim=-1)


@register_op("RotaryEmbedding", domain=MS)
def ms_rotary_embedding(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """com.microsoft RotaryEmbedding(input [B, S, H*D] or [B, H, S, D], position_ids [B, S] or scalar offset,
    cos_cache, sin_cache [max_pos, rd / 2])."""
    x, pos, cos_cache, sin_cache = inputs[0], inputs[1], inputs[2], inputs[3]
    four_d = x.dim() == 4
    if four_d:
        xb = x.transpose(1, 2)
    else:
        heads = attrs.get("num_heads", 0) or x.shape[-1] // (cos_cache.shape[-1] * 2)
        xb = x.reshape(x.shape[0], x.shape[1], heads, -1)
    b, seq = xb.shape[0], xb.shape[1]
    pos = pos.to(torch.int64)
    if pos.numel() == 1:
        pos = (pos.reshape(1, 1) + torch.arange(seq).reshape(1, seq)).expand(b, seq)
    rd = attrs.get("rotary_embedding_dim", 0)
    cos, sin = cos_cache[pos], sin_cache[pos]
    if rd:
        cos, sin = cos[..., : rd // 2], sin[..., : rd // 2]
    y = _rotate(xb, cos, sin, bool(attrs.get("interleaved", 0)))
    return [y.transpose(1, 2) if four_d else y.reshape(x.shape)]


@register_op("GroupQueryAttention", domain=MS)
def group_query_attention(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """com.microsoft GroupQueryAttention for batches whose sequences share one length (decoder prompt and token
    steps): query [B, S, H*D] (or packed QKV when key is absent), key / value [B, S, Hkv*D], past_key / past_value
    [B, Hkv, P, D], seqlens_k [B] (= total length - 1), total_sequence_length; optional cos / sin caches (do_rotary).
    present = concat(past[:, :, :T - S], new); causal softmax(scale * q k^T) v with each query head reading kv head
    h // (H / Hkv); outputs (output [B, S, H*D], present_key, present_value)."""
    q, k, v = inputs[0], opt(inputs, 1), opt(inputs, 2)
    past_k, past_v, seqlens = opt(inputs, 3), opt(inputs, 4), inputs[5]
    cos_cache, sin_cache, pos_ids = opt(inputs, 7), opt(inputs, 8), opt(inputs, 9)
    for i, what in ((10, "attention_bias"), (11, "head_sink")):
        if opt(inputs, i) is not None:
            raise UnsupportedOpError(ctx.unsupported(what))
    if attrs.get("local_window_size", -1) not in (-1, 0) or attrs.get("softcap", 0.0) or attrs.get("smooth_softmax", 0):
        raise UnsupportedOpError(ctx.unsupported("local_window_size / softcap / smooth_softmax"))
    h, hkv = attrs["num_heads"], attrs["kv_num_heads"]
    b, s = q.shape[0], q.shape[1]
    if k is None:
        d = q.shape[-1] // (h + 2 * hkv)
        q, k, v = q.split([h * d, hkv * d, hkv * d], dim=-1)
    d = q.shape[-1] // h
    totals = seqlens.to(torch.int64).reshape(-1) + 1
    if bool((totals != totals[0]).any()):
        raise UnsupportedOpError(ctx.unsupported("batch rows with different sequence lengths (seqlens_k)"))
    total = int(totals[0])
    past_len = total - s
    qh, kh, vh = q.reshape(b, s, h, d), k.reshape(b, s, hkv, d), v.reshape(b, s, hkv, d)
    if attrs.get("do_rotary", 0):
        pos = pos_ids.to(torch.int64) if pos_ids is not None else \
            (past_len + torch.arange(s)).reshape(1, s).expand(b, s)
        cos, sin = cos_cache[pos], sin_cache[pos]
        inter = bool(attrs.get("rotary_interleaved", 0))
        qh, kh = _rotate(qh, cos, sin, inter), _rotate(kh, cos, sin, inter)
    kn, vn = kh.transpose(1, 2), vh.transpose(1, 2)
    if past_len > 0:
        if past_k is None or past_k.shape[2] < past_len:
            raise UnsupportedOpError(ctx.unsupported(f"past_key shorter than the {past_len} past positions"))
        kn = torch.cat([past_k[:, :, :past_len], kn], dim=2)
        vn = torch.cat([past_v[:, :, :past_len], vn], dim=2)
    group = h // hkv
    kr, vr = kn.repeat_interleave(group, dim=1), vn.repeat_interleave(group, dim=1)
    scale = attrs.get("scale", 0.0) or 1.0 / math.sqrt(d)
    scores = torch.matmul(qh.transpose(1, 2).float(), kr.transpose(-1, -2).float()) * scale
    qpos = past_len + torch.arange(s).reshape(s, 1)
    scores = scores.masked_fill(torch.arange(total).reshape(1, total) > qpos, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vr.float()).to(q.dtype)
    return [out.transpose(1, 2).reshape(b, s, h * d), kn, vn][: max(ctx.num_outputs, 1)]


__all__ = ["math"]
