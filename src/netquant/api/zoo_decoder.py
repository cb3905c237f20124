"""Llama-style decoder graphs in the form onnxruntime's LLM builders write (for tests and benchmarks).

Per layer: SimplifiedLayerNormalization / SkipSimplifiedLayerNormalization (RMS norm), q / k / v / o MatMuls,
com.microsoft GroupQueryAttention with rotary embedding (non-interleaved halves) and a KV cache (past_key_values.i.key
/ .value in, present.i.key / .value out), a SwiGLU MLP (gate, up, down MatMuls), then a final norm and an untied
lm_head MatMul. Inputs: input_ids [B, S] int64, seqlens_k [B] int32 (total length - 1), total_sequence_length int32,
the past tensors [B, Hkv, P, D]. Weights are produced one at a time by a callback and streamed to the external-data
file, so a multi-GB model is written with memory of one tensor.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

WeightFn = Callable[[str, tuple[int, ...]], np.ndarray]


@dataclass(frozen=True)
class DecoderConfig:
    vocab: int = 256
    dim: int = 384
    layers: int = 8
    heads: int = 12
    kv_heads: int = 4
    hidden: int = 1024
    max_positions: int = 2048
    rope_theta: float = 10000.0
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def weight_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every weight in graph order, MatMul weights as [in, out] (Y = X @ W)."""
        d, kv = self.dim, self.kv_heads * self.head_dim
        shapes: list[tuple[str, tuple[int, ...]]] = [("embed.weight", (self.vocab, d))]
        for i in range(self.layers):
            p = f"layers.{i}"
            shapes += [(f"{p}.attn_norm.weight", (d,)), (f"{p}.q.weight", (d, d)), (f"{p}.k.weight", (d, kv)),
                       (f"{p}.v.weight", (d, kv)), (f"{p}.o.weight", (d, d)), (f"{p}.mlp_norm.weight", (d,)),
                       (f"{p}.gate.weight", (d, self.hidden)), (f"{p}.up.weight", (d, self.hidden)),
                       (f"{p}.down.weight", (self.hidden, d))]
        return [*shapes, ("norm.weight", (d,)), ("lm_head.weight", (d, self.vocab))]

    def parameters(self) -> int:
        return sum(int(np.prod(s)) for _, s in self.weight_shapes())


def rope_caches(config: DecoderConfig) -> tuple[np.ndarray, np.ndarray]:
    """cos / sin [max_positions, head_dim / 2] of theta_j = rope_theta^(-2j / head_dim)."""
    half = config.head_dim // 2
    inv = config.rope_theta ** (-np.arange(half, dtype=np.float64) * 2 / config.head_dim)
    angles = np.arange(config.max_positions, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def random_weights(config: DecoderConfig, seed: int = 0) -> WeightFn:
    """Seeded random init (std 0.02 MatMuls, norms 1): for size and speed benchmarks, not accuracy claims."""
    rng = np.random.default_rng(seed)

    def make(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if len(shape) == 1:
            return np.ones(shape, dtype=np.float32)
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)

    return make


def _external(name: str, array: np.ndarray, data: Path, out, offset: int) -> tuple[TensorProto, int]:
    raw = np.ascontiguousarray(array).tobytes()
    pad = (-offset) % 64
    out.write(b"\0" * pad)
    offset += pad
    out.write(raw)
    t = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype), dims=list(array.shape))
    t.data_location = TensorProto.EXTERNAL
    for key, value in (("location", data.name), ("offset", str(offset)), ("length", str(len(raw)))):
        e = t.external_data.add()
        e.key, e.value = key, value
    return t, offset + len(raw)


def write_decoder_onnx(path: str | os.PathLike[str], config: DecoderConfig, weights: WeightFn) -> Path:
    """Write the decoder (module docstring) to `path` with its weights in `path.data`."""
    path = Path(path)
    data = path.with_name(path.name + ".data")
    c = config
    nodes: list[onnx.NodeProto] = []
    inits: list[TensorProto] = []
    cos, sin = rope_caches(c)
    ms = "com.microsoft"
    with open(data, "wb") as out:
        offset = 0
        for name, shape in c.weight_shapes():
            array = np.asarray(weights(name, shape), dtype=np.float32)
            if array.shape != shape:
                raise ValueError(f"weight '{name}': got shape {array.shape}, expected {shape}")
            tensor, offset = _external(name, array, data, out, offset)
            inits.append(tensor)
        for name, array in (("cos_cache", cos), ("sin_cache", sin)):
            tensor, offset = _external(name, array, data, out, offset)
            inits.append(tensor)
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"]),
              helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", c.vocab])]
    nodes.append(helper.make_node("Gather", ["embed.weight", "input_ids"], ["h0"], name="embed"))
    residual = "h0"
    normed = "n0"
    nodes.append(helper.make_node("SimplifiedLayerNormalization", [residual, "layers.0.attn_norm.weight"], [normed],
                                  name="layers.0.attn_norm", axis=-1, epsilon=c.eps))
    for i in range(c.layers):
        p = f"layers.{i}"
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", TensorProto.FLOAT,
                                                        ["batch", c.kv_heads, "past", c.head_dim]))
            outputs.append(helper.make_tensor_value_info(f"present.{i}.{kind}", TensorProto.FLOAT,
                                                         ["batch", c.kv_heads, "total", c.head_dim]))
        for proj in ("q", "k", "v"):
            nodes.append(helper.make_node("MatMul", [normed, f"{p}.{proj}.weight"], [f"{p}.{proj}"],
                                          name=f"{p}.{proj}_proj"))
        nodes.append(helper.make_node(
            "GroupQueryAttention", [f"{p}.q", f"{p}.k", f"{p}.v", f"past_key_values.{i}.key",
                                    f"past_key_values.{i}.value", "seqlens_k", "total_sequence_length",
                                    "cos_cache", "sin_cache"],
            [f"{p}.attn", f"present.{i}.key", f"present.{i}.value"], name=f"{p}.attn", domain=ms,
            num_heads=c.heads, kv_num_heads=c.kv_heads, do_rotary=1, rotary_interleaved=0))
        nodes.append(helper.make_node("MatMul", [f"{p}.attn", f"{p}.o.weight"], [f"{p}.o"], name=f"{p}.o_proj"))
        nodes.append(helper.make_node("SkipSimplifiedLayerNormalization", [f"{p}.o", residual, f"{p}.mlp_norm.weight"],
                                      [f"{p}.mlp_in", "", "", f"{p}.res1"], name=f"{p}.mlp_norm", domain=ms,
                                      epsilon=c.eps))
        nodes.append(helper.make_node("MatMul", [f"{p}.mlp_in", f"{p}.gate.weight"], [f"{p}.gate"],
                                      name=f"{p}.gate_proj"))
        nodes.append(helper.make_node("MatMul", [f"{p}.mlp_in", f"{p}.up.weight"], [f"{p}.up"], name=f"{p}.up_proj"))
        nodes.append(helper.make_node("Sigmoid", [f"{p}.gate"], [f"{p}.gate_sig"], name=f"{p}.act_sigmoid"))
        nodes.append(helper.make_node("Mul", [f"{p}.gate", f"{p}.gate_sig"], [f"{p}.silu"], name=f"{p}.act_mul"))
        nodes.append(helper.make_node("Mul", [f"{p}.silu", f"{p}.up"], [f"{p}.glu"], name=f"{p}.glu"))
        nodes.append(helper.make_node("MatMul", [f"{p}.glu", f"{p}.down.weight"], [f"{p}.down"],
                                      name=f"{p}.down_proj"))
        nxt = f"layers.{i + 1}.attn_norm.weight" if i + 1 < c.layers else "norm.weight"
        normed = f"n{i + 1}"
        residual = f"{p}.res2"
        nodes.append(helper.make_node("SkipSimplifiedLayerNormalization", [f"{p}.down", f"{p}.res1", nxt],
                                      [normed, "", "", residual], name=nxt.removesuffix(".weight"), domain=ms,
                                      epsilon=c.eps))
    nodes.append(helper.make_node("MatMul", [normed, "lm_head.weight"], ["logits"], name="lm_head"))
    graph = helper.make_graph(nodes, "decoder", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ms, 1)],
                              ir_version=9)
    onnx.save_model(model, str(path))
    return path


def decode_feeds(config: DecoderConfig, ids: np.ndarray, past: list[np.ndarray] | None = None
                 ) -> dict[str, np.ndarray]:
    """Feeds for one step: `ids` [1, S] after `past` (the previous step's present tensors, or none)."""
    b, s = ids.shape
    p = 0 if past is None else past[0].shape[2]
    feeds = {"input_ids": ids.astype(np.int64), "seqlens_k": np.full((b,), p + s - 1, dtype=np.int32),
             "total_sequence_length": np.array(p + s, dtype=np.int32)}
    for i in range(config.layers):
        for j, kind in enumerate(("key", "value")):
            feeds[f"past_key_values.{i}.{kind}"] = past[2 * i + j] if past is not None else \
                np.zeros((b, config.kv_heads, 0, config.head_dim), dtype=np.float32)
    return feeds
