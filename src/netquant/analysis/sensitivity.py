"""How much each region's quantization costs in output quality, measured with the fake-quant executor.

The loss of a placement (some regions kept in float, analysis.regions.keep_float) on a few calibration batches:
- default: mean over the model outputs of 1 - cosine(FP32 output, fake-quant output), each output flattened
  over the batches (0 = identical; 1 - cos ~ NSR / 2 for small noise, NSR = 10^(-SNR/10)); an output made by a
  Softmax / LogSoftmax / Sigmoid is compared at that op's input, the logits (compared_tensors);
- with `metric(outputs, target) -> float` (higher is better) on (inputs, target) pairs: metric(FP32) - metric(int8).

Per region: `only` = the loss with only that region quantized, `all_but` = the loss with every other region
quantized and this one in float; `gain` = loss(all quantized) - all_but, what keeping it in float buys.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from netquant.analysis.regions import Region, keep_float
from netquant.graph import Executor
from netquant.passes.quant_graph import QuantizedGraph
from netquant.passes.quant_graph import compared_tensors as graph_compared_tensors

Metric = Callable[[dict[str, torch.Tensor], Any], float]


@dataclass(frozen=True)
class Sensitivity:
    """Losses of one region (see module docstring); None where not measured (time cap)."""

    only: float | None
    all_but: float | None
    gain: float | None


def cosine_loss(ref: dict[str, torch.Tensor], test: dict[str, torch.Tensor]) -> float:
    """Mean over outputs of 1 - cos(ref, test), each flattened (computed as |a/|a| - b/|b||^2 / 2)."""
    losses = []
    for k, r in ref.items():
        a, b = r.reshape(-1).double(), test[k].reshape(-1).double()
        na, nb = float(a.norm()), float(b.norm())
        if na == 0.0 or nb == 0.0:
            losses.append(0.0 if na == nb else 1.0)
            continue
        # 1 - cos = |a/|a| - b/|b||^2 / 2, without the cancellation of 1 - a.b/(|a||b|) near one-hot outputs
        losses.append(0.5 * float(((a / na - b / nb) ** 2).sum()))
    return float(sum(losses) / max(len(losses), 1))


def compared_tensors(qgraph: QuantizedGraph) -> list[str]:
    """passes.quant_graph.compared_tensors of the quantized graph's graph."""
    return graph_compared_tensors(qgraph.graph)


class LossMeter:
    """loss(float_regions): the quality loss of the fake-quant model with those regions kept in float.

    One executor serves every call: QuantizedGraph.attach_fake_quant's hooks (exact accumulation), re-planned for
    each placement; weights are fake-quantized once (keep_float changes states, never params).
    """

    def __init__(self, qgraph: QuantizedGraph, data: Iterable[Any], metric: Metric | None = None) -> None:
        self.qgraph = qgraph
        self.metric = metric
        self.data = list(data)
        self.calls = 0
        self.executor = Executor(qgraph.graph)
        self.hooks = qgraph.attach_fake_quant(self.executor)  # exact accumulation; re-planned per placement
        self.hooks.plan(False)
        self.compared = compared_tensors(qgraph)
        with torch.no_grad():
            if metric is None:
                kept = self._calibration_reference()
                self.reference = self._concat([kept] if kept is not None else
                                              [self.executor.run(b, outputs=self.compared) for b in self.data])
                self.reference_score = 0.0
            else:
                self.reference_score = self._score([self.executor.run(b) for b, _ in self.data])

    def _plan(self, on: bool) -> None:
        self.hooks.plan(on)

    def _calibration_reference(self) -> dict[str, torch.Tensor] | None:
        """The compared tensors of calibration's FP32 run of the meter's one batch (QuantizedGraph.reference_run), where
        the executor here would compute them to the bit: the same batch and graph state, one torch thread, and FP32
        weights and biases as calibration ran them (no bias correction, no re-rounded weights); else None."""
        from netquant.passes.calibration import graph_state

        q, ref = self.qgraph, self.qgraph.reference_run
        if ref is None or len(self.data) != 1 or torch.get_num_threads() != 1 or q.bias_corrections or \
                q.rounded_weights or not isinstance(self.data[0], dict):
            return None
        if not ref.serves(q.graph, self.data[0], graph_state(q.graph)):
            return None
        return {k: ref.tensors[k] for k in self.compared}

    def _names(self, i: int, regions: list[Region]) -> list[str]:
        """The compared tensors, and on the first batch the graph outputs too (_keep)."""
        if i:
            return self.compared
        return list(dict.fromkeys([*self.compared, *(v.name for v in self.qgraph.graph.outputs)]))

    def _keep(self, run: dict[str, torch.Tensor]) -> None:
        """The latest loss pass's graph outputs on the first batch, with its quant state (all INT8, or the regions it
        floated), for export validation (QuantizedGraph.fake_quant_runs: it runs the same fake-quant model on the same
        batch, where its CPU sums exactly: the all-INT8 file, or one with edge regions float)."""
        from netquant.export.onnx_qdq import quant_state
        from netquant.passes.quant_graph import FAKE_QUANT_RUNS_KEPT, FakeQuantRun

        outputs = {v.name: run[v.name] for v in self.qgraph.graph.outputs if v.name in run}
        state = quant_state(self.qgraph)
        kept = [r for r in self.qgraph.fake_quant_runs if r.state != state]
        self.qgraph.fake_quant_runs = [*kept, FakeQuantRun(state, dict(self.data[0]), outputs)][-FAKE_QUANT_RUNS_KEPT:]

    @staticmethod
    def _concat(runs: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return {k: torch.cat([r[k].reshape(-1).float() for r in runs]) for k in runs[0]}

    def _score(self, runs: Sequence[dict[str, torch.Tensor]]) -> float:
        assert self.metric is not None
        return float(sum(float(self.metric(out, t)) for out, (_, t) in zip(runs, self.data)) / max(len(runs), 1))

    def loss(self, float_regions: Iterable[Region] = ()) -> float:
        self.calls += 1
        regions = list(float_regions)
        with keep_float(self.qgraph, regions), torch.no_grad():
            self._plan(True)
            try:
                if self.metric is None:
                    runs = [self.executor.run(b, outputs=self._names(i, regions)) for i, b in enumerate(self.data)]
                    self._keep(runs[0])
                    return cosine_loss(self.reference, self._concat([{k: r[k] for k in self.compared} for r in runs]))
                return self.reference_score - self._score([self.executor.run(b) for b, _ in self.data])
            finally:
                self._plan(False)


def region_output_nsr(meter: LossMeter, regions: Sequence[Region]) -> dict[str, float]:
    """Noise-to-signal ratio sum (y - y_q)^2 / sum y^2 of each region's last output with every region quantized
    (two executor passes on the meter's data): a cheap local ranking for when the per-region losses do not fit the
    time cap."""
    outs = {r.anchor: meter.qgraph.graph.node(r.ops[-1]).outputs[0] for r in regions}
    names = sorted(set(outs.values()))
    batches = [b if meter.metric is None else b[0] for b in meter.data]
    with torch.no_grad():
        meter._plan(False)
        ref = [meter.executor.run(b, outputs=names) for b in batches]
        meter._plan(True)
        try:
            test = [meter.executor.run(b, outputs=names) for b in batches]
        finally:
            meter._plan(False)
    out = {}
    for anchor, t in outs.items():
        num = sum(float(((r[t].double() - q[t].double()) ** 2).sum()) for r, q in zip(ref, test))
        den = sum(float((r[t].double() ** 2).sum()) for r in ref)
        out[anchor] = num / max(den, 1e-300)
    return out


def region_sensitivity(meter: LossMeter, regions: Sequence[Region], base_float: Sequence[Region] = (),
                       deadline: float | None = None, only: bool = True) -> tuple[float, dict[str, Sensitivity]]:
    """(loss with every region but `base_float` quantized, {anchor: Sensitivity}) for `regions`, most time-consuming
    measurements last; regions not reached before `deadline` (time.perf_counter()) get None entries."""
    base = list(base_float)
    full = meter.loss(base)
    out: dict[str, Sensitivity] = {}
    for r in regions:
        if deadline is not None and time.perf_counter() > deadline:
            out[r.anchor] = Sensitivity(None, None, None)
            continue
        all_but = meter.loss([*base, r])
        alone = None
        if only:
            alone = meter.loss([x for x in regions if x is not r] + [b for b in base if b not in regions])
        out[r.anchor] = Sensitivity(alone, all_but, full - all_but)
    return full, out
