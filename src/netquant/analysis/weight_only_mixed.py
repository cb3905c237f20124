"""Mixed int4 / int8 weight-only placement within an output-loss budget.

Layers are ranked by sensitivity (the relative output error of the layer at 4 bits on calibration rows,
||X (W - W4)||^2 / ||X W||^2). Moving the k most sensitive layers to int8 gives a file whose loss is
1 - min over outputs and feeds of cos(onnxruntime output, FP32 output); the smallest k with loss <= max_loss is found
by bisection on k (loss(0) checked first, then loss(n)), each candidate built and run in onnxruntime.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import onnx

from netquant.export.weight_only import cosine, ensure_opsets, rewrite_all
from netquant.graph.weights import EmbeddingGather, WeightMatMul
from netquant.passes.weight_only import OrtModelSession, WeightOnlyConfig, WeightOnlyPlan


@dataclass
class MixedSearch:
    """The budget, the number of int8 layers chosen, the loss of that file, every k tried with its loss, and whether
    the budget was met (False: even all-int8 misses it, so all layers are int8)."""

    max_loss: float
    int8_layers: int
    loss: float
    tried: dict[int, float]
    met: bool


def search_mixed_bits(plan: WeightOnlyPlan, config: WeightOnlyConfig,
                      progress: Callable[[str], None] | None = None) -> MixedSearch:
    """Choose the int8 layers (module docstring); sets the chosen records' bits to 8 and their codes in `plan.codes`."""
    targets, records = plan.targets, plan.records
    # layers already at 8 bits (the output layer with head_bits=8) are not candidates
    order = sorted((i for i in range(len(targets)) if plan.codes[id(targets[i].node)].spec.bits == 4),
                   key=lambda i: (-(records[i].sensitivity or 0.0), i))
    tried: dict[int, float] = {}
    names = plan.output_names
    feeds = plan.feeds[: len(plan.reference)]

    def loss(k: int) -> float:
        if k not in tried:
            wide = {id(targets[i].node) for i in order[:k]}
            candidate = onnx.ModelProto()
            candidate.CopyFrom(plan.model)
            nodes = list(plan.model.graph.node)
            copies = [WeightMatMul(candidate.graph.node[nodes.index(t.node)], t.activation, t.weight, t.k, t.n,
                                   t.transposed, t.bias) for t in targets]
            codes = {id(c.node): (plan.wide if id(t.node) in wide else plan.codes)[id(t.node)]
                     for c, t in zip(copies, targets, strict=True)}
            tables = [(EmbeddingGather(candidate.graph.node[nodes.index(g.node)], g.table, g.vocab, g.dim), bq)
                      for g, bq in plan.embeddings]
            rewrite_all(candidate, copies, codes, config.fmt, config.accuracy_level, tables, config.wide_level)
            ensure_opsets(candidate, config.fmt)
            session = OrtModelSession(candidate, plan.source.parent)
            try:
                worst = 1.0
                for feed, ref in zip(feeds, plan.reference, strict=True):
                    for got, want in zip(session.run(names, feed), ref, strict=True):
                        worst = min(worst, cosine(got, want))
            finally:
                session.close()
            tried[k] = 1.0 - worst
            if progress:
                progress(f"mixed int4/int8: {k} layers int8, loss {tried[k]:.5f}")
        return tried[k]

    budget = float(config.max_loss or 0.0)
    n = len(order)
    if loss(0) <= budget:
        k, met = 0, True
    elif loss(n) > budget:
        k, met = n, False
    else:
        lo, hi = 0, n  # loss(lo) > budget >= loss(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if loss(mid) <= budget:
                hi = mid
            else:
                lo = mid
        k, met = hi, True
    for i in order[:k]:
        records[i].bits = 8
        plan.codes[id(targets[i].node)] = plan.wide[id(targets[i].node)]
    plan.wide.clear()
    return MixedSearch(budget, k, tried[k], dict(sorted(tried.items())), met)
