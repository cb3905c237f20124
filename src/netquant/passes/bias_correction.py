"""Bias correction: fold the mean output shift that weight quantization causes back into the bias.

Quantized weights W_q = W + dW move every output of a Conv / Gemm / MatMul by op(x, dW); its mean over the
calibration data is not zero when the inputs have a mean (Nagel et al., "Data-Free Quantization", 2019, sec. 4.2;
AIMET's and NNCF's bias correction). Per output channel c:

    delta[c] = E_x[ op(x, W_q) - op(x, W) ][c] = E_x[ op(x, dW) ][c]      (x: the op's FP32 input)
    b'[c]    = b[c] - delta[c]

computed with the graph's own op kernel on the calibration batches (padding and strides included, so border
pixels count as the engine computes them). The bias is the op's bias input (Conv, Gemm) or, for a MatMul, the
constant vector of the single Add that consumes its output. Only ops whose weights are quantized are corrected;
the corrected value replaces the bias initializer (so every exporter writes it, and int32 biases are quantized
from it) while the op's weights are quantized (`QuantizedGraph.graph` puts the FP32 value back once they are not);
`QuantizedGraph.bias_corrections` keeps the FP32 values, which the FP32 executor runs with.

Where it matters: a BatchNorm-folded PP-OCR recognizer has first-stage depthwise channels with a nearly constant
input (std / |mean| < 0.01) and large weights summing to ~0: each weight's rounding error leaks |mean| x sum(dW)
into the output. Measured per platform in netquant.platforms.builtin.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import ClassVar

import torch

from netquant.graph import Graph, Node
from netquant.graph.op_config import OpQuantConfig, TensorRole
from netquant.graph.ops.registry import OpContext, lookup_op
from netquant.passes.base import Condition, PassBase, PassContext
from netquant.passes.quant_graph import BiasCorrection, QuantizedGraph, emits, fake_quant
from netquant.passes.quantizer import GraphIndex

CORRECTED_OPS = ("Conv", "Gemm", "MatMul")
MAX_BATCHES = 8  # calibration batches averaged (the mean converges fast; each costs one FP32 run)


@dataclass(frozen=True)
class _Target:
    """One op to correct: its weight input and where its bias lives (consumer op, input index, tensor)."""

    oc: OpQuantConfig
    weight_index: int
    consumer: str
    bias_index: int
    bias: str
    scale: float  # the bias enters the output multiplied by this (Gemm beta), 1 elsewhere


def _channel_axis(node: Node) -> int:
    return 1 if node.op_type == "Conv" else -1


def _bias_target(oc: OpQuantConfig, graph: Graph, index: GraphIndex) -> _Target | None:
    """Where op `oc` keeps a bias this pass may rewrite (a float initializer read by this op only), or None."""
    node = oc.op
    w_idx = oc.input_index(TensorRole.WEIGHT)
    if node.op_type not in CORRECTED_OPS or w_idx is None or not emits(oc.inputs[w_idx]):
        return None
    weight = graph.initializers.get(node.inputs[w_idx])
    if weight is None or weight.dim() < 2:
        return None
    channels = weight.shape[0] if node.op_type == "Conv" else (
        weight.shape[0] if node.op_type == "Gemm" and int(node.attrs.get("transB", 0)) else weight.shape[-1])
    if node.op_type == "Conv" and len(node.inputs) > 2 and node.inputs[2]:
        consumer, b_idx, bias, scale = node, 2, node.inputs[2], 1.0
    elif node.op_type == "Gemm" and len(node.inputs) > 2 and node.inputs[2]:
        if int(node.attrs.get("transA", 0)) or float(node.attrs.get("alpha", 1.0)) != 1.0:
            return None
        consumer, b_idx, bias, scale = node, 2, node.inputs[2], float(node.attrs.get("beta", 1.0))
    elif node.op_type == "MatMul":
        users = index.consumers.get(node.outputs[0], [])
        if len(users) != 1 or users[0].op_type != "Add" or len(users[0].inputs) != 2:
            return None
        consumer = users[0]
        b_idx = 1 - consumer.inputs.index(node.outputs[0])
        bias, scale = consumer.inputs[b_idx], 1.0
    else:
        return None
    value = graph.initializers.get(bias)
    if value is None or not value.is_floating_point() or value.numel() != channels or scale == 0.0:
        return None
    if len(index.consumers.get(bias, [])) != 1 or graph.is_graph_output(bias):
        return None  # shared or visible: rewriting it would change other ops
    if node.op_type == "MatMul" and value.shape[-1] != channels:
        return None
    return _Target(oc, w_idx, consumer.name, b_idx, bias, scale)


def _channel_means(y: torch.Tensor, node: Node) -> torch.Tensor:
    axis = _channel_axis(node) % y.dim()
    return y.double().movedim(axis, -1).reshape(-1, y.shape[axis]).mean(dim=0)


def correct_biases(qgraph: QuantizedGraph, batches: list[dict[str, torch.Tensor]],
                   input_error: bool = False) -> dict[str, BiasCorrection]:
    """Bias correction (module docstring); returns the biases changed, with their FP32 values.

    delta[c] = E[op(x, W_q - W)][c] (weight error, Nagel et al.'s bias correction), and with input_error also
    E[op(q(x) - x, W_q)][c] (the op's own input rounding): x the op's input in the FP32 model, q its input
    quantizer (the root config of its activation input). The error each op adds itself is corrected, not what
    reaches it from upstream (re-measuring inputs in the fake-quantized model corrects upstream errors twice:
    PP-OCR rec 0% exact lines). Both terms are linear in small operands, so float32 keeps the shift (the
    difference of two large outputs would not). Measured on PP-OCR rec (200 lines, fake-quant): academic_int8
    per-channel 87.0% -> 97.0% (weight error) / 92.0% (with input error), fp8_e4m3 91.0% -> 85.5% / 89.0%.
    """
    from netquant.graph.executor import Executor

    graph = qgraph.graph
    index = GraphIndex(graph)
    targets = [t for oc in qgraph.op_configs.values() if (t := _bias_target(oc, graph, index)) is not None
               and ((rw := qgraph.rounded_weights.get(oc.op.inputs[t.weight_index])) is None or rw.correct_bias)]
    if not targets or not batches:
        return {}
    opset = graph.opset_imports.get("", graph.opset)
    kernels = {}
    for t in targets:
        node = t.oc.op
        held = graph.initializers[node.inputs[t.weight_index]].float()
        rounded = qgraph.rounded_weights.get(node.inputs[t.weight_index])
        w = rounded.original.float() if rounded is not None else held  # AdaRound: the error of its codes
        w_q = fake_quant(held, t.oc.inputs[t.weight_index])
        fn = lookup_op(node.op_type, "", opset, node.name)
        ctx = OpContext(op_type=node.op_type, name=node.name, domain="", opset=opset, num_outputs=1)
        kernels[node.name] = (fn, ctx, w_q, w_q - w)
    keep = sorted({t.oc.op.inputs[0] for t in targets})
    ex = qgraph.executor(fake_quant=False) if qgraph.rounded_weights else Executor(graph)  # the FP32 model's inputs
    sums: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for batch in batches:
            values = ex.run(batch, outputs=keep)
            for t in targets:
                node = t.oc.op
                fn, ctx, w_q, dw = kernels[node.name]
                x = values[node.inputs[0]].float()
                y = fn([x, dw], node.attrs, ctx)[0]
                root = t.oc.inputs[0].root if t.oc.inputs[0] is not None else None
                if input_error and emits(root):
                    assert root is not None
                    y = y + fn([fake_quant(x, root) - x, w_q], node.attrs, ctx)[0]
                m = _channel_means(y, node)
                sums[node.name] = sums[node.name] + m if node.name in sums else m
    done: dict[str, BiasCorrection] = {}
    for t in targets:
        original = graph.initializers[t.bias]
        delta = (sums[t.oc.op.name] / len(batches) / t.scale).reshape(original.shape)
        corrected = (original.double() - delta).to(original.dtype)
        graph.initializers[t.bias] = corrected
        done[t.bias] = BiasCorrection(op=t.oc.op.name, consumer=t.consumer, input_index=t.bias_index,
                                      original=original, delta=delta.float(), corrected=corrected)
    return done


class BiasCorrectionPass(PassBase):
    """Bias correction (module docstring) where the platform or the settings ask for it."""

    name: ClassVar[str] = "bias correction"
    requires: ClassVar[frozenset[Condition]] = frozenset({Condition.BIASES, Condition.CALIB_DATA})
    ensures: ClassVar[frozenset[Condition]] = frozenset()

    def run(self, ctx: PassContext) -> None:
        settings = ctx.settings
        wanted = settings.bias_correction
        if wanted is None:
            wanted = settings.platform.bias_correction
        if not wanted:
            return
        qgraph = ctx.quantized
        assert ctx.calib_data is not None
        qgraph.bias_corrections.update(correct_biases(qgraph, list(itertools.islice(ctx.calib_data, MAX_BATCHES))))
