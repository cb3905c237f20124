"""SmoothQuant (Xiao et al. 2023): migrate activation outliers into the weights, per input channel, exactly.

For a tensor X read by linear ops (MatMul / Gemm with a constant weight, Conv of any kernel with group 1) and
channel j:

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)      (max|W_j| over every reader's weights of channel j)
    X'_j = X_j / s_j (folded upstream),   W'_j = W_j * s_j   =>   op(X', W') = op(X, W)

so a channel whose activations are large (an outlier) is shrunk before the per-tensor activation quantizer and
its weights grow to compensate. The strength alpha is searched per tensor over `alphas` on the readers' output
error with fake quantization (activations per tensor at min / max, weights with the platform's weight spec):

    err(alpha) = sum_readers |op(q(X'), q(W')) - op(X, W)|^2 / |op(X, W)|^2

on a sample of the calibration activations; the best alpha is applied only where it lowers err below the
unsmoothed error by `min_gain` (relative). 1 / s is folded into the producer (a LayerNormalization's scale and
bias, a Conv / Gemm / MatMul's output channels with their bias or bias Add, through Relu / PRelu / LeakyRelu /
MaxPool) when every reader of X is smoothed with the same s; otherwise (a graph input, a residual
branch, an unfoldable producer) an explicit Mul is put on the edges into the smoothed readers (insert_mul).
Runs before configs are built (Stage.GRAPH): weight and activation scales are then calibrated on the smoothed
model, and pair-limited weights (x86 without VNNI) are pair-limited as usual.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from netquant.core.spec import QuantSpec
from netquant.errors import ConfigError
from netquant.graph import Graph, Node
from netquant.graph.executor import Executor
from netquant.graph.ops.registry import OpContext, lookup_op
from netquant.passes.base import Condition, PassBase, PassContext, Stage
from netquant.passes.quant_graph import RepairRecord
from netquant.passes.rescale import (
    LinearOp,
    Rescaler,
    fake_quant_activation,
    fake_quant_weight,
    in_channel_absmax,
    linear_op,
    scale_in_channels,
    set_input,
)
from netquant.platforms.threads import thread_scope

DEFAULT_ALPHAS = tuple(round(0.1 * i, 1) for i in range(1, 10))  # 0.1 .. 0.9
EPS = 1e-8


@dataclass
class _Site:
    """A tensor whose readers can be smoothed together."""

    tensor: str
    readers: list[LinearOp]
    act_axis: int
    absmax: torch.Tensor | None = None  # per channel, over the calibration batches
    sample: torch.Tensor | None = None  # activations the strength is searched on


@dataclass(frozen=True)
class SmoothResult:
    """The choice for one tensor: alpha (None: left alone), errors without and with smoothing, how it was folded."""

    tensor: str
    alpha: float | None
    error_before: float
    error_after: float
    folded: str  # "producer", "mul" or "" (not applied)


def _readers(graph: Graph, tensor: str) -> list[tuple[Node, LinearOp | None]]:
    out: list[tuple[Node, LinearOp | None]] = []
    for node in graph.consumers(tensor):
        lin = linear_op(graph, node)
        ok = (lin is not None and node.inputs[0] == tensor and tensor not in node.inputs[1:]
              and (lin.op_type != "Conv" or lin.groups == 1))
        out.append((node, lin if ok else None))
    return out


def _op_fn(graph: Graph, node: Node):  # noqa: ANN202 - the registry's kernel type
    opset = graph.opset_imports.get("", graph.opset)
    fn = lookup_op(node.op_type, "", opset, node.name)
    ctx = OpContext(op_type=node.op_type, name=node.name, domain="", opset=opset, num_outputs=1)
    return lambda x, w: fn([x, w], node.attrs, ctx)[0]


@dataclass
class SmoothQuantPass(PassBase):
    """SmoothQuant (module docstring). alphas: the strengths searched; min_gain: the relative error reduction a
    tensor needs to be smoothed; max_batches: calibration batches for the channel ranges; sample_rows: activation
    rows (MatMul / Gemm) kept for the search; sample_images / sample_pixels: Conv inputs kept, centre-cropped to at
    most sample_pixels per spatial dim; insert_mul: smooth readers whose
    producer cannot absorb 1 / s through an explicit Mul (off by default: the Mul's input is still quantized at the
    unsmoothed range, and its per-channel constant is quantized per tensor); ops: op types smoothed."""

    alphas: tuple[float, ...] = DEFAULT_ALPHAS
    min_gain: float = 0.02
    max_batches: int = 8
    sample_rows: int = 1024
    sample_images: int = 2
    sample_pixels: int = 16
    insert_mul: bool = False
    ops: tuple[str, ...] = ("MatMul", "Gemm", "Conv")
    results: list[SmoothResult] = field(default_factory=list, repr=False)

    name: ClassVar[str] = "smoothquant"
    stage: ClassVar[Stage] = Stage.GRAPH
    requires: ClassVar[frozenset[Condition]] = frozenset({Condition.GRAPH, Condition.CALIB_DATA})
    ensures: ClassVar[frozenset[Condition]] = frozenset()

    def __post_init__(self) -> None:
        if not self.alphas or any(not 0.0 <= a <= 1.0 for a in self.alphas):
            raise ConfigError(f"SmoothQuantPass alphas must be strengths in [0, 1], got {self.alphas!r}")
        if self.max_batches < 1 or self.sample_rows < 1 or self.sample_images < 1:
            raise ConfigError("SmoothQuantPass max_batches, sample_rows and sample_images must be >= 1")

    def run(self, ctx: PassContext) -> None:
        with thread_scope(1):  # the search's floats (and so its choices) must not follow the machine's load
            self._run(ctx)

    def _run(self, ctx: PassContext) -> None:
        assert ctx.calib_data is not None
        platform = ctx.settings.effective_platform()
        self.results = []
        graph = ctx.graph
        sites = self._sites(graph)
        if not sites:
            return
        batches = list(itertools.islice(ctx.calib_data, self.max_batches))
        self._observe(graph, sites, batches)
        rescaler = Rescaler(graph)
        for site in ctx.track(sites, "smoothquant", len(sites)):
            res = self._smooth(graph, rescaler, site, platform.activation, platform.weight)
            self.results.append(res)
            if res.folded:
                ctx.repairs.append(RepairRecord(self.name, tuple(r.node.name for r in site.readers), (
                    ("tensor", site.tensor), ("alpha", float(res.alpha or 0.0)), ("folded", res.folded),
                    ("error_before", res.error_before), ("error_after", res.error_after))))

    # ---- finding and observing ---------------------------------------------------------------
    def _sites(self, graph: Graph) -> list[_Site]:
        sites: list[_Site] = []
        seen: set[str] = set()
        for node in graph.nodes:
            if node.op_type not in self.ops or not node.inputs or node.inputs[0] in seen:
                continue
            tensor = node.inputs[0]
            seen.add(tensor)
            if tensor in graph.initializers:
                continue
            readers = [lin for _, lin in _readers(graph, tensor) if lin is not None and lin.op_type in self.ops]
            axes = {r.act_axis for r in readers}
            if not readers or len(axes) != 1:
                continue
            sizes = {int(in_channel_absmax(r, graph.initializers[r.weight]).numel()) for r in readers}
            if len(sizes) != 1:
                continue
            sites.append(_Site(tensor, readers, axes.pop()))
        return sites

    def _observe(self, graph: Graph, sites: list[_Site], batches: list[dict[str, torch.Tensor]]) -> None:
        ex = Executor(graph)
        names = [s.tensor for s in sites]
        with torch.no_grad():
            for batch in batches:
                values = ex.run(batch, outputs=names)
                for site in sites:
                    x = values[site.tensor].float()
                    axis = site.act_axis % x.dim()
                    m = x.abs().movedim(axis, -1).reshape(-1, x.shape[axis]).amax(0).double()
                    site.absmax = m if site.absmax is None else torch.maximum(site.absmax, m)
                    site.sample = self._sample(site.sample, x, site.act_axis, len(batches))

    def _sample(self, kept: torch.Tensor | None, x: torch.Tensor, act_axis: int, batches: int) -> torch.Tensor:
        """kept plus this batch's share: sample_rows / batches evenly strided rows (MatMul / Gemm), or images up to
        sample_images (Conv)."""
        if act_axis < 0:
            rows = x.reshape(-1, x.shape[-1])
            share = max(1, self.sample_rows // batches)
            new = rows[:: max(1, rows.shape[0] // share)][:share]
        else:
            have = 0 if kept is None else kept.shape[0]
            new = x[: max(0, self.sample_images - have)]
            for d in range(2, new.dim()):
                extra = new.shape[d] - self.sample_pixels
                if extra > 0:
                    new = new.narrow(d, extra // 2, self.sample_pixels)
        new = new.contiguous().clone()
        return new if kept is None else torch.cat([kept, new])

    # ---- the search ----------------------------------------------------------------------------
    def _error(self, graph: Graph, site: _Site, s: torch.Tensor | None, a_spec: QuantSpec,
               w_spec: QuantSpec, refs: list[torch.Tensor]) -> float:
        assert site.sample is not None
        x = site.sample
        if s is not None:
            shape = [-1] if site.act_axis < 0 else [-1] + [1] * (x.dim() - 2)
            x = x / s.float().reshape(shape)
        xq = fake_quant_activation(x, a_spec)
        total = 0.0
        for r, ref in zip(site.readers, refs):
            w = graph.initializers[r.weight]
            ws = scale_in_channels(r, w, s) if s is not None else w
            y = self._apply(graph, r, xq, fake_quant_weight(r, ws, w_spec))
            total += float((y - ref).square().sum() / ref.square().sum().clamp_min(EPS))
        return total

    @staticmethod
    def _apply(graph: Graph, r: LinearOp, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if r.op_type == "Conv":
            return _op_fn(graph, r.node)(x, w)
        m = w if not (r.op_type == "Gemm" and r.node.attrs.get("transB", 0)) else w.t()
        return x @ m

    def _smooth(self, graph: Graph, rescaler: Rescaler, site: _Site, a_spec: QuantSpec, w_spec: QuantSpec
                ) -> SmoothResult:
        assert site.absmax is not None and site.sample is not None
        with torch.no_grad():
            refs = [self._apply(graph, r, site.sample, graph.initializers[r.weight]) for r in site.readers]
            base = self._error(graph, site, None, a_spec, w_spec, refs)
            w_max = torch.stack([in_channel_absmax(r, graph.initializers[r.weight]) for r in site.readers]).amax(0)
            x_max = site.absmax
            live = (x_max > EPS) & (w_max > EPS)
            best: tuple[float, float, torch.Tensor] | None = None
            for alpha in self.alphas:
                s = torch.where(live, x_max.clamp_min(EPS) ** alpha / w_max.clamp_min(EPS) ** (1.0 - alpha),
                                torch.ones_like(x_max))
                s = s / s[live].log().mean().exp() if bool(live.any()) else s  # geometric mean 1: tidy magnitudes
                err = self._error(graph, site, s, a_spec, w_spec, refs)
                if best is None or err < best[1]:
                    best = (alpha, err, s)
        assert best is not None
        alpha, err, s = best
        if not err < base * (1.0 - self.min_gain):
            return SmoothResult(site.tensor, None, base, base, "")
        folded = self._fold(graph, rescaler, site, s)
        if not folded:
            return SmoothResult(site.tensor, None, base, base, "")
        for r in site.readers:
            set_input(graph, r.node, 1, scale_in_channels(r, graph.initializers[r.weight], s))
        return SmoothResult(site.tensor, alpha, base, err, folded)

    def _fold(self, graph: Graph, rescaler: Rescaler, site: _Site, s: torch.Tensor) -> str:
        """Divide the channels of site.tensor by s where the readers see it: upstream, or with a Mul."""
        f = 1.0 / s
        rank = rescaler.rank(site.tensor)
        if rank is None and site.act_axis >= 0:
            rank = graph.initializers[site.readers[0].weight].dim()
        readers = {id(r.node) for r in site.readers}
        all_smoothed = all(id(n) in readers for n in graph.consumers(site.tensor))
        if all_smoothed and not graph.is_graph_output(site.tensor):
            edits = rescaler.plan_fold(site.tensor, f, site.act_axis, rank)
            if edits is not None:
                for edit in edits:
                    edit()
                return "producer"
        if not self.insert_mul:
            return ""
        out = rescaler.insert_channel_mul(site.tensor, f, site.act_axis, rank, [r.node for r in site.readers],
                                          f"{site.tensor}_smooth")
        return "mul" if out is not None else ""
