"""Build a config for every input and output of every op from the platform's rules.

Steps (all decisions are data from `Platform.rules` / `Platform.fusions`):
1. decide which ops are quantized, in topological order (an op whose rule
   `requires_quantized_input` is quantized only when its inputs already are);
2. fusions: in a chain such as Conv -> Relu the intermediate tensor is not quantized; the
   chain's last output is (head output and tail input OVERLAPPED by it);
3. output quantizers per the rule's OutputPolicy (WHEN_CONSUMED: only if a quantized consumer
   reads the tensor);
4. configs: activation inputs OVERLAPPED by a quantized producer, else their own quantizer
   (shared between quantized consumers of the same float tensor); weights with the per-channel
   axis of the op; bias PASSIVE_INIT (int32, derived after calibration); pass-through outputs
   share their input's params; shared-scale ops (Concat) are recorded as groups for alignment;
   user overrides (activation / weight spec, observer) are applied while the configs are built;
5. the platform's op hook, last, on every quantized op: it sees, and may change, the overridden configs.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from netquant.core.spec import Granularity, QuantSpec
from netquant.core.tensor_config import QuantState, TensorQuantConfig
from netquant.errors import UnsupportedOpError
from netquant.graph import Graph, Node
from netquant.graph.op_config import TensorRole
from netquant.passes.overrides import Override, matching
from netquant.passes.quant_graph import OpQuantConfig, QuantizedGraph
from netquant.platforms.platform import OpRole, OpRule, OutputPolicy, Platform

log = logging.getLogger("netquant.quantizer")

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class QuantizerWarning(UserWarning):
    """An op the platform would quantize is left in float (an error with strict=True)."""


@dataclass
class GraphIndex:
    """Producer / consumer maps and constant lookup, built once (Graph's queries are O(nodes))."""

    graph: Graph
    producer: dict[str, Node] = field(default_factory=dict)
    consumers: dict[str, list[Node]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for node in self.graph.nodes:
            for o in node.outputs:
                if o:
                    self.producer[o] = node
            for i in node.inputs:
                if i:
                    self.consumers.setdefault(i, []).append(node)

    def constant(self, name: str) -> torch.Tensor | None:
        """The value of an initializer or a Constant node's output, else None."""
        if name in self.graph.initializers:
            return self.graph.initializers[name]
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant" and not node.inputs:
            value = node.attrs.get("value")
            if isinstance(value, torch.Tensor):
                return value
            for key in ("value_float", "value_floats"):
                if key in node.attrs:
                    return torch.tensor(node.attrs[key], dtype=torch.float32)
        return None

    def dtype(self, name: str) -> torch.dtype | None:
        const = self.constant(name)
        if const is not None:
            return const.dtype
        return self.graph.value(name).dtype

    def is_float(self, name: str) -> bool:
        """True for float tensors; unknown dtypes count as float unless produced by a shape op."""
        dt = self.dtype(name)
        if dt is not None:
            return dt in FLOAT_DTYPES
        prod = self.producer.get(name)
        return prod is None or prod.op_type not in ("Shape", "Size", "NonZero", "ArgMax", "ArgMin")


def _rank(graph: Graph, index: GraphIndex, name: str) -> int:
    const = index.constant(name)
    if const is not None:
        return const.dim()
    shape = graph.value(name).shape
    return len(shape) if shape is not None else 0


class Quantizer:
    """Turns (graph, platform, overrides) into a QuantizedGraph with INITIAL / PASSIVE_INIT configs."""

    def __init__(self, platform: Platform, overrides: Sequence[Override] = (), strict: bool = False) -> None:
        self.platform = platform
        self.overrides = list(overrides)
        self.strict = strict
        self.warnings: list[str] = []

    # ---- helpers --------------------------------------------------------------------------
    def _warn(self, node: Node, why: str) -> None:
        msg = (f"{node.op_type} node '{node.name}' stays FP32 on platform '{self.platform.name}': {why}")
        if self.strict:
            raise UnsupportedOpError(msg + " (strict mode)")
        self.warnings.append(msg)
        warnings.warn(msg, QuantizerWarning, stacklevel=3)

    def _forced_fp32(self, node: Node) -> bool:
        return any(o.fp32 for o in matching(self.overrides, node))

    def _act_inputs(self, node: Node, rule: OpRule) -> list[int]:
        idx = range(len(node.inputs)) if rule.activation_inputs is None else rule.activation_inputs
        return [i for i in idx if i < len(node.inputs) and node.inputs[i]]

    # ---- step 1: which ops --------------------------------------------------------------------
    def _select(self, graph: Graph, index: GraphIndex) -> tuple[dict[str, OpRule], dict[str, int | None]]:
        chosen: dict[str, OpRule] = {}
        weights: dict[str, int | None] = {}
        self.graph_outputs = set(graph.output_names)
        quantized_out: set[str] = set()  # tensors surely quantized at their producer (forward view)
        for node in graph.nodes:
            rule = self.platform.rule(node.op_type)
            if rule is not None and rule.domain and node.domain != rule.domain:
                rule = None  # the rule is for another domain's op of that name (com.microsoft Attention)
            if node.domain not in ("", "ai.onnx") and (rule is None or node.domain != rule.domain):
                if rule is not None:
                    self._warn(node, f"domain '{node.domain}' is not ai.onnx")
                continue
            if rule is None or rule.role is OpRole.ACTIVATION or self._forced_fp32(node):
                self._note_fused_output(node, index, chosen, quantized_out)
                continue
            acts = self._act_inputs(node, rule)
            weight: int | None = None
            if rule.role is OpRole.COMPUTE and rule.weight_input is not None:
                w = rule.weight_input
                has_w = w < len(node.inputs) and index.constant(node.inputs[w]) is not None
                if has_w:
                    weight = w
                    acts = [i for i in acts if i != w]
                elif rule.requires_weight:
                    continue  # e.g. activation x activation MatMul on a platform that only runs weight MatMuls
                elif rule.activation_inputs is not None and w not in rule.activation_inputs:
                    self._warn(node, f"its weight input '{node.inputs[w] if w < len(node.inputs) else ''}' "
                                     "is not a constant (initializer or Constant node)")
                    continue
            if not acts or not all(index.is_float(node.inputs[i]) for i in acts):
                if acts and rule.role is OpRole.COMPUTE:  # integer data movement (shape math) is normal
                    bad = [node.inputs[i] for i in acts if not index.is_float(node.inputs[i])]
                    self._warn(node, f"input(s) {bad} are not float tensors")
                continue
            w_tensor = index.constant(node.inputs[weight]) if weight is not None else None
            if rule.needs_quantized_input(node, w_tensor):
                if not all(node.inputs[i] in quantized_out or index.constant(node.inputs[i]) is not None
                           for i in acts):
                    continue
                if all(index.constant(node.inputs[i]) is not None for i in acts):
                    continue  # constant-only subgraph: nothing to gain
            chosen[node.name] = rule
            weights[node.name] = weight
            if rule.output is OutputPolicy.ALWAYS or rule.role is OpRole.PASS_THROUGH:
                quantized_out.update(o for o in node.outputs if o)
        return chosen, weights

    def _note_fused_output(self, node: Node, index: GraphIndex, chosen: dict[str, OpRule],
                           quantized_out: set[str]) -> None:
        """Forward view of fusions: Conv -> Relu with the Conv's output always quantized quantizes the Relu's."""
        if not node.inputs or self._forced_fp32(node):
            return
        head = index.producer.get(node.inputs[0])
        if head is None or head.name not in chosen or chosen[head.name].output is not OutputPolicy.ALWAYS:
            return
        if (head.op_type, node.op_type) not in {tuple(f[:2]) for f in self.platform.fusions if len(f) == 2}:
            return
        if len(index.consumers.get(head.outputs[0], [])) == 1 and not self.graph_outputs & {head.outputs[0]}:
            quantized_out.update(o for o in node.outputs if o)

    # ---- step 2: fusions ----------------------------------------------------------------------
    def _fusions(self, graph: Graph, index: GraphIndex, chosen: dict[str, OpRule]) -> dict[str, str]:
        """Map tail node name -> head node name for every fused chain (intermediates included)."""
        fused_into: dict[str, str] = {}
        for pattern in self.platform.fusions:
            if len(pattern) < 2:
                continue
            for head in graph.nodes:
                if head.op_type != pattern[0] or head.name not in chosen or head.name in fused_into:
                    continue
                chain = [head]
                cur = head
                for op_type in pattern[1:]:
                    out = cur.outputs[0] if cur.outputs else ""
                    cons = index.consumers.get(out, [])
                    if (len(cons) != 1 or graph.is_graph_output(out) or cons[0].op_type != op_type
                            or self._forced_fp32(cons[0]) or cons[0].name in fused_into):
                        break
                    cur = cons[0]
                    chain.append(cur)
                if len(chain) != len(pattern):
                    continue
                for n in chain[1:]:
                    fused_into[n.name] = head.name
        return fused_into

    # ---- steps 3-5 ----------------------------------------------------------------------------
    def build(self, graph: Graph) -> QuantizedGraph:
        """Steps 1-5 of the module docstring: which ops, fusions, configs, linking, then the platform hook."""
        index = GraphIndex(graph)
        chosen, weights = self._select(graph, index)
        fused_into = self._fusions(graph, index, chosen)
        builder = _ConfigBuilder(self, graph, index, chosen, weights, fused_into)
        op_configs = builder.build()
        qgraph = QuantizedGraph(graph, self.platform, op_configs, self.warnings)
        qgraph.shared_scale_groups = builder.shared_groups
        qgraph.fusions = {t.name: h for h, t in builder.tail_of.items()}
        self._run_op_hook(graph, op_configs)
        return qgraph

    def _run_op_hook(self, graph: Graph, op_configs: dict[str, OpQuantConfig]) -> None:
        """Step 5: the platform's op hook on every quantized op; it runs after the user overrides (applied while
        the configs were built), so it sees, and may change, the overridden specs."""
        hook = self.platform.op_hook
        if hook is None:
            return
        for oc in op_configs.values():
            if oc.is_quantized:
                hook(oc, graph)


class _ConfigBuilder:
    """Steps 3-4 for one graph: a config on every input and output of every op, given the selected ops
    (`chosen`, their weight input in `weights`) and the fused chains (`fused_into`: tail -> head)."""

    def __init__(self, quantizer: Quantizer, graph: Graph, index: GraphIndex, chosen: dict[str, OpRule],
                 weights: dict[str, int | None], fused_into: dict[str, str]) -> None:
        self.q = quantizer
        self.p = quantizer.platform
        self.graph = graph
        self.index = index
        self.chosen = chosen
        self.weights = weights
        self.fused_into = fused_into
        self.tail_of: dict[str, Node] = {}  # chain head -> the node whose output carries the quantizer
        for node in graph.nodes:
            if node.name in fused_into:
                self.tail_of[fused_into[node.name]] = node
        self.op_configs: dict[str, OpQuantConfig] = {}
        self.out_cfg: dict[str, TensorQuantConfig] = {}  # tensor -> config quantizing it at its producer
        self.in_cfg_shared: dict[tuple[str, QuantSpec], TensorQuantConfig] = {}  # float tensor -> consumer config
        self.shared_groups: list[list[TensorQuantConfig]] = []

    def build(self) -> dict[str, OpQuantConfig]:
        """Configs of every op in graph order, then the fused chains and late producers linked."""
        for node in self.graph.nodes:
            rule = self.chosen.get(node.name)
            head_name = self.fused_into.get(node.name)
            if head_name is not None:
                self.op_configs[node.name] = self._fused_tail_op(node, head_name)
            elif rule is not None:
                self.op_configs[node.name] = self._quantized_op(node, rule)
            else:
                self.op_configs[node.name] = OpQuantConfig(node, [self._fp32(i) for i in node.inputs],
                                                           [self._fp32(o) for o in node.outputs])
        self._link_fused_chains()
        self._link_late_producers()
        return self.op_configs

    # ---- single configs ---------------------------------------------------------------------
    def _fp32(self, name: str) -> TensorQuantConfig | None:
        """An FP32 config for a float tensor (None for omitted or non-float tensors)."""
        if not name or not self.index.is_float(name):
            return None
        return TensorQuantConfig(self.p.activation, QuantState.FP32, self.p.activation_observer, name=name)

    def _activation_choice(self, node: Node) -> tuple[list[Override], QuantSpec, str]:
        """The overrides matching `node` and the activation spec and observer they leave (last one wins)."""
        ovs = matching(self.q.overrides, node)
        act_spec = next((o.activation for o in reversed(ovs) if o.activation is not None), self.p.activation)
        observer = next((o.observer for o in reversed(ovs) if o.observer is not None), self.p.activation_observer)
        return ovs, act_spec, observer

    def _activation_input(self, name: str, spec: QuantSpec, observer: str) -> TensorQuantConfig:
        """OVERLAPPED by a quantized producer, else dominated by the first consumer config of the same spec."""
        producer_cfg = self.out_cfg.get(name)
        cfg = TensorQuantConfig(spec, QuantState.INITIAL, observer, name=name)
        if producer_cfg is not None:
            cfg.overlap_with(producer_cfg)
            return cfg
        key = (name, spec)
        first = self.in_cfg_shared.get(key)
        if first is not None:
            cfg.dominated_by = first  # same tensor, same spec: one set of params
        else:
            self.in_cfg_shared[key] = cfg
        return cfg

    def _weight_config(self, node: Node, rule: OpRule, ovs: list[Override], name: str) -> TensorQuantConfig:
        """The platform's weight spec for this op (per-channel axis from the op), or the user's override."""
        rank = _rank(self.graph, self.index, name)
        spec = self.p.weight_spec_for(node, rule, rank)
        w_override = next((o.weight for o in reversed(ovs) if o.weight is not None), None)
        if w_override is not None:
            spec = _with_axis(w_override, spec, rank)
        return TensorQuantConfig(spec, QuantState.INITIAL, self.p.weight_observer, name=name)

    def _bias_config(self, name: str, w_cfg: TensorQuantConfig | None) -> TensorQuantConfig | None:
        """PASSIVE_INIT in the platform's bias spec (per-channel like the weight), else FP32."""
        if self.p.bias is None or not self.index.is_float(name) or w_cfg is None:
            return self._fp32(name)
        b_spec = self.p.bias
        if w_cfg.spec.granularity is Granularity.PER_CHANNEL:
            b_spec = b_spec.with_(granularity=Granularity.PER_CHANNEL, axis=0)
        return TensorQuantConfig(b_spec, QuantState.PASSIVE_INIT, "none", name=name)

    # ---- output policy ----------------------------------------------------------------------
    def _consumes_quantized(self, tensor: str) -> bool:
        """True if a selected op reads `tensor` as an activation input."""
        for c in self.index.consumers.get(tensor, []):
            rule = self.chosen.get(c.name)
            if rule is None:
                continue
            if any(c.inputs[i] == tensor for i in self.q._act_inputs(c, rule) if i != self.weights.get(c.name)):
                return True
        return False

    def _output_quantized(self, node: Node, rule: OpRule, tensor: str) -> bool:
        """Step 3: the rule's OutputPolicy for this output (pass-through outputs always)."""
        if rule.role is OpRole.PASS_THROUGH or rule.output is OutputPolicy.ALWAYS:
            return True
        if rule.output is OutputPolicy.WHEN_CONSUMED:
            return self._consumes_quantized(tensor)
        return False

    # ---- per op -----------------------------------------------------------------------------
    def _fused_tail_op(self, node: Node, head_name: str) -> OpQuantConfig:
        """A fused tail (e.g. Relu after Conv): float, except the chain's last output when the head's is quantized."""
        _, act_spec, observer = self._activation_choice(node)
        head_rule = self.chosen[head_name]
        inputs: list[TensorQuantConfig | None] = [self._fp32(i) for i in node.inputs]
        outputs: list[TensorQuantConfig | None] = [self._fp32(o) for o in node.outputs]
        if node is self.tail_of[head_name] and self._output_quantized(self.graph.node(head_name), head_rule,
                                                                      node.outputs[0]):
            outputs[0] = TensorQuantConfig(act_spec, QuantState.INITIAL, observer, name=node.outputs[0])
            self.out_cfg[node.outputs[0]] = outputs[0]
        return OpQuantConfig(node, inputs, outputs, {})

    def _quantized_op(self, node: Node, rule: OpRule) -> OpQuantConfig:
        """Step 4 for a selected op: input configs by role, output configs, its shared-scale group."""
        ovs, act_spec, observer = self._activation_choice(node)
        w_idx = self.weights.get(node.name)
        acts = [i for i in self.q._act_inputs(node, rule) if i != w_idx]
        inputs, roles = self._input_configs(node, rule, ovs, act_spec, observer, acts, w_idx)
        outputs = self._output_configs(node, rule, act_spec, observer, acts, inputs)
        if rule.role is OpRole.SHARED_SCALE:
            members = [c for i, c in enumerate(inputs) if i in acts and c is not None]
            members += [c for c in outputs if c is not None and c.state is QuantState.INITIAL]
            if len(members) > 1:
                self.shared_groups.append(members)
        return OpQuantConfig(node, inputs, outputs, roles)

    def _input_configs(self, node: Node, rule: OpRule, ovs: list[Override], act_spec: QuantSpec, observer: str,
                       acts: list[int], w_idx: int | None
                       ) -> tuple[list[TensorQuantConfig | None], dict[int, TensorRole]]:
        """Weight, bias, activation (constants: min-max) or FP32 config of each input, with the roles."""
        inputs: list[TensorQuantConfig | None] = []
        roles: dict[int, TensorRole] = {}
        w_cfg: TensorQuantConfig | None = None
        for i, name in enumerate(node.inputs):
            if not name:
                inputs.append(None)
            elif i == w_idx:
                w_cfg = self._weight_config(node, rule, ovs, name)
                inputs.append(w_cfg)
                roles[i] = TensorRole.WEIGHT
            elif i == rule.bias_input and w_idx is not None and self.index.constant(name) is not None:
                inputs.append(self._bias_config(name, w_cfg))
                roles[i] = TensorRole.BIAS
            elif i in acts and self.index.is_float(name):
                if self.index.constant(name) is not None:
                    inputs.append(TensorQuantConfig(act_spec, QuantState.INITIAL, "minmax", name=name))
                else:
                    inputs.append(self._activation_input(name, act_spec, observer))
                roles[i] = TensorRole.ACTIVATION
            else:
                inputs.append(self._fp32(name))
        return inputs, roles

    def _output_configs(self, node: Node, rule: OpRule, act_spec: QuantSpec, observer: str, acts: list[int],
                        inputs: list[TensorQuantConfig | None]) -> list[TensorQuantConfig | None]:
        """Output configs per the OutputPolicy; pass-through outputs share their input's params; a chain head's
        output is a placeholder that _link_fused_chains overlaps with the tail's."""
        outputs: list[TensorQuantConfig | None] = []
        head_tail = self.tail_of.get(node.name)
        for j, name in enumerate(node.outputs):
            if not name or not self.index.is_float(name):
                outputs.append(None)
                continue
            if head_tail is not None and j == 0:
                outputs.append(TensorQuantConfig(act_spec, QuantState.INITIAL, observer, name=name))
                continue  # resolved in _link_fused_chains, once the tail's config exists
            if not self._output_quantized(node, rule, name):
                outputs.append(self._fp32(name))
                continue
            if rule.role is OpRole.PASS_THROUGH:
                src = inputs[acts[0]] if acts else None
                cfg = TensorQuantConfig(act_spec, QuantState.PASSIVE_INIT, "none", name=name)
                if src is not None:
                    cfg.dominated_by = src
            else:
                cfg = TensorQuantConfig(act_spec, QuantState.INITIAL, observer, name=name)
            outputs.append(cfg)
            self.out_cfg[name] = cfg
        return outputs

    # ---- linking ----------------------------------------------------------------------------
    def _link_fused_chains(self) -> None:
        """Fused chains: the head output and the tails' inputs are represented by the chain's last output."""
        p = self.p
        for head_name, tail in self.tail_of.items():
            head_oc = self.op_configs[head_name]
            tail_out = self.op_configs[tail.name].outputs[0]
            if tail_out is None or tail_out.state is QuantState.FP32:
                head_oc.outputs[0] = TensorQuantConfig(p.activation, QuantState.FP32, p.activation_observer,
                                                       name=head_oc.op.outputs[0])
                continue
            head_oc.outputs[0].overlap_with(tail_out)  # type: ignore[union-attr]
            for n in self.graph.nodes:
                if self.fused_into.get(n.name) == head_name:
                    oc = self.op_configs[n.name]
                    data_in = oc.op.inputs[0]
                    oc.inputs[0] = TensorQuantConfig(tail_out.spec, QuantState.INITIAL, "none", name=data_in)
                    oc.inputs[0].overlap_with(tail_out)
                    if n is not tail:
                        oc.outputs[0] = TensorQuantConfig(tail_out.spec, QuantState.INITIAL, "none",
                                                          name=n.outputs[0])
                        oc.outputs[0].overlap_with(tail_out)

    def _link_late_producers(self) -> None:
        """Activation inputs first seen as FP32-produced but quantized later (fusion tails created late) are
        OVERLAPPED by their producer's config; a fused chain's intermediates are consumed by the chain only."""
        for node in self.graph.nodes:
            oc = self.op_configs[node.name]
            if node.name in self.fused_into:
                continue
            for i, cfg in enumerate(oc.inputs):
                name = node.inputs[i] if i < len(node.inputs) else ""
                if cfg is None or not name or oc.roles.get(i) is not TensorRole.ACTIVATION:
                    continue
                producer_cfg = self.out_cfg.get(name)
                if producer_cfg is not None and cfg.state is not QuantState.OVERLAPPED:
                    cfg.dominated_by = None
                    cfg.overlap_with(producer_cfg)


def _with_axis(override: QuantSpec, derived: QuantSpec, rank: int) -> QuantSpec:
    """A user weight spec, given the op's channel axis when it is per-channel without one that fits."""
    if override.granularity is Granularity.PER_TENSOR:
        return override
    if override.axis is not None and -rank <= override.axis < rank:
        return override
    axis = derived.axis if derived.axis is not None else 0
    return override.with_(axis=axis)


def build_quant_graph(graph: Graph, platform: Platform, overrides: Sequence[Override] = (),
                      strict: bool = False) -> QuantizedGraph:
    """Configs for every op of `graph` under `platform` (see module docstring)."""
    return Quantizer(platform, overrides, strict).build(graph)
