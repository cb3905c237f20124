"""Keyword inputs for quantize_torch: a dict of example tensors (a Hugging Face tokenizer's output, or any
{name: tensor}) passed to the module's forward as keywords.

The ONNX inputs take the dict's names. Dynamic dims by default (dynamic_batch=True): dim 0 of every tensor is the
batch, and for token inputs of a Hugging Face transformers model (input_ids, attention_mask, token_type_ids,
position_ids, ...: SEQUENCE_INPUTS, 2-D) dim 1 is the sequence, so one file takes any batch and any length. The
dims are named 'batch' and 'sequence' in the file. Outputs of a transformers ModelOutput are named after its fields
(last_hidden_state, pooler_output, ...). transformers 5 models export as they are (torch.export traces their
forward with keyword inputs): no wrapper module is needed. transformers itself is not imported here (the
optional extra `netquant[hf]`): models are recognised by their output type and input names.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import torch

from netquant.errors import ModelError

SEQUENCE_INPUTS = frozenset({"input_ids", "attention_mask", "token_type_ids", "position_ids", "inputs_embeds",
                             "decoder_input_ids", "decoder_attention_mask", "global_attention_mask"})
BATCH, SEQUENCE = "batch", "sequence"


@dataclass(frozen=True)
class KeywordExport:
    """What torch_to_onnx needs to export a module called with keyword inputs."""

    kwargs: dict[str, Any]
    input_names: list[str]
    output_names: list[str] | None
    dynamic_shapes: dict[str, Any] | None
    dim_names: dict[str, dict[int, str]]  # input -> {dim: name} for the exported file


def _tensor(name: str, value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, (torch.Tensor, type(None), bool, int, float)):
        return value
    raise ModelError(f"quantize_torch: example input '{name}' is a {type(value).__name__}; give tensors or numpy "
                     "arrays (e.g. a tokenizer's output with return_tensors='pt')")


def _output_names(module: torch.nn.Module, kwargs: dict[str, Any]) -> list[str] | None:
    """The tensor fields of a ModelOutput-like mapping the module returns, in its order; None for other outputs
    (the exporter's names are kept)."""
    from torch.utils import _pytree

    with torch.no_grad():
        out = module(**kwargs)
    if not isinstance(out, Mapping) and not (hasattr(out, "keys") and hasattr(out, "items")):
        return None
    names = [k for k, v in out.items() if isinstance(v, torch.Tensor)]
    leaves = [x for x in _pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
    return names if len(names) == len(leaves) and all(v is x for v, x in
                                                        zip([out[k] for k in names], leaves)) else None


def keyword_export(module: torch.nn.Module, example: Mapping[str, Any], *,
                   output_names: Sequence[str] | None = None,
                   dynamic_axes: Mapping[str, Mapping[int, str]] | None = None,
                   dynamic_batch: bool = True) -> KeywordExport:
    """The keyword export of `module` on `example` (module docstring). dynamic_axes ({input: {dim: name}}) replaces
    the default dims; dynamic_batch=False with no dynamic_axes fixes every dim."""
    kwargs = {str(k): _tensor(str(k), v) for k, v in example.items()}
    if not kwargs:
        raise ModelError("quantize_torch: the example inputs dict is empty; give the inputs the model's forward takes")
    try:
        names = list(output_names) if output_names else _output_names(module, kwargs)
    except Exception as exc:  # noqa: BLE001 - whatever the forward raises, the example does not fit
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in kwargs.items() if isinstance(v, torch.Tensor))
        raise ModelError(f"quantize_torch: {type(module).__name__} cannot run on the example inputs ({shapes}): "
                         f"{type(exc).__name__}: {first[:300]}; give the keyword inputs its forward takes") from exc
    dims: dict[str, dict[int, str]] = {}
    if dynamic_axes is not None:
        dims = {k: {int(d): str(n) for d, n in v.items()} for k, v in dynamic_axes.items()}
        unknown = sorted(set(dims) - set(kwargs))
        if unknown:
            raise ModelError(f"quantize_torch: dynamic_axes names {unknown}, not among the example inputs "
                             f"{sorted(kwargs)}")
    elif dynamic_batch:
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor) and v.dim() >= 1:
                dims[k] = {0: BATCH}
                if k in SEQUENCE_INPUTS and v.dim() >= 2:
                    dims[k][1] = SEQUENCE
    shapes: dict[str, Any] | None = None
    for k, ds in dims.items():  # torch.export fixes dims of size 1: the example is doubled along them (shapes only)
        for d in ds:
            v = kwargs[k]
            if isinstance(v, torch.Tensor) and d < v.dim() and v.shape[d] == 1:
                kwargs[k] = torch.cat([v, v], dim=d)
    if dims:
        # torch.export's automatic dims: it finds which are equal (input_ids' and attention_mask's lengths) itself
        shapes = {k: ({d: torch.export.Dim.DYNAMIC for d in dims[k]} if k in dims else None) for k in kwargs}
    return KeywordExport(kwargs, list(kwargs), names, shapes, dims)


def name_dims(proto: onnx.ModelProto, dim_names: Mapping[str, Mapping[int, str]]) -> None:
    """Rename the symbolic dims torch.export chose (s0, s1, ...) on the inputs to `dim_names`, everywhere in the
    graph's inputs, outputs and value_info (expressions such as 's0 + 1' included), in place."""
    rename: dict[str, str] = {}
    for value in proto.graph.input:
        for d, name in dim_names.get(value.name, {}).items():
            dims = value.type.tensor_type.shape.dim
            if d < len(dims) and dims[d].dim_param and dims[d].dim_param not in rename:
                rename[dims[d].dim_param] = name
    if not rename:
        return
    pattern = re.compile(r"\b(" + "|".join(re.escape(k) for k in sorted(rename, key=len, reverse=True)) + r")\b")
    for value in (*proto.graph.input, *proto.graph.output, *proto.graph.value_info):
        if not value.type.HasField("tensor_type"):
            continue
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param:
                dim.dim_param = pattern.sub(lambda m: rename[m.group(1)], dim.dim_param)
