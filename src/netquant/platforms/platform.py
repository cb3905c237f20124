"""A target platform is data plus rules: which ops are quantized, with which specs, how.

A `Platform` says, per op type, what role the op plays (`OpRole`), which of its inputs are
activations, weights (with the per-channel axis) and bias, and whether its output gets its own
quantizer.  The quantizer (netquant.passes.quantizer) turns these rules into one
`TensorQuantConfig` per input and output of every op.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from netquant.core.int_kernels import LayoutKind, PairSumLimit, WeightLayout
from netquant.core.spec import Granularity, QuantSpec, RoundingPolicy
from netquant.errors import ConfigError
from netquant.platforms.targets import CpuTarget, WeightScheme, needs_saturation_free_weights

if TYPE_CHECKING:  # pragma: no cover
    from netquant.graph import Graph, Node
    from netquant.graph.op_config import OpQuantConfig


class OpRole(enum.Enum):
    """What an op does to quantized data."""

    COMPUTE = "compute"  # has weights (Conv, Gemm, MatMul): quantized inputs, weights, bias
    ARITHMETIC = "arithmetic"  # computes new values (Add, Sigmoid, AveragePool): own output scale
    PASS_THROUGH = "pass_through"  # moves / selects values (Reshape, MaxPool): output shares the input scale
    SHARED_SCALE = "shared_scale"  # inputs and output share one scale (Concat on most engines)
    ACTIVATION = "activation"  # clamps (Relu, Clip): quantized only when fused after a compute op


class OutputPolicy(enum.Enum):
    """When a quantized op's output gets its own quantizer."""

    ALWAYS = "always"  # the engine's kernel writes integers (QLinearConv)
    WHEN_CONSUMED = "when_consumed"  # only if a consumer quantizes that tensor (else float output)
    NEVER = "never"  # output stays float (weight-only / input-only schemes)


class Validation(enum.Enum):
    """What an exported file is checked against before it is written."""

    ONNXRUNTIME = "onnxruntime"  # the engine itself: onnxruntime's optimized graph (fused int8 kernels), this CPU
    OPENVINO = "openvino"  # the engine itself: OpenVINO's CPU plugin (compiled, run, runtime layer precisions), this CPU
    QDQ_REFERENCE = "qdq_reference"  # engines not runnable here: Q/DQ as defined (onnxruntime, optimizations off)


class ExportFormat(enum.Enum):
    """How netquant.export writes the model for this platform."""

    ONNX_QDQ = "onnx_qdq"  # QuantizeLinear / DequantizeLinear pairs (ONNX Runtime, TensorRT, OpenVINO)
    ONNX_QDQ_FP8 = "onnx_qdq_fp8"  # QDQ with float8e4m3fn (opset 19+)


# weight axis: an int (may be negative: counted from the weight's last dim) or a function of the node
AxisRule = int | Callable[["Node"], int]


@dataclass(frozen=True)
class OpRule:
    """How one op type is quantized on a platform.

    activation_inputs: indices of inputs quantized as activations (None = all inputs).
    weight_input / weight_axis: the input holding weights and its per-channel axis.
    bias_input: the input holding a bias (int32, scale = input scale x weight scale).
    requires_quantized_input: quantize only when every activation input is already quantized
        upstream (the engine then runs the op on integers without an extra Quantize).
    requires_weight: quantize only when weight_input is a constant (MatMul with a weight matrix).
    domain: the op's domain when it is not ai.onnx ('com.microsoft'); the rule applies to that domain's op only.
    """

    op_type: str
    role: OpRole
    activation_inputs: tuple[int, ...] | None = (0,)
    weight_input: int | None = None
    weight_axis: AxisRule = 0
    bias_input: int | None = None
    output: OutputPolicy = OutputPolicy.ALWAYS
    requires_quantized_input: bool = False
    requires_weight: bool = False
    # per-node refinement: when it returns True for (node, weight), the op also requires quantized input
    requires_quantized_input_if: Callable[[Node, torch.Tensor | None], bool] | None = None
    domain: str = ""  # the op's domain when not ai.onnx (com.microsoft Attention); other domains' ops do not match

    def needs_quantized_input(self, node: Node, weight: torch.Tensor | None) -> bool:
        if self.requires_quantized_input:
            return True
        return bool(self.requires_quantized_input_if is not None and self.requires_quantized_input_if(node, weight))

    def with_(self, **changes: Any) -> OpRule:
        return replace(self, **changes)

    def axis_for(self, node: Node, weight_rank: int) -> int:
        """The non-negative per-channel axis of this op's weight."""
        axis = self.weight_axis(node) if callable(self.weight_axis) else self.weight_axis
        return axis + weight_rank if axis < 0 else axis


# ---- standard op semantics, shared by the built-in platforms -----------------------------------

def is_depthwise(node: Node, weight: torch.Tensor | None) -> bool:
    """A grouped Conv with one input channel per group (depthwise): memory-bound, little int8 gain."""
    return (node.op_type == "Conv" and weight is not None and int(node.attrs.get("group", 1)) > 1
            and weight.dim() >= 2 and weight.shape[1] == 1)


def macs_per_pixel(weight: torch.Tensor | None) -> int:
    """Multiply-adds per output pixel of a Conv: C_out * C_in/group * kernel size (= weight.numel())."""
    return 0 if weight is None else weight.numel()


def depthwise_or_small(min_macs: int) -> Callable[[Node, torch.Tensor | None], bool]:
    """True for depthwise convs and convs under `min_macs` multiply-adds per pixel: on a CPU engine their
    int8 kernels are no faster than float once the extra Quantize / Dequantize / layout passes are paid."""

    def check(node: Node, weight: torch.Tensor | None) -> bool:
        return is_depthwise(node, weight) or macs_per_pixel(weight) < min_macs

    check.__name__ = f"depthwise_or_under_{min_macs}_macs"
    return check


def _gemm_axis(node: Node) -> int:
    """Gemm B is (K, N) -> output channels on axis 1; with transB=1 it is (N, K) -> axis 0."""
    return 0 if int(node.attrs.get("transB", 0)) else 1


COMPUTE_RULES: dict[str, OpRule] = {
    "Conv": OpRule("Conv", OpRole.COMPUTE, (0,), weight_input=1, weight_axis=0, bias_input=2),
    "ConvTranspose": OpRule("ConvTranspose", OpRole.COMPUTE, (0,), weight_input=1, weight_axis=1,
                            bias_input=2),
    "Gemm": OpRule("Gemm", OpRole.COMPUTE, (0,), weight_input=1, weight_axis=_gemm_axis, bias_input=2),
    "MatMul": OpRule("MatMul", OpRole.COMPUTE, (0, 1), weight_input=1, weight_axis=-1),
}

ARITHMETIC_OPS = ("Add", "Sub", "Mul", "Sigmoid", "Tanh", "HardSigmoid", "HardSwish", "LeakyRelu",
                  "Softmax", "AveragePool", "GlobalAveragePool", "ReduceMean", "Gelu", "Erf", "PRelu")
PASS_THROUGH_OPS = ("Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "MaxPool",
                    "GlobalMaxPool", "Slice", "Gather", "Expand", "Tile", "Resize", "Pad",
                    "DepthToSpace", "SpaceToDepth", "Identity", "Split")
SHARED_SCALE_OPS = ("Concat",)
ACTIVATION_OPS = ("Relu", "Clip")
# binary element-wise ops quantize both inputs
_TWO_INPUT_OPS = ("Add", "Sub", "Mul", "PRelu")


def standard_rule(op_type: str) -> OpRule:
    """The usual rule for op_type (raises ConfigError for op types without a known meaning)."""
    if op_type in COMPUTE_RULES:
        return COMPUTE_RULES[op_type]
    if op_type in ARITHMETIC_OPS:
        inputs = (0, 1) if op_type in _TWO_INPUT_OPS else (0,)
        return OpRule(op_type, OpRole.ARITHMETIC, inputs)
    if op_type in PASS_THROUGH_OPS:
        return OpRule(op_type, OpRole.PASS_THROUGH, (0,))
    if op_type in SHARED_SCALE_OPS:
        return OpRule(op_type, OpRole.SHARED_SCALE, None)
    if op_type in ACTIVATION_OPS:
        return OpRule(op_type, OpRole.ACTIVATION, (0,))
    raise ConfigError(
        f"no standard quantization rule for op type '{op_type}'; pass an OpRule(op_type, role, ...) "
        f"in Platform.create(rules=[...]) instead. Known op types: "
        f"{', '.join(sorted(known_op_types()))}")


def known_op_types() -> list[str]:
    return sorted({*COMPUTE_RULES, *ARITHMETIC_OPS, *PASS_THROUGH_OPS, *SHARED_SCALE_OPS, *ACTIVATION_OPS})


# hook: adjust the configs of one op after the quantizer built them (e.g. force a bit width)
OpHook = Callable[["OpQuantConfig", "Graph"], None]


@dataclass(frozen=True)
class WiderFormat:
    """The wider integer format the engine also runs (mixed precision): where a region of the platform's own format
    costs too much accuracy, placement runs it in this one before it falls back to float.

    activation: the activation spec of widened regions (e.g. uint16 affine: QNN HTP's A16W8).
    weight: their weight spec (None: the platform's; a per-channel spec gets each op's channel axis).
    label: how reports and placement files name the format ("uint16 activations", "int8 (W8A8)").
    """

    activation: QuantSpec
    weight: QuantSpec | None = None
    label: str = ""

    def __post_init__(self) -> None:
        if self.activation.is_float or (self.weight is not None and self.weight.is_float):
            raise ConfigError("a WiderFormat is an integer format (float fallback is placement's last step)")
        if not self.label:
            object.__setattr__(self, "label", f"{self.activation.describe().split(',')[0]} activations")


@dataclass(frozen=True)
class Platform:
    """A target engine's quantization scheme.

    activation / weight / bias: the specs; the weight spec's axis is replaced per op by the rule's
        weight_axis when it is per-channel.  bias=None leaves biases in float.
    rules: op type -> OpRule for every op type this platform quantizes.
    fusions: op-type chains the engine fuses into one kernel; intermediate tensors are not
        quantized (their configs become OVERLAPPED by the chain's last output).
    activation_observer / weight_observer: names in netquant.calib's observer registry.
    op_hook: optional function(op_config, graph) adjusting one op's configs.
    cpu_target: for engines running u8 x s8 CPU kernels (onnxruntime, OpenVINO): the CPUs the file is for
        (None: the engine's arithmetic does not depend on the CPU). `for_cpu` applies it.
    weight_scheme: how int8-kernel weights are stored (None until `for_cpu` picks one for cpu_target).
    safe_weight_scheme: the saturation-free scheme this engine uses where a target needs one.
    bias_correction: subtract E[op(x, W_q - W)] from the biases after calibration (passes.bias_correction).
    """

    name: str
    activation: QuantSpec
    weight: QuantSpec
    bias: QuantSpec | None = None
    rules: Mapping[str, OpRule] = field(default_factory=dict)
    fusions: tuple[tuple[str, ...], ...] = ()
    activation_observer: str = "minmax"
    weight_observer: str = "minmax"
    observer_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    min_opset: int = 13
    description: str = ""
    op_hook: OpHook | None = None
    cpu_target: CpuTarget | None = None
    weight_scheme: WeightScheme | None = None
    safe_weight_scheme: WeightScheme = WeightScheme.INT7
    knows_weight_packing: bool = False  # the engine's u8 x s8 K order is known (weight_layout): int8-pairs possible
    validation: Validation = Validation.QDQ_REFERENCE
    # fold the mean output shift of weight quantization into the biases (netquant.passes.bias_correction)
    bias_correction: bool = False
    # embedding tables (Gather of a large float initializer) stored int8, one scale per row (passes.embeddings)
    embeddings: bool = False
    # weighted MatMul / Gemm / Attention inputs get the clipped range that lowers the op's output error
    # (passes.matmul_ranges)
    matmul_ranges: bool = False
    aliases: tuple[str, ...] = ()  # short names get_platform and the CLI also accept ("trt", "ort", ...)
    # the wider integer format placement runs too-lossy regions in before float (None: INT8-or-float placement)
    wider: WiderFormat | None = None
    # the engine that runs this platform's files ("" : named after `validation`) and the files it runs (-o suffixes;
    # shown by `netquant platforms`)
    engine: str = ""
    files: tuple[str, ...] = (".onnx",)

    @property
    def engine_name(self) -> str:
        """The engine in words: `engine`, else what checks its ONNX files (validation_engine)."""
        return self.engine or self.validation_engine

    @property
    def validation_engine(self) -> str:
        """What checks this platform's ONNX files here: onnxruntime, OpenVINO, or the Q/DQ reference (the engine
        itself does not run here: TensorRT, QNN, ...)."""
        return {Validation.ONNXRUNTIME: "onnxruntime", Validation.OPENVINO: "OpenVINO"}.get(
            self.validation, "Q/DQ reference")

    @property
    def export_format(self) -> ExportFormat:
        """How netquant.export writes this platform's model: FP8 QDQ when a spec is a float format, else QDQ."""
        specs = (self.activation, self.weight, self.bias)
        return ExportFormat.ONNX_QDQ_FP8 if any(s is not None and s.is_float for s in specs) else ExportFormat.ONNX_QDQ

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ConfigError("a platform needs a non-empty name")
        for key, rule in self.rules.items():
            if key != rule.op_type:
                raise ConfigError(f"platform '{self.name}': rule for '{key}' describes op type "
                                  f"'{rule.op_type}'")
        if self.weight.granularity is Granularity.PER_GROUP and self.weight.group_size is None:
            raise ConfigError(f"platform '{self.name}': per-group weight spec needs group_size")

    # ---- building ------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        name: str,
        quantizable: Iterable[str] = ("Conv", "Gemm", "MatMul"),
        *,
        activation: QuantSpec | None = None,
        weight: QuantSpec | None = None,
        bias: QuantSpec | None | bool = True,
        rounding: RoundingPolicy | None = None,
        rules: Iterable[OpRule] = (),
        fusions: Iterable[Iterable[str]] = (("Conv", "Relu"), ("Conv", "Clip"), ("Gemm", "Relu")),
        activation_observer: str = "minmax",
        weight_observer: str = "minmax",
        op_hook: OpHook | None = None,
        description: str = "",
        **kw: Any,
    ) -> Platform:
        """A platform from a list of op types (standard rules) plus explicit rules.

        Defaults: int8 symmetric activations, int8 symmetric per-channel weights, int32 bias;
        `rounding` is applied to every spec.
        """
        table: dict[str, OpRule] = {t: standard_rule(t) for t in quantizable}
        for r in rules:
            table[r.op_type] = r
        act = activation or QuantSpec.int8()
        wgt = weight or QuantSpec.int8_per_channel(axis=0)
        bias_spec = int32_bias_spec() if bias is True else (None if bias is False else bias)
        if rounding is not None:
            act, wgt = act.with_(rounding=rounding), wgt.with_(rounding=rounding)
            bias_spec = bias_spec.with_(rounding=rounding) if bias_spec is not None else None
        return cls(name=name, activation=act, weight=wgt, bias=bias_spec, rules=table,
                   fusions=tuple(tuple(f) for f in fusions), activation_observer=activation_observer,
                   weight_observer=weight_observer, op_hook=op_hook, description=description, **kw)

    def with_(self, **changes: Any) -> Platform:
        """A copy with some fields changed."""
        return replace(self, **changes)

    def for_cpu(self, target: CpuTarget | str | None = None, scheme: WeightScheme | str | None = None) -> Platform:
        """This platform for files that run on `target` CPUs, weights stored as `scheme`.

        scheme None: full-range int8 where every CPU of the target accumulates exactly, else
        safe_weight_scheme. Platforms whose engine is not a CPU (cpu_target None) take no target.
        """
        if self.cpu_target is None:
            if target is not None and CpuTarget.parse(target) is not CpuTarget.ANY or scheme is not None:
                raise ConfigError(f"platform '{self.name}' does not run on CPU int8 kernels: it takes no CPU target "
                                  "or weight scheme (those apply to onnxruntime_int8 and openvino_int8)")
            return self
        cpu = CpuTarget.parse(target) if target is not None else self.cpu_target
        if scheme is not None:
            chosen = WeightScheme.parse(scheme)
        else:
            chosen = self.safe_weight_scheme if needs_saturation_free_weights(cpu) else WeightScheme.INT8
        if chosen is WeightScheme.INT8_PAIR_LIMITED and not self.knows_weight_packing:
            raise ConfigError(f"platform '{self.name}': weight scheme '{chosen.value}' needs the engine's weight "
                              "packing order, known for onnxruntime_int8 only; use 'int7' or 'uint8'")
        weight, hook = self.weight, self.op_hook
        if chosen is WeightScheme.INT7:
            weight = weight.with_(quant_min=-64, quant_max=64, narrow_range=False)
        elif chosen is WeightScheme.UINT8:
            weight = weight.with_(signed=False, symmetric=True, narrow_range=False)
        elif chosen is WeightScheme.INT8_PAIR_LIMITED:
            hook = _chain_hooks(self.op_hook, limit_weight_pairs)
        return replace(self, cpu_target=cpu, weight_scheme=chosen, weight=weight, op_hook=hook)

    def widened(self) -> Platform:
        """This platform with its wider format as its own (every region wide): what placement calibrates the wide
        regions with. ConfigError where the platform has none."""
        if self.wider is None:
            raise ConfigError(f"platform '{self.name}' has no wider format (Platform.wider)")
        return replace(self, activation=self.wider.activation, weight=self.wider.weight or self.weight, wider=None)

    # ---- queries -------------------------------------------------------------------------
    @property
    def quantizable_op_types(self) -> list[str]:
        return sorted(self.rules)

    @property
    def rounding(self) -> RoundingPolicy:
        return self.activation.rounding

    def rule(self, op_type: str) -> OpRule | None:
        return self.rules.get(op_type)

    def weight_spec_for(self, node: Node, rule: OpRule, weight_rank: int) -> QuantSpec:
        """The weight spec with this op's per-channel axis (per-tensor for rank-0/1 weights)."""
        spec = self.weight
        if spec.granularity is Granularity.PER_TENSOR:
            return spec
        if weight_rank < 2:
            return spec.with_(granularity=Granularity.PER_TENSOR, axis=None, group_size=None)
        axis = rule.axis_for(node, weight_rank)
        if spec.granularity is Granularity.PER_GROUP:
            # groups run along the reduction dim; the other dim keeps its own scales
            in_axis = 1 - axis if weight_rank == 2 else axis
            return spec.with_(axis=in_axis)
        return spec.with_(axis=axis)

    def format_label(self) -> str:
        """How summaries name the platform's own quantized format: 'INT8' for int8 weights and activations, else
        e.g. 'int4 (W4A4)', 'fp8 (W8A8)', 'W4A8'."""
        w, a = self.weight, self.activation
        kind = "fp" if w.is_float else "int"
        if w.bits == a.bits and w.is_float == a.is_float:
            return "INT8" if (kind, w.bits) == ("int", 8) else f"{kind}{w.bits} (W{w.bits}A{a.bits})"
        return f"W{w.bits}A{a.bits}"

    def scheme(self) -> str:
        """One line describing the scheme (for `netquant platforms`)."""
        bias = self.bias.describe() if self.bias is not None else "float"
        cpu = (f"; CPU target {self.cpu_target.value}, weights {self.weight_scheme.value if self.weight_scheme else 'auto'}"
               if self.cpu_target is not None else "")
        wider = f"; wider fallback {self.wider.label}" if self.wider is not None else ""
        return (f"act {self.activation.describe()} [{self.activation_observer}]; "
                f"weight {self.weight.describe()} [{self.weight_observer}]; bias {bias}{cpu}{wider}")


def _chain_hooks(first: OpHook | None, second: OpHook) -> OpHook:
    if first is None:
        return second

    def both(oc: OpQuantConfig, graph: Graph) -> None:
        first(oc, graph)
        second(oc, graph)

    return both


def weight_layout(node: Node, weight: torch.Tensor | None) -> WeightLayout | None:
    """The K order onnxruntime's u8 x s8 kernel walks this op's weight in; None where its kernel is exact
    (depthwise convolutions) or the op has no int8 kernel."""
    if node.op_type == "Conv":
        if weight is None or (weight.shape[1] == 1 and weight.shape[0] == int(node.attrs.get("group", 1))):
            return None
        return WeightLayout(LayoutKind.CONV_NHWC)
    if node.op_type in ("MatMul", "Attention"):  # com.microsoft Attention -> QAttention: input [B, S, K] @ W [K, 3H]
        return WeightLayout(LayoutKind.ROWS)
    if node.op_type == "Gemm":
        return WeightLayout(LayoutKind.COLS if int(node.attrs.get("transB", 0)) else LayoutKind.ROWS)
    return None


def limit_weight_pairs(oc: OpQuantConfig, graph: Graph) -> None:
    """Op hook: int8 weights of u8-activation ops keep every same-sign pair of the kernel's K order within
    |q0| + |q1| <= 128, so onnxruntime's int16 pair sums (x86 without VNNI) never saturate."""
    from netquant.graph.op_config import TensorRole

    w_cfg = oc.weight_config()
    a_idx = oc.input_index(TensorRole.ACTIVATION)
    a_cfg = oc.inputs[a_idx] if a_idx is not None else None
    if w_cfg is None or a_cfg is None or w_cfg.spec.is_float or a_cfg.spec.is_float:
        return
    if not (w_cfg.spec.bits == 8 and w_cfg.spec.signed and a_cfg.spec.bits == 8 and not a_cfg.spec.signed):
        return
    w_idx = oc.input_index(TensorRole.WEIGHT)
    weight = graph.initializers.get(oc.op.inputs[w_idx]) if w_idx is not None else None
    layout = weight_layout(oc.op, weight)
    if layout is not None:
        w_cfg.pair_limit = PairSumLimit(layout)


def int32_bias_spec(rounding: RoundingPolicy = RoundingPolicy.ROUND_HALF_EVEN) -> QuantSpec:
    """Bias: int32 symmetric, scale = input scale x weight scale (set by the bias pass)."""
    return QuantSpec(bits=32, signed=True, symmetric=True, rounding=rounding)
