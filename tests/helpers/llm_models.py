"""A tiny Llama-style decoder (RMSNorm, rotary-free causal attention, SwiGLU MLP, lm_head) for weight-only tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


class RMSNorm(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d) + 0.1 * torch.randn(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate, self.up = torch.nn.Linear(d, hidden, bias=False), torch.nn.Linear(d, hidden, bias=False)
        self.down = torch.nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).reshape(b, t, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        mask = torch.full((t, t), float("-inf")).triu(1)
        att = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5 + mask, -1)
        x = x + self.o((att @ v).transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


class TinyLlama(torch.nn.Module):
    def __init__(self, vocab: int = 96, d: int = 64, layers: int = 2, heads: int = 4, hidden: int = 128) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(Block(d, heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.lm_head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def tiny_llama(seed: int = 0, outliers: bool = True, **kw: int) -> TinyLlama:
    torch.manual_seed(seed)
    model = TinyLlama(**kw).eval()
    if outliers:  # a few salient channels, as trained LLMs have (what AWQ protects)
        with torch.no_grad():
            for block in model.blocks:
                block.norm1.weight[:3] *= 8.0
                block.norm2.weight[-2:] *= 8.0
    return model


def export_tiny_llama(model: TinyLlama, path: Path, seq: int = 16, external: bool = False) -> Path:
    ids = torch.zeros(1, seq, dtype=torch.long)
    torch.onnx.export(model, (ids,), str(path), input_names=["input_ids"], output_names=["logits"],
                      dynamic_axes={"input_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}},
                      opset_version=17, dynamo=False)
    if external:
        import onnx

        m = onnx.load(str(path))
        onnx.save_model(m, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=path.name + ".weights", size_threshold=256)
    return path


def token_feeds(count: int, seq: int = 16, vocab: int = 96, seed: int = 1) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(0, vocab, size=(1, seq), dtype=np.int64)} for _ in range(count)]
