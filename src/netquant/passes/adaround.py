"""AdaRound (Nagel et al. 2020, "Up or Down? Adaptive Rounding for Post-Training Quantization"): learned rounding.

For each Conv / Gemm / MatMul whose weight is quantized (integer codes, per tensor or per channel), with its
calibrated scale s and zero point z (final: after bias quantization enlarged any), the codes are floor(W / s + z)
plus a learned h in {0, 1} per weight, so every weight moves at most one step from its floor (nearest rounding is
one of the choices). Relaxed:

    h(V)   = clip(sigmoid(V) * (zeta - gamma) + gamma, 0, 1)          zeta = 1.1, gamma = -0.1
    W~(V)  = s * (clamp(floor(W / s + z) + h(V), qmin, qmax) - z)
    loss   = mean_c |op(q(x), W~(V))_c - op(x, W)_c|^2 / |op(x, W)_c|^2 + lam * mean(1 - |2 h(V) - 1|^beta)

x: the op's input in the FP32 model on calibration batches (captured through the executor); q(x): x itself
(symmetric, the default: the paper's |W x - W~ x|) or, asymmetric=True, what the fake-quantized model feeds the op
through its own input quantizer, captured for each layer after every layer before it took its learned codes (a
capture taken before them held errors those layers then cancelled themselves, and this layer cancelled them a second
time: PP-OCR cls W4A8 cosine 0.767, now 0.990). Never FP32 inputs through the op's input quantizer (the codes then
learn to cancel that quantizer's rounding of the FP32 values, which the quantized model's inputs do not repeat:
PP-OCRv4 rec INT8 97.5 -> 87.5 exact lines while every layer's MSE dropped). The error is relative per output
channel c (a layer-wide relative error lets the channels of small outputs, which BatchNorm-folded layers after it
amplify, take whatever rounding Adam's noise gives them: their share of the error is too small to matter, and
Adam's step does not shrink with the gradient); lam is scale-free; V starts where h(V) is W / s's fractional part; beta anneals linearly from 20 to 2 after a warm-up
(`warmup` of the iterations without the regularizer); Adam on V, torch autograd on CPU, minibatches drawn with
a seeded generator (same seed, same codes). The final codes are floor + (V >= 0); a weight with a pair limit
(x86 without VNNI: same-sign pairs |q0| + |q1| <= 128) takes nearest rounding's codes (which keep the limit:
core.int_kernels.limit_pair_sums) in every pair the learned codes would put over it. Each output channel keeps its learned row only where it
lowers that channel's output error below nearest rounding's on the last quarter of the layer's captured inputs,
which it never trained on (nearest rounding's row elsewhere; rows keep the pair limit either way);
and (guard) the whole model keeps them only if its output error on a held-out calibration batch drops.

Runs after bias quantization (Stage.WEIGHTS), before bias correction, which then corrects the mean shift of
symmetric codes; asymmetric codes already cancel it (upstream errors included) and keep their biases
(RoundedWeight.correct_bias). The graph holds the rounded weights (codes x scale) while the op's weights are quantized with
the config they were learned for (QuantizedGraph.rounded_weights); FP32 runs and float regions read the original.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from netquant.core.int_kernels import PairSumLimit, overflow_pairs
from netquant.core.ops import quantize
from netquant.core.spec import Granularity
from netquant.core.tensor_config import TensorQuantConfig
from netquant.errors import ConfigError
from netquant.graph import Graph, Node
from netquant.graph.op_config import OpQuantConfig, TensorRole
from netquant.graph.ops.registry import OpContext, lookup_op
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

ZETA, GAMMA = 1.1, -0.1
OPS = ("Conv", "Gemm", "MatMul")


@dataclass(frozen=True)
class LayerResult:
    """One layer: output MSE on its captured inputs with nearest and learned rounding, weights flipped (codes that
    differ from nearest rounding's) and whether the learned codes were kept."""

    op: str
    mse_nearest: float
    mse_learned: float
    flipped: int
    kept: bool
    seconds: float


@dataclass
class WeightTarget:
    """A weight op to re-round: its config, the weight's input index, the weight's and the activation input's
    configs."""

    oc: OpQuantConfig
    weight_index: int
    w_cfg: TensorQuantConfig
    a_cfg: TensorQuantConfig | None


def _kernel(graph: Graph, node: Node):  # noqa: ANN202 - the registry's kernel type
    opset = graph.opset_imports.get("", graph.opset)
    fn = lookup_op(node.op_type, "", opset, node.name)
    ctx = OpContext(op_type=node.op_type, name=node.name, domain="", opset=opset, num_outputs=1)
    attrs = dict(node.attrs)
    if node.op_type == "Gemm":
        attrs["beta"] = 0.0
    return lambda x, w: fn([x, w], attrs, ctx)[0]


def param_view(w: torch.Tensor, cfg: TensorQuantConfig, p: torch.Tensor) -> torch.Tensor:
    """A per-tensor or per-channel param p shaped to broadcast against weight w (channel axis of cfg's spec)."""
    if p.numel() == 1:
        return p.reshape(())
    shape = [1] * w.dim()
    shape[(cfg.root.spec.axis or 0) % w.dim()] = -1
    return p.reshape(shape)


class Adam:
    """Adam (Kingma & Ba) on one tensor, betas (0.9, 0.999), eps 1e-8 (torch.optim's import costs seconds)."""

    def __init__(self, p: torch.Tensor, lr: float) -> None:
        self.p, self.lr, self.t = p, lr, 0
        self.m = torch.zeros_like(p)
        self.v = torch.zeros_like(p)

    @torch.no_grad()
    def step(self) -> None:
        g = self.p.grad
        assert g is not None
        self.t += 1
        self.m.mul_(0.9).add_(g, alpha=0.1)
        self.v.mul_(0.999).addcmul_(g, g, value=0.001)
        m_hat = self.m / (1 - 0.9 ** self.t)
        v_hat = self.v / (1 - 0.999 ** self.t)
        self.p.sub_(self.lr * m_hat / (v_hat.sqrt() + 1e-8))


def nearest_where_over(codes: torch.Tensor, nearest: torch.Tensor, limit: PairSumLimit) -> torch.Tensor:
    """codes, with every same-sign pair over the pair limit (in the kernel's K order) replaced by nearest rounding's
    pair (which keeps the limit: quant_graph.constant_codes)."""
    nk = limit.layout.to_nk(codes)
    over = overflow_pairs(nk, limit.limit)
    if not bool(over.any()):
        return codes
    mask = over.repeat_interleave(2, dim=1)[:, : nk.shape[1]]
    return limit.layout.from_nk(torch.where(mask, limit.layout.to_nk(nearest), nk), codes.shape)


def weight_targets(qgraph: QuantizedGraph, ops: tuple[str, ...] | None = None) -> list[WeightTarget]:
    """The Conv / Gemm / MatMul ops (all, or those named in `ops`) whose weight (input 1, a float initializer read by
    this op only) is quantized to integer codes per tensor or per channel and not yet re-rounded, in graph order."""
    graph = qgraph.graph
    out: list[WeightTarget] = []
    for node in graph.nodes:
        oc = qgraph.op_configs.get(node.name)
        if oc is None or node.op_type not in OPS or (ops is not None and node.name not in ops):
            continue
        w_idx = oc.input_index(TensorRole.WEIGHT)
        if w_idx is None or w_idx != 1:
            continue
        w_cfg = oc.inputs[w_idx]
        if not emits(w_cfg):
            continue
        assert w_cfg is not None
        spec = w_cfg.root.spec
        if spec.is_float or spec.granularity is Granularity.PER_GROUP:
            continue
        name = node.inputs[w_idx]
        w = graph.initializers.get(name)
        if w is None or not w.is_floating_point() or name in qgraph.rounded_weights:
            continue
        if len(graph.consumers(name)) != 1 or graph.is_graph_output(name):
            continue
        if node.op_type == "Gemm" and node.attrs.get("transA", 0):
            continue
        a_cfg = oc.inputs[0] if oc.inputs and oc.inputs[0] is not None else None
        out.append(WeightTarget(oc, w_idx, w_cfg, a_cfg))
    return out


def _channel_energy(y: torch.Tensor, axis: int) -> torch.Tensor:
    """sum of y^2 per channel along `axis` (shape (C,))."""
    return y.movedim(axis, -1).reshape(-1, y.shape[axis]).square().sum(0)


def _channel_floor(energy: torch.Tensor) -> torch.Tensor:
    """Channel energies floored at 1e-3 of their mean (a dead channel's relative error stays bounded)."""
    return energy.clamp_min(float(energy.mean()) * 1e-3 + 1e-30)


@dataclass
class AdaRoundPass(PassBase):
    """AdaRound (module docstring). iterations: optimizer steps per layer; lr: Adam's; lam: the regularizer's
    weight; warmup: share of the iterations before the regularizer; batch_images / batch_rows: inputs per step
    (Conv / Gemm-MatMul); max_images / max_rows: inputs kept per layer; max_batches: calibration batches read;
    ops: op names (None: every Conv / Gemm / MatMul with quantized integer weights); seed: minibatch order;
    crop_pixels: each step trains a Conv on one random window of at most this many pixels per spatial dim (the
    target computed on the same window); asymmetric: learn on the inputs the quantized model feeds the layer (AdaRound's
    asymmetric reconstruction: upstream rounding and activation errors included), else on the FP32 model's."""

    iterations: int = 300
    lr: float = 3e-2
    lam: float = 0.1
    warmup: float = 0.2
    beta_start: float = 20.0
    beta_end: float = 2.0
    batch_images: int = 4
    batch_rows: int = 1024
    max_images: int = 32
    max_rows: int = 8192
    max_batches: int = 8
    ops: tuple[str, ...] | None = None
    seed: int = 0
    asymmetric: bool = False
    crop_pixels: int = 32
    guard: bool = True
    guard_kept: bool | None = None
    results: list[LayerResult] = field(default_factory=list, repr=False)

    name: ClassVar[str] = "adaround"
    stage: ClassVar[Stage] = Stage.WEIGHTS
    requires: ClassVar[frozenset[Condition]] = frozenset({Condition.BIASES, Condition.CALIB_DATA})
    ensures: ClassVar[frozenset[Condition]] = frozenset()

    def __post_init__(self) -> None:
        if self.iterations < 1 or self.batch_images < 1 or self.batch_rows < 1 or self.max_batches < 1:
            raise ConfigError("AdaRoundPass iterations, batch_images, batch_rows and max_batches must be >= 1")
        if not 0.0 <= self.warmup < 1.0:
            raise ConfigError(f"AdaRoundPass warmup is a share of the iterations in [0, 1), got {self.warmup}")

    def _targets(self, qgraph: QuantizedGraph) -> list[WeightTarget]:
        return weight_targets(qgraph, self.ops)

    # ---- the pass --------------------------------------------------------------------------------
    def run(self, ctx: PassContext) -> None:
        # one thread: the learned codes and the keep decisions must not follow the machine's load (the thread policy
        # sizes torch's threads to what is free, and float reductions round differently with another thread count)
        with thread_scope(1):
            self._run(ctx)

    def _run(self, ctx: PassContext) -> None:
        qgraph = ctx.quantized
        assert ctx.calib_data is not None
        self.results, self.guard_kept = [], None
        targets = self._targets(qgraph)
        if not targets:
            return
        batches = list(itertools.islice(ctx.calib_data, self.max_batches + 1))
        check = batches[-1:] if self.guard and len(batches) > 1 else []  # never trained on
        batches = batches[:-1] if check else batches[: self.max_batches]
        budget = 1 << 26  # activation elements captured per FP32 run (a group of layers at a time)
        group: list[WeightTarget] = []
        progress = iter(ctx.track(range(len(targets)), "adaround", len(targets)))
        pending = list(targets)
        while pending:
            group, size = [], 0
            while pending and (not group or size < budget):
                group.append(pending.pop(0))
                size += self._estimate(qgraph, group[-1], batches)
            inputs = self._capture(qgraph, group, batches, fake_quant=False)
            for t in group:
                x = inputs.pop(t.oc.op.name, None)
                # asymmetric: what the quantized model feeds this layer *now*, every layer before it with its learned
                # codes (captured per layer: a capture taken before the upstream layers were rounded holds errors they
                # then correct, and this layer would correct them a second time)
                xs = self._capture(qgraph, [t], batches, fake_quant=True).get(t.oc.op.name) \
                    if self.asymmetric and x is not None else x
                if x is not None and xs is not None:
                    self._round(ctx, qgraph, t, x, xs)
                next(progress, None)
        for _ in progress:
            pass
        if check:
            self._guard(ctx, qgraph, check)

    def _guard(self, ctx: PassContext, qgraph: QuantizedGraph, check: list[dict[str, torch.Tensor]]) -> None:
        """Drop every learned code of this run if the fake-quantized model's output error (vs FP32, on a calibration
        batch no layer trained on) is not lower with them than with nearest rounding."""
        mine = {k: rw for k, rw in qgraph.rounded_weights.items()
                if any(r.op == rw.op and r.kept for r in self.results)}
        if not mine:
            return

        def error() -> float:
            total = 0.0
            for batch in check:
                ref = qgraph.run(batch, fake_quant=False)
                out = qgraph.run(batch)
                total += sum(float((out[k].double() - v.double()).square().sum() / v.double().square().sum()
                                   .clamp_min(1e-30)) for k, v in ref.items() if v.is_floating_point())
            return total

        with_codes = error()
        for k, rw in mine.items():
            del qgraph.rounded_weights[k]
            qgraph.graph.initializers[k] = rw.original
        without = error()
        kept = with_codes < without
        if kept:
            qgraph.rounded_weights.update(mine)
        ctx.repairs.append(RepairRecord(self.name, tuple(rw.op for rw in mine.values()), (
            ("guard_error_learned", with_codes), ("guard_error_nearest", without), ("kept", int(kept)))))
        self.guard_kept = kept

    def _estimate(self, qgraph: QuantizedGraph, t: WeightTarget, batches: list[dict[str, torch.Tensor]]) -> int:
        w = qgraph.graph.initializers[t.oc.op.inputs[t.weight_index]]
        keep = self.max_images if t.oc.op.op_type == "Conv" else self.max_rows
        return int(keep * max(w.shape[1] if t.oc.op.op_type == "Conv" else w.shape[0], 1) * 64)

    def _capture(self, qgraph: QuantizedGraph, group: list[WeightTarget], batches: list[dict[str, torch.Tensor]],
                 fake_quant: bool) -> dict[str, torch.Tensor]:
        """Each op's input in the FP32 model (fake_quant False) or the fake-quantized one (the layers rounded so
        far with their learned codes), up to max_images images / max_rows rows, the same samples either way."""
        ex = qgraph.executor(fake_quant=fake_quant)
        names = sorted({t.oc.op.inputs[0] for t in group})
        kept: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        counts = dict.fromkeys(names, 0)
        only_images = all(t.oc.op.op_type == "Conv" for t in group)
        with torch.no_grad():
            for batch in batches:
                if only_images and all(counts[n] >= self.max_images for n in names):
                    break
                values = ex.run(batch, outputs=names)
                for n in names:
                    x = values[n].float()
                    conv = any(t.oc.op.op_type == "Conv" and t.oc.op.inputs[0] == n for t in group)
                    cap = self.max_images if conv else self.max_rows
                    if not conv:
                        x = x.reshape(-1, x.shape[-1])
                        share = max(1, cap // len(batches))
                        x = x[:: max(1, x.shape[0] // share)][:share]
                    room = cap - counts[n]
                    if room > 0:
                        kept[n].append(x[:room].clone())
                        counts[n] += min(room, x.shape[0])
        joined = {n: torch.cat(v) for n, v in kept.items() if v}
        return {t.oc.op.name: joined[t.oc.op.inputs[0]] for t in group if t.oc.op.inputs[0] in joined}

    def _crop(self, x: torch.Tensor, xq: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """The same random window of at most crop_pixels per spatial dim from both (inputs of a Conv), else both."""
        for d in range(2, x.dim()):
            extra = x.shape[d] - self.crop_pixels
            if extra > 0:
                start = int(torch.randint(0, extra + 1, (1,), generator=gen))
                x, xq = x.narrow(d, start, self.crop_pixels), xq.narrow(d, start, self.crop_pixels)
        return x, xq

    def _round(self, ctx: PassContext, qgraph: QuantizedGraph, t: WeightTarget, x: torch.Tensor, seen: torch.Tensor
               ) -> None:
        """Learn the rounding of one layer's weight on its captured inputs: x in the FP32 model (the target
        op(x, W)), `seen` what the quantized model feeds it; record it (module docstring)."""
        t0 = time.perf_counter()
        graph = qgraph.graph
        node = t.oc.op
        name = node.inputs[t.weight_index]
        w = graph.initializers[name].float()
        cfg = t.w_cfg
        params = cfg.effective_params
        assert params is not None
        spec = cfg.root.spec
        s = param_view(w, cfg, params.scale.double())
        z = param_view(w, cfg, params.zero_point.double())
        real = w.double() / s + z
        floor = real.floor()
        rest = (real - floor).clamp(1e-4, 1 - 1e-4)
        fn = _kernel(graph, node)
        a_root = t.a_cfg.root if t.a_cfg is not None else None
        # symmetric (paper eq. 25 without the input quantizer): op(x, W~) vs op(x, W) on FP32 inputs; asymmetric: the
        # quantized model's input through the op's own input quantizer. Never FP32 inputs through the input quantizer:
        # the codes would learn to cancel that quantizer's rounding of FP32 values, an error the quantized model's
        # inputs do not repeat (rec INT8: every layer's MSE down, the model 97.5 -> 87.5)
        xq = fake_quant(seen, a_root) if self.asymmetric and a_root is not None and emits(a_root) else seen
        nearest_codes = constant_codes(w, cfg).double()
        v = (-torch.log((ZETA - GAMMA) / (rest - GAMMA) - 1.0)).float().requires_grad_(True)
        adam = Adam(v, self.lr)
        gen = torch.Generator().manual_seed(self.seed)
        n_items = x.shape[0]
        held = n_items // 4  # the keep decision is taken on inputs the rounding never trained on
        n_train = n_items - held
        per_step = min(n_train, self.batch_images if node.op_type == "Conv" else self.batch_rows)
        sf, zf, floor_f = s.float(), z.float(), floor.float()
        warm = int(self.warmup * self.iterations)
        out_axis = 1 if node.op_type == "Conv" else -1  # output channels of the op's output
        w_axis = 0 if node.op_type == "Conv" or (node.op_type == "Gemm" and node.attrs.get("transB", 0)) else -1
        for it in range(self.iterations):
            idx = torch.randperm(n_train, generator=gen)[:per_step]
            xs, xqs = self._crop(x[idx], xq[idx], gen)
            h = (torch.sigmoid(v) * (ZETA - GAMMA) + GAMMA).clamp(0.0, 1.0)
            wq = sf * ((floor_f + h).clamp(spec.qmin, spec.qmax) - zf)
            with torch.no_grad():
                ref = fn(xs, w)
            loss = (_channel_energy(fn(xqs, wq) - ref, out_axis) / _channel_floor(_channel_energy(ref, out_axis))).mean()
            if it >= warm:
                frac = (it - warm) / max(1, self.iterations - warm)
                beta = self.beta_end + (self.beta_start - self.beta_end) * (1 - frac)
                loss = loss + self.lam * (1 - (2 * h - 1).abs().pow(beta)).mean()
            v.grad = None
            loss.backward()
            adam.step()
        with torch.no_grad():
            codes = (floor + (v.detach() >= 0).double()).clamp(spec.qmin, spec.qmax)
            limit = cfg.effective_pair_limit
            if limit is not None:
                codes = nearest_where_over(codes, nearest_codes, limit)
            test = slice(n_train, n_items) if held else slice(0, n_items)
            ref_test = fn(x[test], w)
            near_out = fn(xq[test], ((nearest_codes - z) * s).float()) - ref_test
            # per output channel: the learned row where its held-out error is lower, nearest rounding's elsewhere
            better = _channel_energy(fn(xq[test], ((codes - z) * s).float()) - ref_test, out_axis) < \
                _channel_energy(near_out, out_axis)
            shape = [1] * codes.dim()
            shape[w_axis] = -1
            codes = torch.where(better.reshape(shape), codes, nearest_codes)
            rounded = ((codes - z) * s).float()
            check = quantize(rounded, params.scale, params.zero_point, spec).double()
            ok = bool(torch.equal(check, codes))
            mse_near = float(near_out.square().mean())
            mse_ada = float((fn(xq[test], rounded) - ref_test).square().mean())
        kept = ok and mse_ada < mse_near
        flipped = int((codes != nearest_codes).sum())
        if kept:
            qgraph.rounded_weights[name] = RoundedWeight(node.name, t.weight_index, cfg.root, w.clone(), rounded,
                                                          correct_bias=not self.asymmetric)
        res = LayerResult(node.name, mse_near, mse_ada, flipped, kept, time.perf_counter() - t0)
        self.results.append(res)
        ctx.repairs.append(RepairRecord(self.name, (node.name,), (
            ("mse_nearest", mse_near), ("mse_learned", mse_ada), ("flipped", flipped), ("kept", int(kept)),
            ("iterations", self.iterations))))
