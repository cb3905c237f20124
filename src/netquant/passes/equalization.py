"""Cross-layer equalization and high-bias absorption (Nagel et al. 2019, "Data-Free Quantization"), exact in FP32.

A pair of linear ops (Conv of any group, depthwise included; Gemm; MatMul) where the first's output reaches the
second's input through positively homogeneous ops only (Relu, LeakyRelu, PRelu, MaxPool, Identity; the bias Add
right after a MatMul), every tensor on the way read by nothing else:

    r1[c] = max |W1[c, ...]|   (output channel c of the first op)
    r2[c] = max |W2[:, c, ...]| (everything the second op reads of channel c; over all readers of the tensor)
    s[c]  = sqrt(r1[c] / r2[c])  =>  W1[c] / s[c] and its bias / s[c],  W2[:, c] * s[c]:  both ranges sqrt(r1 r2)

Outputs are unchanged (g(x / s) = g(x) / s for those g and s > 0). Chains (Conv -> depthwise -> Conv) share the
middle op: the pairs are equalized in turn, `iterations` times or until no scale moves by more than `tolerance`.
Per-tensor weights then waste no range on channels with small weights; per-channel weights gain through the
activations between the ops, whose channels become alike.

ReLU6 (Clip(0, 6)) does not commute with per-channel scales: clip(x / s, 0, 6) != clip(x, 0, 6) / s. `clip` =
ClipMode.SKIP (default) leaves such pairs alone; ClipMode.EXACT rewrites Clip(0, hi) on a pair's path into
Min(Relu(x), c) with c = hi, which does commute once c is scaled too (min(x / s, c / s) = min(x, c) / s): channel k
is then clipped at hi / s[k] (a per-channel constant), exact in FP32; a Min whose constant stayed one number (no
scale moved) goes back to Clip. ClipMode.RELU replaces the Clip by Relu (AIMET's choice; it changes the FP32 model
wherever a pre-activation exceeds hi: those values are no longer clipped).

High-bias absorption (absorb_bias, needs calibration data): where the path is first -> Relu -> second and the
second op adds no padding (a 1x1 Conv without pads, a Gemm), a channel whose pre-activation stays above
c = max(0, min(mean - 3 std, observed minimum)) (over the calibration batches) moves c into the next op:

    b1' = b1 - c,   b2' = b2 + W2 c   (Relu(x - c) + c = Relu(x) for x >= c)

exact on every calibration sample; it shrinks the activation range the Relu output is quantized with.
Runs before configs are built (Stage.GRAPH): the quantizer calibrates and pair-limits the equalized weights.
"""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from netquant.errors import ConfigError
from netquant.graph import Graph, Node
from netquant.graph.executor import Executor
from netquant.passes.base import Condition, PassBase, PassContext, Stage
from netquant.passes.quant_graph import RepairRecord
from netquant.passes.rescale import (
    HOMOGENEOUS,
    LinearOp,
    Rescaler,
    in_channel_absmax,
    linear_op,
    out_channel_absmax,
    scale_in_channels,
    set_input,
)
from netquant.platforms.threads import thread_scope


class ClipMode(enum.Enum):
    """What equalization does with a Clip (ReLU6) between two ops."""

    SKIP = "skip"  # leave the pair alone (exact)
    EXACT = "exact"  # Clip(0, hi) -> Min(Relu(x), hi / s per channel) (exact)
    RELU = "relu"  # replace Clip(0, hi) by Relu on the path (AIMET; not exact where activations exceed hi)


@dataclass
class Pair:
    """Two linear ops joined by channel-preserving ops: `first` writes the channels `seconds` read from `tensor`."""

    first: LinearOp
    seconds: list[LinearOp]
    tensor: str  # what the second ops read
    path: list[Node]  # the ops between, from first's output down to `tensor`
    pre: str  # first's output (its pre-activation)


def _single_reader(graph: Graph, tensor: str) -> bool:
    return len(graph.consumers(tensor)) == 1 and not graph.is_graph_output(tensor)


def _clip_bounds(graph: Graph, node: Node) -> tuple[float, float] | None:
    lo = node.attrs.get("min", -math.inf)
    hi = node.attrs.get("max", math.inf)
    for i, default in ((1, lo), (2, hi)):
        if i < len(node.inputs) and node.inputs[i]:
            v = graph.initializers.get(node.inputs[i])
            if v is None or v.numel() != 1:
                return None
            if i == 1:
                lo = float(v)
            else:
                hi = float(v)
        elif i == 1:
            lo = float(default)
        else:
            hi = float(default)
    return float(lo), float(hi)


def _walk_up(graph: Graph, tensor: str, clip: ClipMode) -> tuple[LinearOp, list[Node]] | None:
    """The linear op whose output channels reach `tensor` through channel-preserving ops, and those ops (top down)."""
    path: list[Node] = []
    current = tensor
    while True:
        node = graph.producer(current)
        if node is None or node.domain not in ("", "ai.onnx"):
            return None
        lin = linear_op(graph, node)
        if lin is not None:
            return lin, path[::-1]
        op = node.op_type
        if op == "Clip":
            bounds = _clip_bounds(graph, node)
            if clip is ClipMode.SKIP or bounds is None or bounds[0] != 0.0:
                return None
        elif op in ("Min", "Max"):  # a per-channel clip of ClipMode.EXACT: one constant operand
            if len(node.inputs) != 2 or sum(n in graph.initializers for n in node.inputs) != 1:
                return None
        elif op in ("Add", "Sub"):  # a bias Add right after the linear op (see rescale.Rescaler.plan_fold)
            consts = [i for i, n in enumerate(node.inputs) if n in graph.initializers]
            if len(consts) != 1:
                return None
            below = graph.producer(node.inputs[1 - consts[0]])
            if below is None or linear_op(graph, below) is None:
                return None
        elif op not in HOMOGENEOUS or (op == "MaxPool" and len(node.outputs) > 1 and any(node.outputs[1:])):
            return None
        src = next(n for n in node.inputs if n and n not in graph.initializers) \
            if op in ("Add", "Sub", "Min", "Max") else node.inputs[0]
        if not _single_reader(graph, src):
            return None
        path.append(node)
        current = src


def find_pairs(graph: Graph, clip: ClipMode = ClipMode.SKIP) -> list[Pair]:
    """Every equalizable pair in graph order (module docstring)."""
    pairs: list[Pair] = []
    seen: set[str] = set()
    for node in graph.nodes:
        lin = linear_op(graph, node)
        if lin is None or node.inputs[0] in seen or node.inputs[0] in graph.initializers:
            continue
        tensor = node.inputs[0]
        seen.add(tensor)
        readers = [linear_op(graph, n) for n in graph.consumers(tensor)]
        if any(r is None or r.node.inputs[0] != tensor or tensor in r.node.inputs[1:] for r in readers):
            continue
        seconds = [r for r in readers if r is not None]
        if graph.is_graph_output(tensor):
            continue
        found = _walk_up(graph, tensor, clip)
        if found is None:
            continue
        first, path = found
        if first.node in [s.node for s in seconds]:
            continue
        axes = {first.act_axis, *(s.act_axis for s in seconds)}
        if len(axes) != 1:
            continue
        c = out_channel_absmax(first, graph.initializers[first.weight]).numel()
        if any(in_channel_absmax(s, graph.initializers[s.weight]).numel() != c for s in seconds):
            continue
        pre = first.node.outputs[0]
        if path and not _single_reader(graph, pre):
            continue
        if not path and len(graph.consumers(pre)) != len(seconds):
            continue
        pairs.append(Pair(first, seconds, tensor, path, pre))
    return pairs


def _split_clip(graph: Graph, clip: Node) -> tuple[Node, Node, Node]:
    """Clip(x, 0, hi) -> Min(Relu(x), hi) in place (hi a scalar initializer, made per channel by rescaling); the
    original Clip (for _merge_clip), the Relu and the Min."""
    original = Node(name=clip.name, op_type="Clip", inputs=list(clip.inputs), outputs=list(clip.outputs),
                    attrs=dict(clip.attrs), attr_types=dict(clip.attr_types), domain=clip.domain)
    hi = _clip_bounds(graph, clip)
    assert hi is not None  # _walk_up accepted it
    relu = Node(name=graph.fresh_name(f"{clip.name}_relu"), op_type="Relu", inputs=[clip.inputs[0]],
                outputs=[graph.fresh_name(f"{clip.inputs[0]}_relu")])
    const = graph.fresh_name(f"{clip.name}_max")
    graph.initializers[const] = torch.tensor(hi[1], dtype=torch.float32)
    minimum = Node(name=graph.fresh_name(f"{clip.name}_min"), op_type="Min", inputs=[relu.outputs[0], const],
                   outputs=list(clip.outputs))
    graph.replace_node(clip, [relu, minimum])
    return original, relu, minimum


def _merge_clip(graph: Graph, original: Node, relu: Node, minimum: Node) -> int:
    """Put the Clip back where the Min's constant is still one number (no scale moved it); 1 if the per-channel
    Min stays."""
    const = next((n for n in minimum.inputs if n in graph.initializers), None)
    if const is None or graph.initializers[const].numel() != 1:
        return 1
    original.inputs[0] = relu.inputs[0]
    graph.replace_node(minimum, original)
    graph.remove_node(relu, reconnect=False)
    if not graph.consumers(const):
        del graph.initializers[const]
    return 0


@dataclass(frozen=True)
class PairResult:
    """One equalized pair: the spread (max / min over channels) of the first op's output-channel ranges before and
    after, and the channels whose high bias was absorbed."""

    first: str
    seconds: tuple[str, ...]
    spread_before: float
    spread_after: float
    absorbed: int = 0


def _spread(r: torch.Tensor) -> float:
    live = r[r > 0]
    return float(live.max() / live.min()) if live.numel() else 1.0


@dataclass
class EqualizationPass(PassBase):
    """Cross-layer equalization and high-bias absorption (module docstring). iterations / tolerance: the rounds
    over all pairs and the largest |log s| that ends them early; absorb_bias: high-bias absorption (uses up to
    max_batches calibration batches); clip: ClipMode for ReLU6 paths."""

    iterations: int = 20
    tolerance: float = 1e-4
    absorb_bias: bool = True
    clip: ClipMode = ClipMode.SKIP
    max_batches: int = 8
    results: list[PairResult] = field(default_factory=list, repr=False)
    per_channel_clips: int = field(default=0, repr=False)  # ReLU6 kept as Min(Relu(x), c) (ClipMode.EXACT)

    name: ClassVar[str] = "equalization"
    stage: ClassVar[Stage] = Stage.GRAPH
    requires: ClassVar[frozenset[Condition]] = frozenset({Condition.GRAPH})
    ensures: ClassVar[frozenset[Condition]] = frozenset()

    def __post_init__(self) -> None:
        if self.iterations < 1 or self.max_batches < 1:
            raise ConfigError("EqualizationPass iterations and max_batches must be >= 1")
        if not isinstance(self.clip, ClipMode):
            self.clip = ClipMode(self.clip)

    def run(self, ctx: PassContext) -> None:
        with thread_scope(1):  # the search's floats (and so its choices) must not follow the machine's load
            self._run(ctx)

    def _run(self, ctx: PassContext) -> None:
        graph = ctx.graph
        self.results = []
        pairs = find_pairs(graph, self.clip)
        if not pairs:
            return
        if self.clip is ClipMode.RELU:
            for p in pairs:
                for n in p.path:
                    if n.op_type == "Clip":
                        n.op_type, n.inputs, n.attrs, n.attr_types = "Relu", n.inputs[:1], {}, {}
        clips: list[tuple[Node, Node, Node]] = []
        if self.clip is ClipMode.EXACT:
            clips = [_split_clip(graph, n) for p in pairs for n in p.path if n.op_type == "Clip"]
            pairs = find_pairs(graph, self.clip)
        before = [_spread(out_channel_absmax(p.first, graph.initializers[p.first.weight])) for p in pairs]
        rescaler = Rescaler(graph)
        for _ in ctx.track(range(self.iterations), "equalization", self.iterations):
            moved = 0.0
            for p in pairs:
                moved = max(moved, self._equalize(graph, rescaler, p))
            if moved < self.tolerance:
                break
        clipped = sum(_merge_clip(graph, *c) for c in clips)
        absorbed = [0] * len(pairs)
        if self.absorb_bias and ctx.calib_data is not None:
            absorbed = self._absorb(graph, pairs, list(itertools.islice(ctx.calib_data, self.max_batches)))
        for p, b, n in zip(pairs, before, absorbed):
            after = _spread(out_channel_absmax(p.first, graph.initializers[p.first.weight]))
            res = PairResult(p.first.node.name, tuple(s.node.name for s in p.seconds), b, after, n)
            self.results.append(res)
            ctx.repairs.append(RepairRecord(self.name, (res.first, *res.seconds), (
                ("spread_before", b), ("spread_after", after), ("absorbed_channels", n))))
        self.per_channel_clips = clipped

    @staticmethod
    def _equalize(graph: Graph, rescaler: Rescaler, p: Pair) -> float:
        """One equalization of pair p; the largest |log s| applied."""
        r1 = out_channel_absmax(p.first, graph.initializers[p.first.weight])
        r2 = torch.stack([in_channel_absmax(s, graph.initializers[s.weight]) for s in p.seconds]).amax(0)
        live = (r1 > 0) & (r2 > 0)
        s = torch.where(live, (r1 / r2.clamp_min(1e-300)).sqrt(), torch.ones_like(r1))
        moved = float(s.log().abs().max()) if s.numel() else 0.0
        if moved == 0.0:
            return 0.0
        rank = rescaler.rank(p.tensor)
        if rank is None and p.first.act_axis >= 0:
            rank = graph.initializers[p.first.weight].dim()
        edits = rescaler.plan_fold(p.tensor, 1.0 / s, p.first.act_axis, rank)
        if edits is None:
            return 0.0
        for edit in edits:
            edit()
        for sec in p.seconds:
            set_input(graph, sec.node, 1, scale_in_channels(sec, graph.initializers[sec.weight], s))
        return moved

    @staticmethod
    def _absorbable(graph: Graph, p: Pair) -> bool:
        if [n.op_type for n in p.path] != ["Relu"] or p.first.bias_index is None or len(p.seconds) != 1:
            return False
        sec = p.seconds[0]
        if sec.op_type == "Conv":
            w = graph.initializers[sec.weight]
            pads = sec.node.attrs.get("pads", [0] * (2 * (w.dim() - 2)))
            auto = sec.node.attrs.get("auto_pad", "NOTSET")
            auto = auto.decode() if isinstance(auto, bytes) else auto
            if any(int(v) != 1 for v in w.shape[2:]) or any(int(v) for v in pads) or auto not in ("NOTSET", "VALID"):
                return False
            if sec.groups != 1:
                return False
        elif sec.op_type != "Gemm":
            return False
        return sec.bias_index is not None or sec.op_type == "Conv"

    def _absorb(self, graph: Graph, pairs: list[Pair], batches: list[dict[str, torch.Tensor]]) -> list[int]:
        todo = [(i, p) for i, p in enumerate(pairs) if self._absorbable(graph, p)]
        counts = [0] * len(pairs)
        if not todo or not batches:
            return counts
        axes = {p.pre: p.first.act_axis for _, p in todo}
        names = sorted(axes)
        ex = Executor(graph)
        stats: dict[str, list[torch.Tensor]] = {}
        with torch.no_grad():
            for batch in batches:
                values = ex.run(batch, outputs=names)
                for name in names:
                    y = values[name].double()
                    axis = axes[name] % y.dim()
                    rows = y.movedim(axis, -1).reshape(-1, y.shape[axis])
                    acc = stats.setdefault(name, [torch.zeros(rows.shape[1], dtype=torch.float64)] * 3
                                           + [torch.full((rows.shape[1],), math.inf, dtype=torch.float64)])
                    acc[0] = acc[0] + rows.shape[0]
                    acc[1] = acc[1] + rows.sum(0)
                    acc[2] = acc[2] + rows.square().sum(0)
                    acc[3] = torch.minimum(acc[3], rows.amin(0))
        for i, p in todo:
            n, s1, s2, lo = stats[p.pre]
            mean = s1 / n
            std = (s2 / n - mean.square()).clamp_min(0).sqrt()
            c = torch.minimum(mean - 3 * std, lo).clamp_min(0.0)
            if not bool((c > 0).any()):
                continue
            first, sec = p.first, p.seconds[0]
            assert first.bias_index is not None
            b1 = graph.initializers[first.node.inputs[first.bias_index]]
            set_input(graph, first.node, first.bias_index, (b1.double() - c.reshape(b1.shape)).to(b1.dtype))
            w2 = graph.initializers[sec.weight].double()
            if sec.op_type == "Conv":
                shift = w2.reshape(w2.shape[0], -1) @ c
            else:
                shift = (w2 @ c) if sec.node.attrs.get("transB", 0) else (c @ w2)
                shift = shift * float(sec.node.attrs.get("alpha", 1.0)) / float(sec.node.attrs.get("beta", 1.0))
            if sec.bias_index is None:  # a Conv without bias: give it one
                name = graph.fresh_name(f"{sec.node.name}_bias")
                graph.initializers[name] = shift.float()
                while len(sec.node.inputs) < 3:
                    sec.node.inputs.append("")
                sec.node.inputs[2] = name
                pairs[i] = Pair(first, [LinearOp(sec.node, sec.act_axis, 2, sec.groups)], p.tensor, p.path, p.pre)
            else:
                b2 = graph.initializers[sec.node.inputs[sec.bias_index]]
                if b2.numel() != shift.numel() and b2.numel() != 1:
                    set_input(graph, first.node, first.bias_index, b1)  # undo: a bias of another shape
                    continue
                new = b2.double().reshape(-1) + shift
                set_input(graph, sec.node, sec.bias_index, new.reshape(shift.shape if b2.numel() == 1
                                                                         else b2.shape).to(b2.dtype))
            counts[i] = int((c > 0).sum())
        return counts
