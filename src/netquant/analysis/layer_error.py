"""Per-layer quantization error: FP32 vs fake-quant output of every op, on the same inputs.

SNR (dB) = 10 log10(sum(x^2) / sum((x - x_q)^2));  cosine = <x, x_q> / (|x| |x_q|).
The error is cumulative (the fake-quant run quantizes every op upstream too), which is what the
deployed model sees.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from netquant.errors import DataError


@dataclass(frozen=True)
class LayerError:
    """Error statistics of one op output."""

    op: str
    op_type: str
    tensor: str
    quantized: bool
    snr_db: float
    cosine: float
    max_abs_error: float

    def row(self) -> list[str]:
        return [self.op, self.op_type, "int" if self.quantized else "fp32", f"{self.snr_db:.2f}",
                f"{self.cosine:.5f}", f"{self.max_abs_error:.4g}"]


HEADER = ["op", "type", "quant", "SNR dB", "cosine", "max |err|"]


def snr_db(ref: torch.Tensor, test: torch.Tensor) -> float:
    ref64, test64 = ref.detach().double().reshape(-1), test.detach().double().reshape(-1)
    noise = float(((ref64 - test64) ** 2).sum())
    signal = float((ref64 ** 2).sum())
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def cosine(ref: torch.Tensor, test: torch.Tensor) -> float:
    a, b = ref.detach().double().reshape(-1), test.detach().double().reshape(-1)
    na, nb = float(a.norm()), float(b.norm())
    if na == 0.0 and nb == 0.0:
        return 1.0
    if na == 0.0 or nb == 0.0:
        return 0.0
    return float(a @ b) / (na * nb)


def layer_errors(qgraph: Any, batches: Iterable[Any], ops: Sequence[str] | None = None) -> list[LayerError]:
    """Per-op-output error over `batches` (errors accumulated over batches: sums of squares)."""
    graph = qgraph.graph
    wanted = set(ops) if ops is not None else None
    targets: list[tuple[Any, str]] = []
    for node in graph.nodes:
        if wanted is not None and node.name not in wanted:
            continue
        for out in node.outputs:
            if out:
                targets.append((node, out))
    names = [t for _, t in targets]
    fp_ex, q_ex = qgraph.executor(fake_quant=False), qgraph.executor(fake_quant=True)
    sums: dict[str, list[float]] = {n: [0.0, 0.0, 0.0, 0.0, 0.0, 0.0] for n in names}
    seen = 0
    with torch.no_grad():
        for batch in batches:
            ref = fp_ex.run(batch, keep=names)
            test = q_ex.run(batch, keep=names)
            for n in names:
                r, t = ref.get(n), test.get(n)
                if not isinstance(r, torch.Tensor) or not isinstance(t, torch.Tensor) or not r.is_floating_point():
                    continue
                r64, t64 = r.double().reshape(-1), t.double().reshape(-1)
                s = sums[n]
                s[0] += float((r64 ** 2).sum())
                s[1] += float(((r64 - t64) ** 2).sum())
                s[2] += float(r64 @ t64)
                s[3] += float((t64 ** 2).sum())
                s[4] = max(s[4], float((r64 - t64).abs().max()) if r64.numel() else 0.0)
                s[5] += 1
            seen += 1
    if seen == 0:
        raise DataError("layer_errors needs at least one batch of inputs")
    out: list[LayerError] = []
    for node, n in targets:
        s = sums[n]
        if s[5] == 0:
            continue
        snr = math.inf if s[1] == 0 else (-math.inf if s[0] == 0 else 10 * math.log10(s[0] / s[1]))
        denom = math.sqrt(s[0]) * math.sqrt(s[3])
        cos = 1.0 if denom == 0 and s[1] == 0 else (s[2] / denom if denom else 0.0)
        oc = qgraph.op_configs.get(node.name)
        out.append(LayerError(node.name, node.op_type, n, bool(oc is not None and oc.is_quantized),
                              snr, cos, s[4]))
    return out
