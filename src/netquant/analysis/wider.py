"""Running chosen regions in the platform's wider integer format (Platform.wider: mixed precision).

`wide` is the same model quantized with the platform's wider format everywhere (Platform.widened(), calibrated on
the same data): op for op the same configs, with wide specs and params (and its own bias corrections).  Widening a
region swaps, in place, each config of its ops for the wide graph's config at the same place:
- a swapped-in config that shares (OVERLAPPED) a wide config of an op left narrow quantizes the tensor at its own
  place with those wide params (state ACTIVATED): the region reads its narrow input requantized to the wide format
  (the engine's Convert), and its bias scale is s_in x s_w of that input;
- a config outside the regions that shared a swapped-out narrow config quantizes at its own place with the narrow
  params (ACTIVATED, as analysis.regions.keep_float does): narrow neighbours read the wide output converted back.
So the fake-quant executor and the Q/DQ export (a Q/DQ pair per format where the formats meet) compute the same.
These are the mixed-precision Q/DQ models of onnxruntime's quantizer for QNN (tensor_quant_overrides, ORT PR 19925):
regions of different activation types, converted where they meet by a DQ -> Q sequence (e.g. uint8 to uint16).
`WideEdit.undo` restores everything.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from netquant.analysis.regions import Region, overlap_chain, shares_through
from netquant.core.tensor_config import QuantState, TensorQuantConfig
from netquant.errors import ConfigError
from netquant.passes.quant_graph import QuantizedGraph


@dataclass
class WideEdit:
    """The changes that run some regions wide; `undo()` restores the quantized graph."""

    slots: list[tuple[list[TensorQuantConfig], int, TensorQuantConfig]] = field(default_factory=list)
    configs: list[tuple[TensorQuantConfig, QuantState, TensorQuantConfig | None, Any]] = field(default_factory=list)
    corrections: list[tuple[str, Any]] = field(default_factory=list)
    qgraph: QuantizedGraph | None = None

    def undo(self) -> None:
        for cfg, state, dom, params in reversed(self.configs):
            cfg.state, cfg.dominated_by, cfg.params = state, dom, params
        for lst, i, cfg in reversed(self.slots):
            lst[i] = cfg
        if self.qgraph is not None:
            for name, bc in reversed(self.corrections):
                if bc is None:
                    self.qgraph.bias_corrections.pop(name, None)
                else:
                    self.qgraph.bias_corrections[name] = bc
        self.configs.clear()
        self.slots.clear()
        self.corrections.clear()

    def __enter__(self) -> WideEdit:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()


def check_twin(qgraph: QuantizedGraph, wide: QuantizedGraph) -> None:
    """ConfigError unless `wide` has the same ops with the same config places as `qgraph`."""
    if set(qgraph.op_configs) != set(wide.op_configs):
        odd = sorted(set(qgraph.op_configs) ^ set(wide.op_configs))
        raise ConfigError(f"the wide-format graph of '{qgraph.graph.name}' has other quantized ops ({', '.join(odd[:5])})"
                          "; it must be the same model calibrated with Platform.widened()")
    for name, oc in qgraph.op_configs.items():
        w = wide.op_configs[name]
        if len(oc.inputs) != len(w.inputs) or len(oc.outputs) != len(w.outputs):
            raise ConfigError(f"op '{name}' has other config places in the wide-format graph; it must be the same "
                              "model calibrated with Platform.widened()")


def widen(qgraph: QuantizedGraph, wide: QuantizedGraph, regions: Iterable[Region]) -> WideEdit:
    """Run `regions` of `qgraph` in `wide`'s format (module docstring); returns the edit (a context manager)."""
    edit = WideEdit(qgraph=qgraph)
    ops = [op for r in regions for op in r.ops]
    unknown = sorted(set(ops) - set(qgraph.op_configs))
    if unknown:
        raise ConfigError(f"regions name op(s) not in graph '{qgraph.graph.name}': {', '.join(unknown[:5])}")
    if not ops:
        return edit
    out: set[int] = set()  # narrow configs swapped out
    swapped_in: set[int] = set()
    for name in dict.fromkeys(ops):
        oc, w = qgraph.op_configs[name], wide.op_configs[name]
        for lst, wlst in ((oc.inputs, w.inputs), (oc.outputs, w.outputs)):
            for i, (cfg, wcfg) in enumerate(zip(lst, wlst)):
                if cfg is None or wcfg is None or cfg is wcfg:
                    continue
                if cfg.state in (QuantState.FP32, QuantState.SOI) or wcfg.state in (QuantState.FP32, QuantState.SOI):
                    continue  # kept float by the user (force_fp32) or shape tensors: not this edit's business
                edit.slots.append((lst, i, cfg))
                lst[i] = wcfg
                out.add(id(cfg))
                swapped_in.add(id(wcfg))
    # the biases corrected for the wide weights (passes.bias_correction; the bias may sit on a consumer: MatMul + Add)
    members = set(ops)
    for tensor, bc in wide.bias_corrections.items():
        if bc.op in members:
            edit.corrections.append((tensor, qgraph.bias_corrections.get(tensor)))
            qgraph.bias_corrections[tensor] = bc
    for tensor, bc in list(qgraph.bias_corrections.items()):
        if bc.op in members and tensor not in wide.bias_corrections:
            edit.corrections.append((tensor, bc))
            del qgraph.bias_corrections[tensor]
    # wide configs sharing a wide quantizer no widened op emits: quantize at their own place with its params
    for lst, i, _ in edit.slots:
        cfg = lst[i]
        if cfg.state is QuantState.OVERLAPPED and _leaves(cfg, swapped_in):
            edit.configs.append((cfg, cfg.state, cfg.dominated_by, cfg.params))
            cfg.params = cfg.effective_params
            cfg.dominated_by = None
            cfg.state = QuantState.ACTIVATED
    # narrow configs outside that shared a swapped-out quantizer: their own place, the narrow params
    for oc in qgraph.op_configs.values():
        for cfg in oc.configs():
            if id(cfg) in swapped_in or cfg.state is not QuantState.OVERLAPPED or not shares_through(cfg, out):
                continue
            edit.configs.append((cfg, cfg.state, cfg.dominated_by, cfg.params))
            cfg.state = QuantState.ACTIVATED
    return edit


def _leaves(cfg: TensorQuantConfig, inside: set[int]) -> bool:
    """True if cfg's dominated_by chain reaches its emitting root outside `inside` (a quantizer no widened op runs)."""
    chain = list(overlap_chain(cfg))
    return bool(chain) and chain[-1].state is not QuantState.OVERLAPPED and id(chain[-1]) not in inside
