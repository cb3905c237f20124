"""Residual sums kept apart from their LayerNormalization where onnxruntime's fused SkipLayerNormalization is slower.

onnxruntime fuses Add -> LayerNormalization into com.microsoft SkipLayerNormalization where it knows both Add inputs'
static shapes; platforms.ort_probes measures, per hidden size, whether that kernel is slower on this machine than the
two ops apart (it was 6-7x slower on an AMD EPYC with AVX-512: dynamo exports of BERT-style encoders ran 15-20% slower
in every file, FP32 or INT8). Where it is, keep_layer_norms_apart rewrites, in place:
- an Add (ai.onnx) whose only reader is a LayerNormalization's X, and that is no graph output, into Sum: the same
  float sum rounded once, with the same broadcasting, which the fusion does not match;
- a com.microsoft SkipLayerNormalization (graphs after onnxruntime.transformers.optimizer) whose only output read is Y
  into Sum(input, skip[, bias]) -> LayerNormalization(axis -1, its epsilon), in models of ai.onnx opset >= 17: the
  same formula, each onnxruntime kernel rounding it its own way (outputs agree to float rounding, not bit for bit).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import onnx
from onnx import helper

from netquant.graph.ir import claim_name

FusedSlower = Callable[[int], bool]  # hidden size -> onnxruntime's SkipLayerNormalization is slower here


def _hidden(inits: dict[str, onnx.TensorProto], scale: str) -> int | None:
    t = inits.get(scale)
    return int(t.dims[-1]) if t is not None and len(t.dims) == 1 else None


def keep_layer_norms_apart(model: onnx.ModelProto, fused_slower: FusedSlower) -> int:
    """The module docstring's rewrites, for hidden sizes (the LayerNormalization scale's length) where
    fused_slower(hidden); returns how many nodes were rewritten."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    readers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for n in graph.node:
        for i in n.input:
            readers[i].append(n)
    outputs = {o.name for o in graph.output}
    producer = {o: n for n in graph.node for o in n.output}
    rewritten = 0
    for ln in graph.node:
        if ln.op_type != "LayerNormalization" or ln.domain not in ("", "ai.onnx") or len(ln.input) < 2:
            continue
        add = producer.get(ln.input[0])
        if add is None or add.op_type != "Add" or add.domain not in ("", "ai.onnx") or add.output[0] in outputs:
            continue
        hidden = _hidden(inits, ln.input[1])
        if len(readers[add.output[0]]) == 1 and hidden is not None and fused_slower(hidden):
            add.op_type = "Sum"
            rewritten += 1
    rewritten += _unfuse_skip_layer_norms(model, inits, readers, outputs, fused_slower)
    return rewritten


def _unfuse_skip_layer_norms(model: onnx.ModelProto, inits: dict[str, onnx.TensorProto],
                             readers: dict[str, list[onnx.NodeProto]], outputs: set[str],
                             fused_slower: FusedSlower) -> int:
    graph = model.graph
    if not any(o.domain in ("", "ai.onnx") and o.version >= 17 for o in model.opset_import):
        return 0  # no ai.onnx LayerNormalization before opset 17
    taken = {o for n in graph.node for o in n.output} | set(inits) | {i.name for i in graph.input}
    nodes: list[onnx.NodeProto] = []
    count = 0
    for n in graph.node:
        if n.op_type != "SkipLayerNormalization" or n.domain != "com.microsoft" or len(n.input) < 3:
            nodes.append(n)
            continue
        extra = [o for o in n.output[1:] if o and (readers.get(o) or o in outputs)]
        hidden = _hidden(inits, n.input[2])
        if extra or hidden is None or not fused_slower(hidden):
            nodes.append(n)
            continue
        summed = claim_name(f"{n.output[0]}_sum", taken)
        terms = [n.input[0], n.input[1], *([n.input[4]] if len(n.input) > 4 and n.input[4] else [])]
        norm = [n.input[2], *([n.input[3]] if len(n.input) > 3 and n.input[3] else [])]
        eps = next((a.f for a in n.attribute if a.name == "epsilon"), 1e-12)
        nodes.append(helper.make_node("Sum", terms, [summed], name=claim_name(f"{n.name or summed}/sum", taken)))
        nodes.append(helper.make_node("LayerNormalization", [summed, *norm], [n.output[0]], name=n.name or None,
                                      axis=-1, epsilon=eps))
        count += 1
    if count:
        del graph.node[:]
        graph.node.extend(nodes)
    return count
