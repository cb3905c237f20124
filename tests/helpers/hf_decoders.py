"""Tiny transformers decoders (Llama / Qwen2 configs) exported with torch.onnx's dynamo exporter, KV cache included:
inputs input_ids, attention_mask, past_key_values.{i}.key / .value; outputs logits, present.{i}.key / .value.
Needs the optional `transformers` package (pip install -e '.[hf]'); tests skip without it."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch


class _CacheIO(torch.nn.Module):
    """The causal LM with its DynamicCache as flat tensors (what ONNX decoders take and give)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.layers = model.config.num_hidden_layers

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *past: torch.Tensor) -> tuple:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        for i in range(self.layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
        flat = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
        return (out.logits, *flat)


def tiny_hf_decoder(kind: str, seed: int = 0) -> torch.nn.Module:
    """A random-init 2-layer `kind` ('llama' or 'qwen2') causal LM: d 64, 4 heads / 2 KV heads, vocab 128; RMSNorm
    weights perturbed so that each norm has its own scale tensor (the exporter merges identical ones)."""
    import transformers

    cfg_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[kind]
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}[kind]
    config = cfg_cls(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
    return model


def export_hf_decoder(model: torch.nn.Module, path: Path, past: int = 3, seq: int = 5) -> list[str]:
    """Dynamo export of `model` with a KV cache (batch, seq and past length dynamic); returns the input names."""
    c = model.config
    layers, kv, head_dim = c.num_hidden_layers, c.num_key_value_heads, c.hidden_size // c.num_attention_heads
    ids = torch.randint(0, c.vocab_size, (1, seq), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(1, past + seq, dtype=torch.int64)
    caches = tuple(torch.randn(1, kv, past, head_dim) for _ in range(2 * layers))
    names = ["input_ids", "attention_mask"] + [f"past_key_values.{i}.{k}" for i in range(layers) for k in ("key", "value")]
    outputs = ["logits"] + [f"present.{i}.{k}" for i in range(layers) for k in ("key", "value")]
    dynamic = ({0: "batch", 1: "seq"}, {0: "batch", 1: "total"}, tuple({0: "batch", 2: "past"} for _ in caches))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_CacheIO(model), (ids, mask, *caches), str(path), dynamo=True, input_names=names,
                          output_names=outputs, dynamic_shapes=dynamic, verbose=False)
    return names
