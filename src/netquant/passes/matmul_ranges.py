"""MatMul input ranges: the clipped range of each per-tensor LayerNorm or GELU output read by weighted MatMuls /
Attention that lowers those ops' output error (transformer inputs whose min / max sits in a thin tail).

For an activation X [rows, K] read by ops with float weights W_r (as [K, N_r]) and calibrated range [lo, hi]
(min / max), each candidate c in CLIPS gives params p_c = choose_qparams(round_outward(c lo), round_outward(c hi))
and the error it would put on the readers' outputs,

    err(c) = sum_k w2_k * sum_rows (q_c(X) - X)^2_k,     w2_k = sum_r sum_n W_r[k, n]^2,

the squared output error sum_r |(q_c(X) - X) W_r|^2 without its cross-channel terms (rounding errors of different
channels are uncorrelated; a clipped outlier channel weighs as much as its weights make it). The candidate of least
error on the kept calibration batches after the first (QuantizedGraph.validation_batches; the first is the accuracy
budget's; FP32, one torch thread) is kept, c = 1
(the min / max range) unless another lowers err by more than MIN_GAIN; ties go to the larger range. The choice
depends on the model and the data only (same inputs -> same ranges). Runs right after calibration, before shared
scales are aligned and biases quantized; each clipped tensor is recorded (QuantizedGraph.repairs, repair
'matmul ranges': the factor and both errors; QuantizedGraph.clipped_ranges: both params). The local error ignores
what follows the op (a GELU passes a large value's clipping error and damps a small one's rounding error), so
placement keeps the clipped ranges only where the model's output loss is lower with them (analysis.placement.ranges:
one more fake-quant pass of the accuracy budget); without placement (objective None) they stay.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from netquant.calib.ranges import round_range_outward
from netquant.core.ops import fake_quantize
from netquant.core.qparams import QParams, choose_qparams
from netquant.core.spec import Granularity
from netquant.core.tensor_config import TensorQuantConfig
from netquant.graph import Executor, Graph, Node
from netquant.passes.base import Condition, PassBase, PassContext
from netquant.passes.quant_graph import QuantizedGraph, RepairRecord, emits
from netquant.platforms.threads import thread_scope

CLIPS = tuple(round(1.0 - 0.025 * i, 3) for i in range(21))  # 1.0, 0.975, ..., 0.5 of the min / max range
MIN_GAIN = 0.01  # a clipped range must lower err by more than this share of err(1)
# ops whose input 0 times a constant 2-D weight (input 1) is the output, with a float bias (a Gemm's int32 bias would
# follow the activation scale: not searched)
READERS = ("MatMul", "Attention")
NAME = "matmul ranges"


@dataclass(frozen=True)
class ClippedRange:
    """One clipped MatMul input: its config, the min / max params calibration gave and the clipped ones it holds."""

    tensor: str
    config: TensorQuantConfig
    min_max: QParams
    clipped: QParams


@dataclass
class _Site:
    """One activation tensor, its config and the squared row norms of its readers' weights (w2, [K])."""

    tensor: str
    config: TensorQuantConfig
    readers: list[str]
    w2: torch.Tensor
    candidates: list[QParams] = field(default_factory=list)
    errors: torch.Tensor | None = None  # [len(CLIPS)], float64


def _weighted_reader(graph: Graph, node: Node) -> bool:
    """Whether the op multiplies its input 0 by a constant float 2-D weight (input 1): a MatMul, or com.microsoft's
    Attention."""
    if node.op_type not in READERS or len(node.inputs) < 2:
        return False
    if node.op_type == "Attention" and node.domain != "com.microsoft":
        return False
    if node.op_type != "Attention" and node.domain not in ("", "ai.onnx"):
        return False
    w = graph.initializers.get(node.inputs[1])
    return w is not None and w.is_floating_point() and w.dim() == 2


def _weight_rows(graph: Graph, node: Node) -> torch.Tensor | None:
    """sum_n W[k, n]^2 of the op's constant 2-D weight as [K, N] (None: not such an op)."""
    if not _weighted_reader(graph, node):
        return None
    return (graph.initializers[node.inputs[1]].double() ** 2).sum(1)


NORMS = frozenset({"LayerNormalization", "SkipLayerNormalization", "SimplifiedLayerNormalization",
                   "SkipSimplifiedLayerNormalization", "EmbedLayerNormalization", "RMSNormalization"})
GELUS = frozenset({"Gelu", "FastGelu", "BiasGelu", "QuickGelu"})
_MOVES = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Cast"})


def range_tensor_candidates(graph: Graph) -> list[str]:
    """The tensors the pass may search, from the graph's structure alone (a weighted reader's activation input after
    a LayerNorm / GELU): what calibration keeps for it (QuantizedGraph.range_tensors)."""
    out = [n.inputs[0] for n in graph.nodes
           if n.inputs and n.inputs[0] not in graph.initializers and _weighted_reader(graph, n)]
    return [t for t in dict.fromkeys(out) if after_norm_or_gelu(graph, t)]


def after_norm_or_gelu(graph: Graph, tensor: str) -> bool:
    """Whether `tensor` is (through data movement) a LayerNorm's or a GELU's output: a GELU op, or the erf / tanh
    form's last Mul (an Erf or Tanh within three producers up). Other MatMul inputs (an attention context, a
    residual sum) keep min / max: measured on BERT-base, clipping the attention context gained nothing on full rows
    and lost on padded ones (cosine 0.99950 -> 0.99940 at batch 8)."""
    node = graph.producer(tensor)
    while node is not None and node.op_type in _MOVES and node.inputs:
        node = graph.producer(node.inputs[0])
    if node is None:
        return False
    if node.op_type in NORMS or node.op_type in GELUS:
        return True
    if node.op_type != "Mul":
        return False
    frontier = [node]
    for _ in range(3):
        nxt = []
        for n in frontier:
            for i in n.inputs:
                p = graph.producer(i)
                if p is None:
                    continue
                if p.op_type in ("Erf", "Tanh"):
                    return True
                nxt.append(p)
        frontier = nxt
    return False


def _candidates(cfg: TensorQuantConfig, bits: int | None) -> list[QParams]:
    """Params of c x the calibrated range for c in CLIPS (the range recovered from the calibrated params)."""
    p = cfg.params
    assert p is not None
    spec = cfg.spec
    s, z = p.scale.double(), p.zero_point.double()
    lo, hi = (spec.qmin - z) * s, (spec.qmax - z) * s
    out = [p]
    for c in CLIPS[1:]:
        a, b = (lo * c).float(), (hi * c).float()
        if bits is not None:
            a, b = round_range_outward(a, b, bits)
        out.append(choose_qparams(a, b, spec, name=cfg.name))
    return out


@dataclass
class MatMulRangesPass(PassBase):
    """The clipped activation ranges of weighted MatMul / Attention inputs (module docstring)."""

    name: ClassVar[str] = "matmul_ranges"
    requires: ClassVar[frozenset[Condition]] = frozenset({Condition.CONFIGS})
    ensures: ClassVar[frozenset[Condition]] = frozenset()
    chosen: dict[str, float] = field(default_factory=dict, repr=False)  # tensor -> factor kept (< 1 only)

    def run(self, ctx: PassContext) -> None:
        qgraph = ctx.quantized
        if not qgraph.validation_batches:
            return
        try:
            with thread_scope(1):  # the errors' sums (and so the choices) must not follow the thread count
                self._run(ctx)
        finally:
            qgraph.range_tensors = {}  # calibration's copies, read once

    def _sites(self, ctx: PassContext) -> Iterator[_Site]:
        qgraph = ctx.quantized
        graph = qgraph.graph
        shared = {id(c) for group in qgraph.shared_scale_groups for c in group}
        by_tensor: dict[str, _Site] = {}
        skip: set[str] = set()
        for node in graph.nodes:
            oc = qgraph.op_configs.get(node.name)
            if oc is None or not oc.inputs or not node.inputs or node.inputs[0] in graph.initializers:
                continue
            cfg, tensor = oc.inputs[0], node.inputs[0]
            w2 = _weight_rows(graph, node)
            if w2 is None:
                continue  # not a weighted reader: its own config, if it quantizes, rules the tensor out below
            if not emits(cfg) or cfg is None or cfg.dominated_by is not None or id(cfg) in shared \
                    or cfg.params is None or cfg.params.scale.numel() != 1 or cfg.spec.is_float \
                    or cfg.spec.granularity is not Granularity.PER_TENSOR:
                skip.add(tensor)
                continue
            if not after_norm_or_gelu(graph, tensor):
                skip.add(tensor)
                continue
            site = by_tensor.get(tensor)
            if site is None:
                by_tensor[tensor] = _Site(tensor, cfg, [node.name], w2)
            elif site.config is cfg and site.w2.numel() == w2.numel():
                site.readers.append(node.name)
                site.w2 = site.w2 + w2
            else:  # readers with their own configs of one tensor: left to calibration
                skip.add(tensor)
        for tensor, site in by_tensor.items():
            if tensor in skip or any(self._quantizes(qgraph, r, tensor) for r in graph.consumers(tensor)
                                     if r.name not in site.readers):
                continue  # a reader outside the search would see the clipped range unmeasured
            yield site

    @staticmethod
    def _quantizes(qgraph: QuantizedGraph, node: Node, tensor: str) -> bool:
        """Whether `node` reads `tensor` quantized (a float reader, e.g. a residual Add, does not see the range)."""
        oc = qgraph.op_configs.get(node.name)
        return oc is not None and any(emits(c) for i, c in enumerate(oc.inputs)
                                      if i < len(node.inputs) and node.inputs[i] == tensor)

    def _batch_values(self, ex: Executor | None, qgraph: QuantizedGraph, index: int, batch: Any,
                      names: list[str]) -> tuple[dict[str, Any], Executor | None]:
        """The FP32 `names` on validation batch `index`: calibration's (QuantizedGraph.range_tensors, computed with
        one thread as here) where it kept them all, else one executor run (the executor built on first use)."""
        kept = qgraph.range_tensors.get(index, {})
        if all(n in kept for n in names):
            return kept, ex
        ex = ex if ex is not None else Executor(qgraph.graph)
        return ex.run(batch, outputs=names), ex

    def _run(self, ctx: PassContext) -> None:
        qgraph = ctx.quantized
        sites = list(self._sites(ctx))
        if not sites:
            return
        bits = ctx.settings.range_bits
        for site in sites:
            site.candidates = _candidates(site.config, bits)
            site.errors = torch.zeros(len(site.candidates), dtype=torch.float64)
        ex: Executor | None = None
        names = [s.tensor for s in sites]
        with torch.no_grad():
            # the kept batches after the first (the first is the accuracy budget's, which judges the choice in
            # placement: analysis.placement.ranges), all of them where there is one
            batches = list(enumerate(qgraph.validation_batches))
            for index, batch in batches[1:] or batches:
                values, ex = self._batch_values(ex, qgraph, index, batch, names)
                for site in sites:
                    x = values[site.tensor]
                    if not isinstance(x, torch.Tensor) or x.shape[-1] != site.w2.numel():
                        site.errors = None
                        continue
                    if site.errors is None:
                        continue
                    # on the CPU: calibration with device="cuda" keeps the values on the GPU
                    x = x.detach().to("cpu", torch.float32).reshape(-1, x.shape[-1])
                    w2 = site.w2.float()
                    for i, p in enumerate(site.candidates):
                        # per row sum_k w2_k d_k^2 (float32, one matrix-vector product), the rows summed in float64
                        d = fake_quantize(x, p.scale, p.zero_point, site.config.spec).sub_(x)
                        site.errors[i] += float(torch.mv(d.square_(), w2).double().sum())
        for site in sites:
            if site.errors is None:
                continue
            base = float(site.errors[0])
            best = min(range(len(CLIPS)), key=lambda i: (float(site.errors[i]), i))  # type: ignore[index]
            if best == 0 or float(site.errors[best]) >= (1.0 - MIN_GAIN) * base:
                continue
            qgraph.clipped_ranges.append(ClippedRange(site.tensor, site.config, site.candidates[0],
                                                      site.candidates[best]))
            site.config.params = site.candidates[best]
            self.chosen[site.tensor] = CLIPS[best]
            ctx.repairs.append(RepairRecord(NAME, tuple(site.readers), (
                ("tensor", site.tensor), ("clip", CLIPS[best]), ("error_before", base),
                ("error_after", float(site.errors[best])))))
