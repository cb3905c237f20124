"""The quantized graph: an FP32 graph plus one quantization config per op input and output.

Placement semantics (what the executor's fake quantization and netquant.export both follow):

- ACTIVATED / PASSIVE / BAKED with params: the tensor is quantized *at this place*
  (an output config: right after the producing op, seen by every consumer; an input config:
  on the edge into this op only).
- OVERLAPPED: represented by its `dominated_by` config at the same tensor: nothing extra here.
  Used for a consumer input whose producer already quantizes the tensor, and for fusions
  (Conv output and Relu input OVERLAPPED by the Relu output: one quantizer after the Relu).
- A config may share params with another while still emitting (state ACTIVATED / PASSIVE,
  dominated_by set): pass-through outputs (Reshape, MaxPool) and shared-scale groups (Concat).
- FP32 / SOI: float, nothing.  None: never quantized (non-float or omitted inputs).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from netquant.core.int_kernels import Accumulation, quantize_limited
from netquant.core.ops import dequantize, fake_quantize
from netquant.core.tensor_config import EMITTING_STATES as EMITTING
from netquant.core.tensor_config import TensorQuantConfig
from netquant.graph import Executor, Graph, Node
from netquant.graph.op_config import OpQuantConfig
from netquant.platforms.platform import Platform

if TYPE_CHECKING:
    from netquant.passes.bias import BiasScaleAdjustment


def emits(cfg: TensorQuantConfig | None) -> bool:
    """True if this config quantizes its tensor at its own place (see module docstring)."""
    return cfg is not None and cfg.state in EMITTING and cfg.effective_params is not None


def fake_quant(x: torch.Tensor, cfg: TensorQuantConfig) -> torch.Tensor:
    """x' = dequantize(quantize(x)) with the config's effective params (and its pair limit, if any)."""
    params = cfg.effective_params
    assert params is not None
    scale, zp = params.scale.to(x.device), params.zero_point.to(x.device)
    limit = cfg.effective_pair_limit
    if limit is not None:
        codes = constant_codes(x, cfg) if x.device.type == "cpu" else \
            quantize_limited(x.detach(), scale, zp, cfg.root.spec, limit)
        return dequantize(codes, scale, zp, cfg.root.spec).to(x.dtype)
    return fake_quantize(x, scale, zp, cfg.root.spec)


@dataclass(frozen=True)
class BiasCorrection:
    """One bias rewritten by bias correction (passes.bias_correction): the FP32 value and the shift subtracted."""

    op: str  # the op whose weight quantization the shift corrects
    consumer: str  # the op reading the bias (the op itself, or the Add after a MatMul)
    input_index: int
    original: torch.Tensor
    delta: torch.Tensor
    corrected: torch.Tensor  # the value the graph holds while the op's weights are quantized


@dataclass(frozen=True)
class RoundedWeight:
    """A weight re-rounded by a repair pass (passes.adaround): `rounded` holds the chosen integer codes times the
    scale of `config` (so quantizing it with that config gives those codes back). The graph holds `rounded` while
    op `op` quantizes its weight with `config` and `original` otherwise (FP32 runs, regions kept float or widened).
    correct_bias: bias correction (passes.bias_correction) corrects the mean output shift of these codes; False for
    codes learned on the quantized model's inputs (block reconstruction, asymmetric AdaRound): they already cancel
    the mean shift, upstream errors included, and correcting it again would undo that."""

    op: str
    input_index: int
    config: TensorQuantConfig
    original: torch.Tensor
    rounded: torch.Tensor
    correct_bias: bool = True

    def active(self, qgraph: QuantizedGraph) -> bool:
        """True while the op quantizes this weight with `config` (the one the codes were chosen for)."""
        oc = qgraph.op_configs.get(self.op)
        cfg = oc.inputs[self.input_index] if oc is not None and self.input_index < len(oc.inputs) else None
        return cfg is not None and cfg.root is self.config.root and emits(cfg)


@dataclass(frozen=True)
class RepairRecord:
    """What one repair pass changed at one place (passes.smoothquant, passes.equalization, passes.adaround):
    `repair` the pass name, `ops` the ops whose weights (or norm parameters) changed, `values` its numbers
    (strength, error before / after, ...). Written to the quant-params JSON, floats to 6 significant digits (their
    last bits follow the thread count of the reductions that measured them; the file's bytes do not)."""

    repair: str
    ops: tuple[str, ...]
    values: tuple[tuple[str, float | int | str], ...] = ()

    def as_dict(self) -> dict[str, Any]:
        values = {k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in self.values}
        return {"repair": self.repair, "ops": list(self.ops), **values}


_CODES: weakref.WeakKeyDictionary[TensorQuantConfig, tuple[Any, ...]] = weakref.WeakKeyDictionary()


def constant_codes(x: torch.Tensor, cfg: TensorQuantConfig) -> torch.Tensor:
    """quantize_limited(x, cfg's effective params, spec, pair limit) for a constant x (a weight), memoised per config
    while x and the params are the same tensor objects, unmodified (torch's version counters): the executors, the
    saturation checks and every export of a model share one computation. Do not modify the result."""
    params = cfg.effective_params
    assert params is not None
    spec, limit = cfg.root.spec, cfg.effective_pair_limit
    tensors = (x, params.scale, params.zero_point)
    versions = tuple(t._version for t in tensors)
    hit = _CODES.get(cfg)
    if hit is not None and all(a is b for a, b in zip(hit[0], tensors)) and hit[1:4] == (versions, spec, limit):
        return hit[4]
    codes = quantize_limited(x.detach(), params.scale, params.zero_point, spec, limit)
    _CODES[cfg] = (tensors, versions, spec, limit, codes)  # the tensors held: their ids cannot be reused
    return codes


@dataclass
class CleanupCounts:
    """What graph clean-up did: node counts before / after and each exact simplification's rewrite count."""

    nodes_before: int = 0
    nodes_after: int = 0
    simplified: dict[str, int] = field(default_factory=dict)


@dataclass
class CalibrationCounts:
    """What calibration observed: activation tensors observed and those given a flat lower bound; how it ran:
    executor runs, samples per stacked run (1: batches as given) and why it did not stack ('' when it did); the
    engine of the FP32 statistics (passes.calib_ort: 'executor' or 'onnxruntime'), why not onnxruntime ('' when it
    was), onnxruntime runs and executor re-runs for range ends onnxruntime left undecided."""

    observed_tensors: int = 0
    flat_bounds: int = 0
    executor_runs: int = 0
    stack_samples: int = 1
    stack_blocker: str = ""
    engine: str = "executor"
    engine_note: str = ""
    ort_runs: int = 0
    exact_reruns: int = 0
    sample_workers: int = 1  # threads the later batches ran on, one sample each (passes.calib_pool; 1: none)


@dataclass(frozen=True)
class WholeModelTiming:
    """Median wall-clock ms of one run of the user's FP32 model and of the all-INT8 file in onnxruntime, measured by
    placement (api.placement's whole-model check: interleaved rounds, `threads` intra-op threads) on feeds of
    `shapes`; `state`: the quant state (export.onnx_qdq.quant_state) of the file it timed. Export's FP32-vs-INT8
    comparison reports it instead of timing the same two models again (export.fidelity)."""

    fp32_ms: float
    int8_ms: float
    shapes: dict[str, tuple[int, ...]]
    threads: int
    state: tuple[Any, ...]


@dataclass(frozen=True)
class FP32Session:
    """Placement's onnxruntime session of the user's FP32 model `model` (the object QuantizedGraph.fp32_source holds),
    `threads` intra-op threads: export.fidelity's FP32 reference reuses it where it would build the same session."""

    model: Any
    threads: int
    session: Any


@dataclass(frozen=True)
class EngineRun:
    """The outputs (in the session's output order) of one onnxruntime run of `model` (the ModelProto object itself, held
    here) on `feeds`, in a session of `threads` intra-op threads with every graph optimization: placement's warm-up run
    of a file it times. Export validation takes them for a batch equal to `feeds` where it runs that very model object
    in a session of the same threads (the same bytes, optimizations and threads give onnxruntime's same outputs)."""

    model: Any
    feeds: dict[str, Any]
    threads: int
    outputs: list[Any]

    def matches(self, model: Any, feeds: Mapping[str, Any], threads: int | None) -> bool:
        import numpy as np

        return (self.model is model and self.threads == threads and feeds.keys() == self.feeds.keys()
                and all(np.array_equal(np.asarray(feeds[k]), self.feeds[k]) for k in feeds))


LOSS_NORMALIZERS = ("Softmax", "LogSoftmax", "Sigmoid")


def compared_tensors(graph: Graph) -> list[str]:
    """The tensors the default loss compares: each graph output, or the input of the Softmax / LogSoftmax / Sigmoid
    that produces it (the logits: the cosine of probabilities depends on the model's confidence, near one-hot rows
    hide a logit error; measured on PP-OCRv4 rec with fp8_e4m3, the probability-cosine budget chose a placement at
    80.5% exact lines (all INT8 91%), the logit-cosine budget one at 95.5% (FP32 97.5%))."""
    producer = {o: n for n in graph.nodes for o in n.outputs if o}
    out = []
    for v in graph.outputs:
        node = producer.get(v.name)
        out.append(node.inputs[0] if node is not None and node.op_type in LOSS_NORMALIZERS and node.inputs else v.name)
    return list(dict.fromkeys(out))


@dataclass(frozen=True)
class ReferenceRun:
    """FP32 executor values of calibration's first batch `inputs` (`tensors`: the graph outputs and compared_tensors),
    run on one torch thread in graph state `state` (passes.calibration.graph_state): the placement budget's FP32
    reference where its data is that very batch (analysis.sensitivity.LossMeter), not computed again there."""

    state: tuple[Any, ...]
    inputs: dict[str, Any]
    tensors: dict[str, torch.Tensor]

    def serves(self, graph: Graph, inputs: Mapping[str, Any], state: tuple[Any, ...]) -> bool:
        """The run is of these inputs (equal tensors) in this graph state, and holds every compared tensor."""
        if state != self.state or inputs.keys() != self.inputs.keys():
            return False
        if not set(compared_tensors(graph)) <= self.tensors.keys():
            return False
        return all(isinstance(inputs[k], torch.Tensor) and isinstance(self.inputs[k], torch.Tensor)
                   and inputs[k].shape == self.inputs[k].shape and torch.equal(inputs[k], self.inputs[k])
                   for k in inputs)


ENGINE_RUNS_KEPT = 4  # placement's latest engine runs kept per quantized graph (the source and the files it timed last)
FAKE_QUANT_RUNS_KEPT = 3  # loss-pass runs kept for export validation (QuantizedGraph.fake_quant_runs)


@dataclass(frozen=True)
class FakeQuantRun:
    """The graph outputs of one fake-quant executor run (exact accumulation) on `inputs`, in the quant state `state`
    (export.onnx_qdq.quant_state): placement's all-INT8 loss run, reused by export validation for the same batch."""

    state: tuple[Any, ...]
    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]


class QuantizedGraph:
    """A cleaned-up FP32 graph with the configs the quantizer built for `platform`."""

    def __init__(self, graph: Graph, platform: Platform, op_configs: Mapping[str, OpQuantConfig],
                 warnings: Sequence[str] = ()) -> None:
        self._graph = graph
        self.platform = platform
        self.op_configs: dict[str, OpQuantConfig] = dict(op_configs)
        self.warnings: list[str] = list(warnings)
        self.sample_inputs: dict[str, torch.Tensor] | None = None  # one calibration batch (export checks)
        self.validation_batches: list[dict[str, torch.Tensor]] = []  # the first calibration batches (export checks)
        # the calibration batches after them, until both hold calibration.VALIDATION_SAMPLES samples: export
        # validation's second look before it refuses a file (export.validate.compare_with_executor)
        self.confirmation_batches: list[dict[str, torch.Tensor]] = []
        # calibration: the FP32 graph outputs of validation_batches and the graph_state they were computed on
        self.validation_fp32: list[dict[str, Any]] = []
        self.validation_fp32_state: tuple[Any, ...] | None = None
        # calibration: FP32 tensors passes.matmul_ranges reads, per validation batch index (1, 2, ...), where
        # calibration ran that batch in the executor with one torch thread (matmul_ranges' own thread count);
        # matmul_ranges empties it
        self.range_tensors: dict[int, dict[str, torch.Tensor]] = {}
        # the user's FP32 model as netquant loaded it (set by the API): export.fidelity's reference in onnxruntime
        self.fp32_source: Any = None
        # facts recorded by the passes (each written by one pass, read by later passes and reports)
        self.shared_scale_groups: list[list[TensorQuantConfig]] = []  # quantizer: configs sharing one scale
        self.fusions: dict[str, str] = {}  # quantizer: fused chain tail op -> head op
        self.cleanup: CleanupCounts = CleanupCounts()  # clean-up pass
        self.calibration: CalibrationCounts = CalibrationCounts()  # calibration pass
        self.aligned_groups: int = 0  # alignment pass: shared-scale groups given one set of params
        self.bias_scale_adjustments: list[BiasScaleAdjustment] = []  # bias pass: weight scales enlarged
        # bias correction pass: bias tensor -> its FP32 value (the graph holds the corrected one; FP32 runs restore it)
        self.bias_corrections: dict[str, BiasCorrection] = {}
        # AdaRound: weight tensor -> its re-rounded value (the graph holds it while its op's weights are quantized)
        self.rounded_weights: dict[str, RoundedWeight] = {}
        self.repairs: list[RepairRecord] = []  # repair passes (pass manager context): what each changed
        # passes.matmul_ranges: the MatMul inputs it clipped (ClippedRange: config, min / max and clipped params);
        # placement keeps them only where the budget's loss is lower with them (analysis.placement.ranges)
        self.clipped_ranges: list[Any] = []
        self.timings: dict[str, float] = {}  # pass name -> wall seconds (the pass manager)
        # placement: MatMul ops whose activation input is quantized at run time in the export (export.dynamic;
        # the executor's fake quantization keeps their calibrated static params)
        self.dynamic_ops: set[str] = set()
        # export.attention.AttentionRewrite measured by analysis.attention (None: the platform's rules alone)
        self.attention_rewrite: Any = None
        self.whole_model_timing: WholeModelTiming | None = None  # placement's FP32 / all-INT8 timing (api.quantize)
        # the input shapes placement timed on (its first calibration sample; api.quantize): export.fidelity times
        # the exported file on the same cut of the first validation batch
        self.timed_shapes: dict[str, tuple[int, ...]] | None = None
        self.fp32_session: FP32Session | None = None  # placement's session of the source (export.fidelity reuses it)
        # analysis.sensitivity's latest loss passes' runs on the first batch, each under its quant state (the all-INT8
        # model, a model with regions float), at most FAKE_QUANT_RUNS_KEPT, latest last (export.validate)
        self.fake_quant_runs: list[FakeQuantRun] = []
        self.reference_run: ReferenceRun | None = None  # calibration's first batch in FP32 (the budget's reference)
        self.engine_runs: list[EngineRun] = []  # placement's warm-up runs in onnxruntime (export validation reuses)

    @property
    def graph(self) -> Graph:
        """The graph, its biases in step with the configs: a bias rewritten by bias correction holds the corrected
        value while its op's weights are quantized and the FP32 value once they are not (e.g. a region placement
        keeps in float), so every executor and export reads the bias that belongs to the weights they use."""
        for name, bc in self.bias_corrections.items():
            oc = self.op_configs.get(bc.op)
            value = bc.corrected if oc is not None and emits(oc.weight_config()) else bc.original
            if self._graph.initializers.get(name) is not value:
                self._graph.initializers[name] = value
        for name, rw in self.rounded_weights.items():
            value = rw.rounded if rw.active(self) else rw.original
            if self._graph.initializers.get(name) is not value:
                self._graph.initializers[name] = value
        return self._graph

    @graph.setter
    def graph(self, graph: Graph) -> None:
        self._graph = graph

    # ---- queries ---------------------------------------------------------------------------
    def configs(self) -> Iterator[TensorQuantConfig]:
        """Every config of every op, in graph order (a shared config may appear once per place)."""
        for node in self.graph.nodes:
            oc = self.op_configs.get(node.name)
            if oc is not None:
                yield from oc.configs()

    def quantized_ops(self) -> list[str]:
        """Names of the ops with at least one quantized input or output, in graph order."""
        return [n.name for n in self.graph.nodes
                if (oc := self.op_configs.get(n.name)) is not None and oc.is_quantized]

    def output_config(self, tensor: str) -> TensorQuantConfig | None:
        """The config of `tensor` at its producer (None for graph inputs / initializers)."""
        producer = self.graph.producer(tensor)
        if producer is None or producer.name not in self.op_configs:
            return None
        oc = self.op_configs[producer.name]
        return oc.outputs[producer.outputs.index(tensor)]

    # ---- running ---------------------------------------------------------------------------
    def keep_engine_run(self, run: EngineRun) -> None:
        """Record placement's onnxruntime run (the ENGINE_RUNS_KEPT latest are kept)."""
        self.engine_runs = [r for r in self.engine_runs if not (r.model is run.model and r.threads == run.threads)]
        self.engine_runs = [*self.engine_runs, run][-ENGINE_RUNS_KEPT:]

    def engine_outputs(self, model: Any, feeds: Mapping[str, Any], threads: int | None) -> list[Any] | None:
        """The outputs of a kept EngineRun of this very `model` object on `feeds` with `threads` (EngineRun.matches);
        None when there is none."""
        return next((r.outputs for r in self.engine_runs if r.matches(model, feeds, threads)), None)

    def executor(self, fake_quant: bool = True, device: str | torch.device = "cpu",
                 accumulation: Accumulation = Accumulation.EXACT) -> Executor:
        """An Executor over the graph; with fake_quant, every emitting config fake-quantizes its tensor, and
        ops a u8 x s8 CPU kernel runs sum their products as `accumulation` (PAIRWISE_INT16: x86 without VNNI)."""
        ex = Executor(self.graph, device=device)
        if fake_quant:
            self.attach_fake_quant(ex, accumulation)
        elif self.bias_corrections or self.rounded_weights:  # the FP32 model: its own biases and weights
            hooks = FakeQuantHooks(self)
            hooks.plan(on=False)
            hooks.handles = [ex.add_pre_hook(hooks.pre)]
        return ex

    def attach_fake_quant(self, ex: Executor, accumulation: Accumulation = Accumulation.EXACT) -> FakeQuantHooks:
        """Add pre/post hooks applying fake quantization (and the kernel arithmetic), planned from the configs'
        current states; FakeQuantHooks.plan() re-plans them after states change."""
        from netquant.passes.int_emulation import emulator_for

        hooks = FakeQuantHooks(self, emulator_for(self, accumulation))
        hooks.handles = [ex.add_pre_hook(hooks.pre), ex.add_post_hook(hooks.post)]
        return hooks

    def run(self, inputs: Any, fake_quant: bool = True, outputs: Sequence[str] | None = None,
            accumulation: Accumulation = Accumulation.EXACT) -> dict[str, torch.Tensor]:
        """Run the graph (fake-quantized by default) and return the named or graph outputs."""
        with torch.no_grad():
            return self.executor(fake_quant=fake_quant, accumulation=accumulation).run(inputs, outputs=outputs)

    def __repr__(self) -> str:
        return (f"QuantizedGraph({self.graph.name!r}, platform={self.platform.name}, "
                f"{len(self.quantized_ops())}/{len(self.graph.nodes)} ops quantized)")


class FakeQuantHooks:
    """The executor hooks of QuantizedGraph.attach_fake_quant: every emitting config fake-quantizes its tensor
    (weights once per config and weight tensor), and an emulator, if any, applies the kernels' arithmetic."""

    def __init__(self, qgraph: QuantizedGraph, emulator: Any = None) -> None:
        self.qgraph = qgraph
        self.emulator = emulator
        self.handles: list[Any] = []
        self._in: dict[str, list[tuple[int, TensorQuantConfig]]] = {}
        self._out: dict[str, list[tuple[int, TensorQuantConfig]]] = {}
        self._weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._inits = qgraph.graph.initializers
        self.plan()

    def plan(self, on: bool = True) -> None:
        """Which tensors the hooks quantize: those whose configs emit in their current states (on=False: none)."""
        self._in, self._out = {}, {}
        # biases rewritten by bias correction, as the current states want them (whatever the executor's snapshot of
        # the graph holds): FP32 runs (on=False) and ops whose weights are not quantized read the FP32 value
        self._restore: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for bc in self.qgraph.bias_corrections.values():
            oc = self.qgraph.op_configs.get(bc.op)
            corrected = on and oc is not None and emits(oc.weight_config())
            self._restore.setdefault(bc.consumer, []).append((bc.input_index, bc.corrected if corrected else bc.original))
        for rw in self.qgraph.rounded_weights.values():
            rounded = on and rw.active(self.qgraph)
            self._restore.setdefault(rw.op, []).append((rw.input_index, rw.rounded if rounded else rw.original))
        if not on:
            return
        for name, oc in self.qgraph.op_configs.items():
            ins = [(i, c) for i, c in enumerate(oc.inputs) if emits(c)]
            outs = [(i, c) for i, c in enumerate(oc.outputs) if emits(c)]
            if ins:
                self._in[name] = ins
            if outs:
                self._out[name] = outs

    def _apply(self, node: Node, tensors: list[Any], plan: list[tuple[int, TensorQuantConfig]],
               is_input: bool) -> list[Any]:
        out = list(tensors)
        for i, cfg in plan:
            x = out[i] if i < len(out) else None
            if not isinstance(x, torch.Tensor) or not x.is_floating_point():
                continue
            if is_input and not x.requires_grad and node.inputs[i] in self._inits:
                hit = self._weights.get(id(cfg))
                if hit is not None and (hit[0] is x or (hit[0].data_ptr() == x.data_ptr()
                                                        and hit[0].shape == x.shape)):
                    out[i] = hit[1]
                    continue
                fq = fake_quant(x, cfg)
                self._weights[id(cfg)] = (x, fq)
                out[i] = fq
            else:
                out[i] = fake_quant(x, cfg)
        return out

    def pre(self, node: Node, inputs: list[Any]) -> list[Any] | None:
        restore = self._restore.get(node.name)
        if restore:  # the bias value the states want, before it is quantized
            inputs = list(inputs)
            for i, value in restore:
                inputs[i] = value.to(inputs[i].device) if isinstance(inputs[i], torch.Tensor) else value
        plan = self._in.get(node.name)
        out = self._apply(node, inputs, plan, True) if plan else (inputs if restore else None)
        if self.emulator is not None:
            self.emulator.capture(node, out if out is not None else inputs)
        return out

    def post(self, node: Node, outputs: list[Any]) -> list[Any] | None:
        if self.emulator is not None:
            outputs = self.emulator.adjust(node, outputs)
        plan = self._out.get(node.name)
        return self._apply(node, outputs, plan, False) if plan else outputs
