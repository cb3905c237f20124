"""Learned scales (LSQ, Esser et al. 2020, on calibration data without labels; PPQ's learned-step-size pass):
activation and weight scales tuned block by block on the block's output error.

Blocks, captures and the block run are passes.reconstruction's. Per block, in graph order, every activation
quantizer first met in this block (its root config: per tensor, integer, calibrated) and every quantized weight of
the block's weight ops (per tensor or per channel) gets a scale s = s0 * exp(u), u learned (zero points stay):

    loss = sum_outputs |F~(x~; s) - F(x)|^2 / |F(x)|^2

F~ fake-quantizes with LSQ's step-size gradient (core.ops GradMode.LSQ; the log parametrisation makes Adam's step
a relative change of s), x~ the quantized model's inputs with the earlier blocks' learned scales. A block keeps
its scales only if its output error on a held-out captured batch drops; then (guard) the model keeps them only if
its output error vs FP32 on a calibration batch no block trained on drops. Bias params (int32, s_in * s_w) are
re-derived from the new scales by passes.bias (weight scales enlarged again where a bias would overflow); weights
stay nearest-rounded at their new scale, pair-limited where the target asks (core.int_kernels). Runs at
Stage.WEIGHTS; put it before AdaRound / BlockReconstructionPass, which round at the scales it leaves (weights
already re-rounded by them keep their scales).

For placement and other callers: `learn_scales(qgraph, calib_batches, ...)` runs it on a calibrated QuantizedGraph.
"""

from __future__ import annotations

import itertools
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from netquant.core.ops import GradMode, fake_quantize
from netquant.core.qparams import QParams
from netquant.core.spec import Granularity
from netquant.core.tensor_config import QuantState, TensorQuantConfig
from netquant.errors import ConfigError
from netquant.graph.op_config import TensorRole
from netquant.passes.adaround import Adam
from netquant.passes.base import Condition, PassBase, PassContext, Stage
from netquant.passes.quant_graph import QuantizedGraph, RepairRecord, emits, fake_quant
from netquant.passes.reconstruction import (
    Batch,
    Block,
    BlockRun,
    block_data,
    find_blocks,
    guard_kept,
    model_error,
    output_error,
)
from netquant.platforms.threads import thread_scope


@dataclass(frozen=True)
class ScaleResult:
    """One block: scales learned (activation, weight), held-out block output error before / after, kept, seconds."""

    block: int
    ops: tuple[str, ...]
    activations: int
    weights: int
    error_before: float
    error_learned: float
    kept: bool
    seconds: float


@dataclass
class LearnedScaleSettings:
    """iterations per block, Adam's lr on log-scales, samples per step, calibration batches captured per block (the
    last held out), weight layers per block, seed, which scales to learn, model guard."""

    iterations: int = 200
    lr: float = 5e-3
    samples: int = 4
    max_batches: int = 4
    layers: int = 4
    seed: int = 0
    activations: bool = True
    weights: bool = True
    guard: bool = True

    def __post_init__(self) -> None:
        if self.iterations < 1 or self.samples < 1 or self.max_batches < 1 or self.layers < 1:
            raise ConfigError("learned-scale iterations, samples, max_batches and layers must be >= 1")
        if not (self.activations or self.weights):
            raise ConfigError("LearnedScaleSettings learns nothing: set activations and / or weights")


class _Scale:
    """s = s0 * exp(u) for one root config."""

    def __init__(self, cfg: TensorQuantConfig) -> None:
        params = cfg.params
        assert params is not None
        self.cfg, self.old = cfg, params
        self.s0 = params.scale.detach().float()
        self.u = torch.zeros_like(self.s0, requires_grad=True)

    def scale(self) -> torch.Tensor:
        return self.s0 * torch.exp(self.u)

    def learned(self) -> QParams:
        return QParams(scale=self.scale().detach().clone(), zero_point=self.old.zero_point)


def _learnable(cfg: TensorQuantConfig | None) -> bool:
    if cfg is None or not emits(cfg):
        return False
    root = cfg.root
    return (root.params is not None and root.state in (QuantState.ACTIVATED, QuantState.PASSIVE)
            and not root.spec.is_float and root.spec.granularity is not Granularity.PER_GROUP)


def _block_scales(qgraph: QuantizedGraph, block: Block, seen: set[int], s: LearnedScaleSettings,
                  skip_weights: set[str]) -> tuple[dict[int, _Scale], dict[tuple[str, int], tuple[_Scale, torch.Tensor]]]:
    """The activation roots first met in this block and the block's weight scales."""
    acts: dict[int, _Scale] = {}
    weights: dict[tuple[str, int], tuple[_Scale, torch.Tensor]] = {}
    inits = qgraph.graph.initializers
    targets = {t.oc.op.name: t for t in block.targets}
    for node in block.nodes:
        oc = qgraph.op_configs.get(node.name)
        if oc is None:
            continue
        bias, weight = oc.input_index(TensorRole.BIAS), oc.input_index(TensorRole.WEIGHT)
        t = targets.get(node.name)
        if s.weights and t is not None and _learnable(t.w_cfg) and node.inputs[t.weight_index] not in skip_weights:
            assert t.w_cfg is not None
            weights[(node.name, t.weight_index)] = (_Scale(t.w_cfg.root), inits[node.inputs[t.weight_index]].float())
        if not s.activations:
            continue
        cfgs = [c for i, c in enumerate(oc.inputs) if i not in (bias, weight) and node.inputs[i] not in inits]
        for c in [*cfgs, *oc.outputs]:
            if _learnable(c) and c is not None and c.root.spec.granularity is Granularity.PER_TENSOR \
                    and id(c.root) not in seen:
                seen.add(id(c.root))
                acts[id(c.root)] = _Scale(c.root)
    return acts, weights


def _rederive_biases(qgraph: QuantizedGraph) -> None:
    """Bias params from the current scales (passes.bias; weight scales only ever grow there)."""
    from netquant.passes.base import PassContext
    from netquant.passes.bias import BiasPass

    for oc in qgraph.op_configs.values():
        b = oc.bias_config()
        if b is not None and b.state is QuantState.PASSIVE and b.dominated_by is None:
            b.state, b.params = QuantState.PASSIVE_INIT, None
    before = list(qgraph.bias_scale_adjustments)
    known = set(qgraph.warnings)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        BiasPass().run(PassContext(settings=None, graph=qgraph.graph, qgraph=qgraph))  # type: ignore[arg-type]
    qgraph.bias_scale_adjustments = before + list(qgraph.bias_scale_adjustments)
    qgraph.warnings = list(dict.fromkeys(qgraph.warnings))
    for w in caught:
        if str(w.message) not in known:
            warnings.warn(w.message, w.category, stacklevel=3)


def learn_scales(qgraph: QuantizedGraph, calib_batches: Iterable[Batch], settings: LearnedScaleSettings | None = None,
                 ops: Sequence[str] | None = None, track: Callable[[Iterable[Any], str, int], Iterable[Any]] | None = None,
                 name: str = "learned scales") -> tuple[list[ScaleResult], list[RepairRecord]]:
    """LSQ on a calibrated QuantizedGraph (module docstring), in place: learned scales replace the root configs'
    params. Returns the block results and repair records (block by block, then the guard's)."""
    s = settings or LearnedScaleSettings()
    with thread_scope(1):
        batches = list(itertools.islice(calib_batches, s.max_batches + (1 if s.guard else 0)))
        check = batches[-1:] if s.guard and len(batches) > 1 else []
        batches = batches[:-1] if check else batches
        blocks = find_blocks(qgraph, s.layers, ops)
        results: list[ScaleResult] = []
        records: list[RepairRecord] = []
        changed: list[tuple[TensorQuantConfig, QParams]] = []  # (root, original params)
        seen: set[int] = set()
        skip = set(qgraph.rounded_weights)
        for block in (track(blocks, name, len(blocks)) if track is not None else blocks):
            res, kept = _learn_block(qgraph, block, batches, s, seen, skip)
            changed.extend(kept)
            if kept:
                _rederive_biases(qgraph)
            results.append(res)
            records.append(RepairRecord(name, res.ops, (
                ("block", res.block), ("activation_scales", res.activations), ("weight_scales", res.weights),
                ("error_before", res.error_before), ("error_learned", res.error_learned), ("kept", int(res.kept)),
                ("iterations", s.iterations))))
        if check and changed:
            with_scales = model_error(qgraph, check)
            learned = [(root, root.params) for root, _ in changed]
            for root, old in changed:
                root.params = old
            _rederive_biases(qgraph)
            without = model_error(qgraph, check)
            kept_all = with_scales < without
            if kept_all:
                for root, new in learned:
                    root.params = new
                _rederive_biases(qgraph)
            records.append(RepairRecord(name, tuple(r.name for r, _ in changed), (
                ("guard_error_learned", with_scales), ("guard_error_before", without), ("kept", int(kept_all)))))
    return results, records


def _learn_block(qgraph: QuantizedGraph, block: Block, batches: Sequence[Batch], s: LearnedScaleSettings,
                 seen: set[int], skip: set[str]) -> tuple[ScaleResult, list[tuple[TensorQuantConfig, QParams]]]:
    t0 = time.perf_counter()
    acts, weights = _block_scales(qgraph, block, seen, s, skip)
    if not acts and not weights:
        return ScaleResult(block.index, block.layers, 0, 0, 0.0, 0.0, False, time.perf_counter() - t0), []
    data = block_data(qgraph, block, batches)
    before = data.error(BlockRun(qgraph, block), data.held)  # the model as it is (pair-limited weight codes)
    run = BlockRun(qgraph, block)

    def act(x: torch.Tensor, cfg: TensorQuantConfig) -> torch.Tensor:
        sc = acts.get(id(cfg.root))
        if sc is None:
            return fake_quant(x, cfg)
        return fake_quantize(x, sc.scale(), sc.old.zero_point, sc.cfg.spec, GradMode.LSQ)

    def weight(sc: _Scale, w: torch.Tensor) -> Callable[[], torch.Tensor]:
        return lambda: fake_quantize(w, sc.scale(), sc.old.zero_point, sc.cfg.spec, GradMode.LSQ)

    run.act = act
    for key, (sc, w) in weights.items():
        run.weights[key] = weight(sc, w)
    scales = [*acts.values(), *(sc for sc, _ in weights.values())]
    adams = [Adam(sc.u, s.lr) for sc in scales]
    gen = torch.Generator().manual_seed(s.seed + block.index)
    for _ in range(s.iterations):
        x, y = data.minibatch(gen, s.samples)
        loss = output_error(run(x), y)
        for sc in scales:
            sc.u.grad = None
        loss.backward()
        for a in adams:
            a.step()
    # the held-out error as the model will compute it: weights at their pair-limited nearest codes (fake_quant of
    # the config with the learned params), activations at the learned scales
    originals = [(sc.cfg, sc.cfg.params) for sc in scales]
    for sc in scales:
        sc.cfg.params = sc.learned()
    plain = BlockRun(qgraph, block)
    learned_err = data.error(plain, data.held)
    kept = learned_err < before
    if not kept:
        for cfg, old in originals:
            cfg.params = old
    res = ScaleResult(block.index, block.layers, len(acts), len(weights), before, learned_err, kept,
                      time.perf_counter() - t0)
    return res, ([(cfg, old) for cfg, old in originals if old is not None] if kept else [])


@dataclass
class LearnedScalePass(PassBase):
    """LSQ learned scales (module docstring) as a pass: `settings` (LearnedScaleSettings), `ops` (weight ops whose
    blocks are tuned; None: all). After the run, `results` holds the block results and `guard_kept` the guard's
    decision (None: no guard ran)."""

    settings: LearnedScaleSettings = field(default_factory=LearnedScaleSettings)
    ops: tuple[str, ...] | None = None
    results: list[ScaleResult] = field(default_factory=list, repr=False)
    guard_kept: bool | None = None

    name: ClassVar[str] = "learned scales"
    stage: ClassVar[Stage] = Stage.WEIGHTS
    requires: ClassVar[frozenset[Condition]] = frozenset({Condition.BIASES, Condition.CALIB_DATA})
    ensures: ClassVar[frozenset[Condition]] = frozenset({Condition.BIASES})

    def run(self, ctx: PassContext) -> None:
        assert ctx.calib_data is not None
        self.results, records = learn_scales(ctx.quantized, ctx.calib_data, self.settings, self.ops, ctx.track,
                                             self.name)
        ctx.repairs.extend(records)
        self.guard_kept = guard_kept(records)
