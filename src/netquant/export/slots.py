"""Reading a QuantizedGraph's configs the way export needs them (states, roots, tensor edges)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol, TypeAlias

import torch

from netquant.core.spec import Granularity, QuantSpec
from netquant.core.tensor_config import TensorQuantConfig
from netquant.errors import ExportError
from netquant.passes.quant_graph import QuantizedGraph


class HasQuantizedGraph(Protocol):
    """An object holding a QuantizedGraph as `.qgraph` (netquant.api.QuantizedModel)."""

    @property
    def qgraph(self) -> QuantizedGraph: ...


Exportable: TypeAlias = "QuantizedGraph | HasQuantizedGraph"
"""What the exporters accept: a QuantizedModel (from netquant.quantize_onnx) or its QuantizedGraph."""


def unwrap(qmodel: Exportable) -> QuantizedGraph:
    """The QuantizedGraph itself, or the one a QuantizedModel holds; ExportError for anything else."""
    if isinstance(qmodel, QuantizedGraph):
        return qmodel
    inner = getattr(qmodel, "qgraph", None)
    if isinstance(inner, QuantizedGraph):
        return inner
    raise ExportError(f"cannot export a {type(qmodel).__name__}: expected a netquant QuantizedModel "
                      "(from netquant.quantize_onnx / quantize_torch) or its QuantizedGraph (.qgraph)")


def root(cfg: TensorQuantConfig) -> TensorQuantConfig:
    """The config whose params `cfg` uses (follows dominated_by to its end)."""
    seen = {id(cfg)}
    while cfg.dominated_by is not None:
        cfg = cfg.dominated_by
        if id(cfg) in seen:
            raise ExportError(f"config of tensor '{cfg.name}' dominates itself (dominated_by cycle)")
        seen.add(id(cfg))
    return cfg


def emits(cfg: TensorQuantConfig | None) -> bool:
    """TensorQuantConfig.emits (a quantizer at its own place), with ExportError on a dominated_by cycle."""
    if cfg is None or not cfg.state.emits:
        return False
    return root(cfg).params is not None


def params_of(cfg: TensorQuantConfig) -> tuple[torch.Tensor, torch.Tensor, QuantSpec]:
    """(scale, zero_point, spec) that quantize this config's tensor, following dominated_by."""
    r = root(cfg)
    if r.params is None:
        raise ExportError(f"tensor '{cfg.name}' ({cfg.state.name}) has no scale / zero point; "
                          "calibrate the model before exporting")
    scale, zp = r.params.scale.detach().float().cpu(), r.params.zero_point.detach().cpu()
    if r.spec.granularity is Granularity.PER_TENSOR:
        if scale.numel() != 1:
            raise ExportError(f"per-tensor config of '{cfg.name}' has {scale.numel()} scales")
        scale, zp = scale.reshape(()), zp.reshape(())  # ORT's QLinear* kernels want scalars
    return scale, zp, r.spec


@dataclass(frozen=True)
class Slot:
    """One config at one place: node input `index` (is_input) or node output `index`."""

    node: str
    op_type: str
    index: int
    is_input: bool
    tensor: str
    config: TensorQuantConfig


def iter_slots(qgraph: QuantizedGraph) -> Iterator[Slot]:
    """Every config of every op, in graph order (inputs before outputs)."""
    for node in qgraph.graph.nodes:
        oc = qgraph.op_configs.get(node.name)
        if oc is None:
            continue
        for i, cfg in enumerate(oc.inputs):
            if cfg is not None and i < len(node.inputs) and node.inputs[i]:
                yield Slot(node.name, node.op_type, i, True, node.inputs[i], cfg)
        for i, cfg in enumerate(oc.outputs):
            if cfg is not None and i < len(node.outputs) and node.outputs[i]:
                yield Slot(node.name, node.op_type, i, False, node.outputs[i], cfg)


def check_deployable(qgraph: QuantizedGraph) -> None:
    """ExportError naming every config still INITIAL / PASSIVE_INIT (not calibrated / not derived)."""
    bad = [f"{s.node} {'input' if s.is_input else 'output'} {s.index} ('{s.tensor}', {s.config.state.name})"
           for s in iter_slots(qgraph) if s.config.state.is_pending]
    if bad:
        more = f" and {len(bad) - 10} more" if len(bad) > 10 else ""
        raise ExportError(f"{len(bad)} quantization configs are not deployable (never calibrated or "
                          f"derived): {'; '.join(bad[:10])}{more}. Run calibration and bias passes first "
                          "or set those ops to FP32.")
