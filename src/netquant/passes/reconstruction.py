"""Block reconstruction (BRECQ, Li et al. 2021): the rounding of every weight in a block learned jointly on the
block's output error, with the block's activation quantizers in the loop; and the block machinery passes.lsq
shares (blocks, captures, a block's differentiable fake-quantized run, the model-level guard).

Blocks. In graph order, a boundary between two nodes is a *cut* where at most one value computed before it is
read after it (a residual block's output, a transformer layer's residual stream, the tensor between two layers
of a plain chain). The nodes between cuts form segments; consecutive segments join into a block until it holds
`layers` quantized weight ops (Conv / Gemm / MatMul, see passes.adaround.weight_targets); segments without one join
the next block. A block's inputs: the values computed before it (or graph inputs) it reads; its outputs: the values
it computes that later nodes or the graph outputs read.

Reconstruction, one block at a time in graph order (each weight W with its final scale s and zero point z):

    W~(V)  = s * (clamp(floor(W / s + z) + h(V), qmin, qmax) - z),   h(V) = clip(sigmoid(V)(zeta - gamma) + gamma, 0, 1)
    loss   = sum_outputs |F~(x~; V) - F(x)|^2 / |F(x)|^2 + lam * mean_all(1 - |2 h(V) - 1|^beta)

x~: the block's inputs as the quantized model computes them (the blocks before it with their learned codes:
captured after they were rounded), F: the FP32 block on the FP32 model's inputs x, F~: the block with W~(V) and
every activation quantizer of the block fake-quantizing (straight-through gradients); beta anneals from 20 to 2
after a warm-up; Adam on V, torch autograd on CPU on one thread, minibatches of captured samples drawn with a
seeded generator. Final codes floor + (V >= 0): every weight at most one step from nearest rounding (one of the
two choices); pair-limited weights (x86 without VNNI) take nearest rounding's pair wherever the learned pair
would exceed the limit. A block keeps its codes only if its output error on a held-out captured batch is lower
than with nearest rounding, and (guard) the whole model keeps them only if its output error vs FP32 on a
calibration batch no block trained on drops. Runs at Stage.WEIGHTS (after bias quantization, before bias
correction, which leaves these ops' biases alone: the codes already cancel the block's mean output shift, upstream
errors included; correcting it again undid that); the codes live in QuantizedGraph.rounded_weights as AdaRound's do.

For placement and other callers: `reconstruct(qgraph, calib_batches, ...)` runs the same on a calibrated
QuantizedGraph (ops restricts it to some weight ops) and returns the records; the pass is a thin wrapper.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from netquant.core.ops import quantize
from netquant.core.tensor_config import TensorQuantConfig
from netquant.errors import ConfigError
from netquant.graph import Executor, Graph, Node
from netquant.graph.ir import Value
from netquant.graph.op_config import TensorRole
from netquant.passes.adaround import (
    GAMMA,
    ZETA,
    Adam,
    WeightTarget,
    nearest_where_over,
    param_view,
    weight_targets,
)
from netquant.passes.base import Condition, PassBase, PassContext, Stage
from netquant.passes.quant_graph import (
    QuantizedGraph,
    RepairRecord,
    RoundedWeight,
    constant_codes,
    emits,
    fake_quant,
)
from netquant.platforms.threads import thread_scope

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Block:
    """A run of nodes between two cuts (module docstring) with the weight ops it optimises."""

    index: int
    nodes: tuple[Node, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    targets: tuple[WeightTarget, ...]

    @property
    def layers(self) -> tuple[str, ...]:
        return tuple(t.oc.op.name for t in self.targets)


def find_blocks(qgraph: QuantizedGraph, layers: int = 4, ops: Sequence[str] | None = None) -> list[Block]:
    """The blocks of qgraph (module docstring): cuts where at most one computed value crosses, segments joined until
    a block holds `layers` weight ops; ops: only these weight ops are targets (blocks without a target are left out)."""
    if layers < 1:
        raise ConfigError(f"a block holds at least one weight layer, got layers={layers}")
    graph = qgraph.graph
    nodes = list(graph.nodes)
    n = len(nodes)
    produced: dict[str, int] = {}
    for i, node in enumerate(nodes):
        for o in node.outputs:
            if o:
                produced[o] = i
    last: dict[str, int] = {}
    for i, node in enumerate(nodes):
        for v in node.inputs:
            if v in produced:
                last[v] = i
    for o in graph.outputs:
        if o.name in produced:
            last[o.name] = n
    crossing = [0] * (n + 2)  # crossing[b]: values made before boundary b (between node b-1 and b) and read after
    for v, p in produced.items():
        if v in last and last[v] > p:
            crossing[p + 1] += 1
            crossing[last[v] + 1] -= 1
    live = list(itertools.accumulate(crossing))
    targets = {t.oc.op.name: t for t in weight_targets(qgraph, tuple(ops) if ops is not None else None)}
    cuts = [0] + [b for b in range(1, n) if live[b] <= 1] + [n]
    blocks: list[Block] = []
    start, count = 0, 0
    for a, b in itertools.pairwise(cuts):
        seg = sum(1 for node in nodes[a:b] if node.name in targets)
        if count and count + seg > layers:
            blocks.append(_block(len(blocks), nodes, start, a, produced, last, graph, targets))
            start, count = a, 0
        count += seg
    if count:
        blocks.append(_block(len(blocks), nodes, start, n, produced, last, graph, targets))
    return blocks


def _block(index: int, nodes: list[Node], a: int, b: int, produced: dict[str, int], last: dict[str, int],
           graph: Graph, targets: dict[str, WeightTarget]) -> Block:
    inits = graph.initializers
    inputs: list[str] = []
    for node in nodes[a:b]:
        for v in node.inputs:
            if v and v not in inits and produced.get(v, -1) < a and v not in inputs:
                inputs.append(v)
    outputs = [o for node in nodes[a:b] for o in node.outputs if o and last.get(o, -1) >= b]
    return Block(index, tuple(nodes[a:b]), tuple(inputs), tuple(outputs),
                 tuple(targets[node.name] for node in nodes[a:b] if node.name in targets))


# ---- captures ----------------------------------------------------------------------------------------------------
def capture(qgraph: QuantizedGraph, batches: Sequence[Batch], names: Sequence[str], fake_quant: bool) -> list[Batch]:
    """names' values per calibration batch in the fake-quantized model (the re-rounded weights and learned scales in
    force now) or the FP32 one."""
    ex = qgraph.executor(fake_quant=fake_quant)
    out = []
    with torch.no_grad():
        for batch in batches:
            values = ex.run(batch, outputs=list(names))
            out.append({k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in values.items()})
    return out


def model_error(qgraph: QuantizedGraph, batches: Sequence[Batch]) -> float:
    """sum over batches and float graph outputs of |y_q - y|^2 / |y|^2 (fake-quantized vs FP32 model)."""
    total = 0.0
    for batch in batches:
        ref = qgraph.run(batch, fake_quant=False)
        out = qgraph.run(batch)
        total += sum(float((out[k].double() - v.double()).square().sum() / v.double().square().sum().clamp_min(1e-30))
                     for k, v in ref.items() if isinstance(v, torch.Tensor) and v.is_floating_point())
    return total


def output_error(out: dict[str, Any], ref: Batch) -> torch.Tensor:
    """sum over ref's float values of |out - ref|^2 / |ref|^2 (differentiable in out)."""
    terms = [(out[k].float() - v.float()).square().sum() / v.float().square().sum().clamp_min(1e-30)
             for k, v in ref.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    return torch.stack(terms).sum() if terms else torch.zeros(())


def _rows(batch: Batch, idx: torch.Tensor, n: int) -> Batch:
    """The samples idx of every value whose dim 0 is the batch's sample count n (others as they are)."""
    return {k: (v.index_select(0, idx) if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == n else v)
            for k, v in batch.items()}


def _samples(batch: Batch) -> int:
    dims = {v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim()}
    return min(dims) if dims else 1


# ---- a block's differentiable fake-quantized run -----------------------------------------------------------------
WeightFn = Callable[[], torch.Tensor]
ActFn = Callable[[torch.Tensor, TensorQuantConfig], torch.Tensor]


class BlockRun:
    """The block as its own graph, run with fake quantization as the QuantizedGraph's hooks apply it (biases stay
    float: their int32 rounding is negligible), except: `weights[(op, input)]` gives a weight's value (a learned
    rounding or scale), `act(x, cfg)` quantizes an activation (default: its config, straight-through gradients)."""

    def __init__(self, qgraph: QuantizedGraph, block: Block) -> None:
        g = qgraph.graph
        used = {v for node in block.nodes for v in node.inputs if v in g.initializers}
        sub = Graph(f"block{block.index}", list(block.nodes), [Value(v) for v in block.inputs],
                    [Value(v) for v in block.outputs], {k: g.initializers[k] for k in used},
                    opset_imports=dict(g.opset_imports))
        self.qgraph, self.block = qgraph, block
        self.ex = Executor(sub, check_inputs=False, inplace=False)
        self.ex.add_pre_hook(self._pre)
        self.ex.add_post_hook(self._post)
        self.weights: dict[tuple[str, int], WeightFn] = {}
        self.act: ActFn = lambda x, cfg: fake_quant(x, cfg)
        self._const: dict[tuple[str, int], torch.Tensor] = {}

    def _pre(self, node: Node, inputs: list[Any]) -> list[Any] | None:
        oc = self.qgraph.op_configs.get(node.name)
        if oc is None:
            return None
        out = list(inputs)
        bias = oc.input_index(TensorRole.BIAS)
        for i, cfg in enumerate(oc.inputs):
            x = out[i] if i < len(out) else None
            if i == bias or not emits(cfg) or not isinstance(x, torch.Tensor) or not x.is_floating_point():
                continue
            assert cfg is not None
            key = (node.name, i)
            if key in self.weights:
                out[i] = self.weights[key]()
            elif node.inputs[i] in self.ex.initializers:
                hit = self._const.get(key)
                if hit is None:
                    hit = self._const[key] = fake_quant(x, cfg)
                out[i] = hit
            else:
                out[i] = self.act(x, cfg)
        return out

    def _post(self, node: Node, outputs: list[Any]) -> list[Any] | None:
        oc = self.qgraph.op_configs.get(node.name)
        if oc is None:
            return None
        out = list(outputs)
        for i, cfg in enumerate(oc.outputs):
            if i < len(out) and emits(cfg) and isinstance(out[i], torch.Tensor) and out[i].is_floating_point():
                assert cfg is not None
                out[i] = self.act(out[i], cfg)
        return out

    def __call__(self, inputs: Batch) -> dict[str, Any]:
        return self.ex.run(inputs)


@dataclass
class BlockData:
    """A block's captured batches: inputs from the fake-quantized model, targets from the FP32 one; the last batch
    (when there are two or more) is held out for the keep decision."""

    inputs: list[Batch]
    targets: list[Batch]

    @property
    def train(self) -> range:
        return range(max(1, len(self.inputs) - 1))

    @property
    def held(self) -> range:
        return range(len(self.inputs) - 1, len(self.inputs)) if len(self.inputs) > 1 else range(1)

    def minibatch(self, gen: torch.Generator, samples: int) -> tuple[Batch, Batch]:
        """A random training batch, `samples` of its samples drawn at random (seeded)."""
        b = int(torch.randint(0, len(self.train), (1,), generator=gen))
        x, y = self.inputs[b], self.targets[b]
        n = _samples(x)
        if samples < n and _samples(y) == n:
            idx = torch.randperm(n, generator=gen)[:samples]
            return _rows(x, idx, n), _rows(y, idx, n)
        return x, y

    def error(self, run: BlockRun, which: range) -> float:
        with torch.no_grad():
            return sum(float(output_error(run(self.inputs[i]), self.targets[i])) for i in which)


def block_data(qgraph: QuantizedGraph, block: Block, batches: Sequence[Batch]) -> BlockData:
    return BlockData(capture(qgraph, batches, block.inputs, True), capture(qgraph, batches, block.outputs, False))


# ---- learned rounding of one weight ------------------------------------------------------------------------------
class _Rounding:
    """AdaRound's relaxed rounding of one target weight (module docstring)."""

    def __init__(self, qgraph: QuantizedGraph, t: WeightTarget) -> None:
        node = t.oc.op
        self.target, self.name = t, node.inputs[t.weight_index]
        w = qgraph.graph.initializers[self.name].float()
        params = t.w_cfg.effective_params
        assert params is not None
        self.w, self.params, self.spec = w, params, t.w_cfg.root.spec
        self.s = param_view(w, t.w_cfg, params.scale.double())
        self.z = param_view(w, t.w_cfg, params.zero_point.double())
        real = w.double() / self.s + self.z
        self.floor = real.floor()
        rest = (real - self.floor).clamp(1e-4, 1 - 1e-4)
        self.v = (-torch.log((ZETA - GAMMA) / (rest - GAMMA) - 1.0)).float().requires_grad_(True)
        self.nearest = constant_codes(w, t.w_cfg).double()
        self._sf, self._zf, self._ff = self.s.float(), self.z.float(), self.floor.float()

    def h(self) -> torch.Tensor:
        return (torch.sigmoid(self.v) * (ZETA - GAMMA) + GAMMA).clamp(0.0, 1.0)

    def soft(self) -> torch.Tensor:
        return self._sf * ((self._ff + self.h()).clamp(self.spec.qmin, self.spec.qmax) - self._zf)

    def codes(self) -> torch.Tensor:
        """floor + (V >= 0), pair-limited where the config asks (nearest rounding's pair where it would overflow)."""
        with torch.no_grad():
            codes = (self.floor + (self.v.detach() >= 0).double()).clamp(self.spec.qmin, self.spec.qmax)
            limit = self.target.w_cfg.effective_pair_limit
            return nearest_where_over(codes, self.nearest, limit) if limit is not None else codes

    def value(self, codes: torch.Tensor) -> torch.Tensor:
        return ((codes - self.z) * self.s).float()


@dataclass(frozen=True)
class BlockResult:
    """One block: its weight ops, held-out block output error with nearest and learned rounding, weights flipped
    from nearest rounding, whether the codes were kept, seconds."""

    block: int
    ops: tuple[str, ...]
    error_nearest: float
    error_learned: float
    flipped: int
    kept: bool
    seconds: float


@dataclass
class ReconstructionSettings:
    """iterations per block, Adam's lr, the regularizer's lam / warm-up share / beta schedule, samples per step,
    calibration batches captured per block (the last one held out), weight layers per block, seed, model guard."""

    iterations: int = 200
    lr: float = 3e-2
    lam: float = 0.1
    warmup: float = 0.2
    beta_start: float = 20.0
    beta_end: float = 2.0
    samples: int = 4
    max_batches: int = 4
    layers: int = 4
    seed: int = 0
    guard: bool = True

    def __post_init__(self) -> None:
        if self.iterations < 1 or self.samples < 1 or self.max_batches < 1 or self.layers < 1:
            raise ConfigError("reconstruction iterations, samples, max_batches and layers must be >= 1")
        if not 0.0 <= self.warmup < 1.0:
            raise ConfigError(f"reconstruction warmup is a share of the iterations in [0, 1), got {self.warmup}")


def _reconstruct_block(qgraph: QuantizedGraph, block: Block, data: BlockData, cfg: ReconstructionSettings
                       ) -> tuple[BlockResult, dict[str, RoundedWeight]]:
    t0 = time.perf_counter()
    run = BlockRun(qgraph, block)
    rounds = [_Rounding(qgraph, t) for t in block.targets]
    for r in rounds:
        run.weights[(r.target.oc.op.name, r.target.weight_index)] = r.soft
    params = [r.v for r in rounds]
    adams = [Adam(p, cfg.lr) for p in params]
    gen = torch.Generator().manual_seed(cfg.seed + block.index)
    warm = int(cfg.warmup * cfg.iterations)
    total = sum(p.numel() for p in params)
    for it in range(cfg.iterations):
        x, y = data.minibatch(gen, cfg.samples)
        loss = output_error(run(x), y)
        if it >= warm:
            frac = (it - warm) / max(1, cfg.iterations - warm)
            beta = cfg.beta_end + (cfg.beta_start - cfg.beta_end) * (1 - frac)
            reg = sum((1 - (2 * r.h() - 1).abs().pow(beta)).sum() for r in rounds)
            loss = loss + cfg.lam * reg / total
        for p in params:
            p.grad = None
        loss.backward()
        for a in adams:
            a.step()
    learned = {r.name: r.codes() for r in rounds}
    for r in rounds:
        c = learned[r.name]
        run.weights[(r.target.oc.op.name, r.target.weight_index)] = lambda r=r, c=c: r.value(c)
    err_learned = data.error(run, data.held)
    for r in rounds:
        run.weights[(r.target.oc.op.name, r.target.weight_index)] = lambda r=r: r.value(r.nearest)
    err_nearest = data.error(run, data.held)
    out: dict[str, RoundedWeight] = {}
    ok = True
    for r in rounds:
        value = r.value(learned[r.name])
        back = quantize(value, r.params.scale, r.params.zero_point, r.spec).double()
        ok = ok and bool(torch.equal(back, learned[r.name]))
        out[r.name] = RoundedWeight(r.target.oc.op.name, r.target.weight_index, r.target.w_cfg.root, r.w.clone(), value,
                                     correct_bias=False)
    kept = ok and err_learned < err_nearest
    flipped = sum(int((learned[r.name] != r.nearest).sum()) for r in rounds)
    return BlockResult(block.index, block.layers, err_nearest, err_learned, flipped, kept,
                       time.perf_counter() - t0), (out if kept else {})


def reconstruct(qgraph: QuantizedGraph, calib_batches: Iterable[Batch], settings: ReconstructionSettings | None = None,
                ops: Sequence[str] | None = None, track: Callable[[Iterable[Any], str, int], Iterable[Any]] | None = None,
                name: str = "reconstruction") -> tuple[list[BlockResult], list[RepairRecord]]:
    """Block reconstruction on a calibrated QuantizedGraph (weight scales final), in place: learned codes go to
    qgraph.rounded_weights. Returns the block results and the repair records (block by block, then the guard's).
    Deterministic for a seed (one torch thread)."""
    cfg = settings or ReconstructionSettings()
    with thread_scope(1):
        batches = list(itertools.islice(calib_batches, cfg.max_batches + (1 if cfg.guard else 0)))
        check = batches[-1:] if cfg.guard and len(batches) > 1 else []
        batches = batches[:-1] if check else batches
        blocks = find_blocks(qgraph, cfg.layers, ops)
        results: list[BlockResult] = []
        records: list[RepairRecord] = []
        learned: dict[str, RoundedWeight] = {}
        items = track(blocks, name, len(blocks)) if track is not None else blocks
        for block in items:
            data = block_data(qgraph, block, batches)
            res, rounded = _reconstruct_block(qgraph, block, data, cfg)
            qgraph.rounded_weights.update(rounded)
            learned.update(rounded)
            results.append(res)
            records.append(RepairRecord(name, res.ops, (
                ("block", res.block), ("error_nearest", res.error_nearest), ("error_learned", res.error_learned),
                ("flipped", res.flipped), ("kept", int(res.kept)), ("iterations", cfg.iterations))))
        if check and learned:
            with_codes = model_error(qgraph, check)
            for k, rw in learned.items():
                del qgraph.rounded_weights[k]
                qgraph.graph.initializers[k] = rw.original
            without = model_error(qgraph, check)
            kept = with_codes < without
            if kept:
                qgraph.rounded_weights.update(learned)
            records.append(RepairRecord(name, tuple(rw.op for rw in learned.values()), (
                ("guard_error_learned", with_codes), ("guard_error_nearest", without), ("kept", int(kept)))))
    return results, records


def guard_kept(records: Sequence[RepairRecord]) -> bool | None:
    """The model guard's decision in a learned pass's records (its last record with guard errors); None: no guard
    ran."""
    guard = [r for r in records if any(k == "guard_error_learned" for k, _ in r.values)]
    return bool(dict(guard[-1].values)["kept"]) if guard else None


@dataclass
class BlockReconstructionPass(PassBase):
    """BRECQ block reconstruction (module docstring) as a pass: `settings` (ReconstructionSettings), `ops` (weight
    ops to optimise; None: all). After the run, `results` holds the block results and `guard_kept` the guard's
    decision (None: no guard ran)."""

    settings: ReconstructionSettings = field(default_factory=ReconstructionSettings)
    ops: tuple[str, ...] | None = None
    results: list[BlockResult] = field(default_factory=list, repr=False)
    guard_kept: bool | None = None

    name: ClassVar[str] = "reconstruction"
    stage: ClassVar[Stage] = Stage.WEIGHTS
    requires: ClassVar[frozenset[Condition]] = frozenset({Condition.BIASES, Condition.CALIB_DATA})
    ensures: ClassVar[frozenset[Condition]] = frozenset()

    def run(self, ctx: PassContext) -> None:
        assert ctx.calib_data is not None
        self.results, records = reconstruct(ctx.quantized, ctx.calib_data, self.settings, self.ops, ctx.track,
                                            self.name)
        ctx.repairs.extend(records)
        self.guard_kept = guard_kept(records)
