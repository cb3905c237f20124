"""Embedding tables in int8, one scale per row.

A Gather whose data is a float initializer [V, D] of at least EMBEDDING_MIN_ELEMENTS (a word or position embedding)
gets a weight config on that input: int8 symmetric per row (axis 0), s_v = 2 max |table[v]| / 255 (choose_qparams)
rounded up to c_v * step (coded_row_scales: c_v an integer 1..255, step one float per table, so the file stores
the [V] scales in one byte a row; where that coding would raise the table's rounding noise by more than
MAX_NOISE_GROWTH, to a float16 value instead: half_exact_scales, two bytes a row), codes q[v] = round(table[v] / s_v).
The executor's fake quantization then sees the rows onnxruntime will return, and the QDQ export writes int8 codes +
DequantizeLinear(axis 0) -> Gather, which export.ort_patterns turns into Gather(codes) -> Cast -> Mul(Gather(scales))
for onnxruntime (only the gathered rows are dequantized each run). The Gather's output stays float. The word /
position / segment tables of onnxruntime.transformers.optimizer's com.microsoft EmbedLayerNormalization get the same
config; export.ort_patterns.embed_layer_norm_rows turns that node into Gathers of int8 rows + LayerNormalization for
onnxruntime.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from netquant.core.qparams import QParams, choose_qparams
from netquant.core.spec import QuantSpec
from netquant.core.tensor_config import QuantState, TensorQuantConfig
from netquant.graph.ir import Graph, Node
from netquant.graph.op_config import OpQuantConfig, TensorRole
from netquant.passes.base import Condition, PassBase, PassContext
from netquant.passes.overrides import resolve_overrides
from netquant.passes.settings import QuantSettings

EMBEDDING_MIN_ELEMENTS = 16_384  # smaller tables cost little as float, and their rows are read often
EMBEDDING_SPEC = QuantSpec.int8_per_channel(axis=0)
EMBED_LAYER_NORM_TABLES = (2, 3, 4)  # com.microsoft EmbedLayerNormalization: word, position, segment embeddings


def half_exact_scales(scale: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """Per-row scales rounded up to values float16 holds exactly (so the file stores the [V] scales in 2 bytes a
    row, export.ort_patterns.gather_int8_rows), where every row's scale is in float16's normal range; rows of
    zeros (amax 0: every code 0) get scale 1. Rounding up keeps each row's amax within 127 codes: the step grows by
    at most 2^-10 relative. Otherwise the scales are returned unchanged."""
    s = torch.where(amax > 0, scale, torch.ones_like(scale))
    up = (s.double() * (1.0 + 2.0 ** -10)).to(torch.float16)
    if not bool(torch.isfinite(up).all()) or bool((up.float() < 2.0 ** -14).any()):
        return scale
    return up.float()


ROW_SCALE_CODES = 255  # a row's scale is c * step, c in 1..ROW_SCALE_CODES: one uint8 a row in the file
STEP_BITS = 16  # significant bits of step: c * step (8 + 16 bits) is exact in float32, in the file and executor
MAX_NOISE_GROWTH = 1.02  # coded scales' mean (s_coded / s)^2 over the rows: at most 2% more rounding noise


def coded_row_scales(scale: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """Per-row scales rounded up to c_v * step: step = max_v s_v / 255 rounded up to STEP_BITS significant bits,
    c_v = ceil(s_v / step) in 1..255 (the largest row gets 255; rows of zeros, amax 0, get 1: every code is 0), so
    export.ort_patterns.gather_int8_rows stores c as uint8 and step once. Rounding up keeps each row's amax within
    127 codes; a row's step grows by less than step / s_v relative. Where the rows' mean (s_coded / s)^2 exceeds
    MAX_NOISE_GROWTH (rows far smaller than the largest) or step is not a normal float32, half_exact_scales."""
    live = amax > 0
    if not bool(live.any()):
        return half_exact_scales(scale, amax)
    ideal = scale.double()
    top = float(ideal[live].max()) / ROW_SCALE_CODES * (1.0 + 2.0 ** -40)
    mantissa, exponent = torch.frexp(torch.tensor(top, dtype=torch.float64))
    step = float(torch.ldexp(torch.ceil(mantissa * 2.0 ** STEP_BITS) / 2.0 ** STEP_BITS, exponent))
    if not 2.0 ** -100 < step < 2.0 ** 100:
        return half_exact_scales(scale, amax)
    codes = torch.where(live, torch.ceil(ideal / step), torch.ones_like(ideal)).clamp(1, ROW_SCALE_CODES)
    coded = codes * step
    if float(((coded[live] / ideal[live]) ** 2).mean()) > MAX_NOISE_GROWTH:
        return half_exact_scales(scale, amax)
    return coded.float()


def table_gather(graph: Graph, node: Node) -> bool:
    """Whether `node` is a Gather (axis 0) of an embedding table this pass stores in int8: a float32 [V, D]
    initializer of at least EMBEDDING_MIN_ELEMENTS. Clean-up leaves such a Gather unfolded where its indices are
    constant too (positions 0..T-1): folded, its rows would be a float constant the size of the table."""
    if node.op_type != "Gather" or int(node.attrs.get("axis", 0)) != 0 or not node.inputs:
        return False
    table = graph.initializers.get(node.inputs[0])
    return table is not None and table.dtype == torch.float32 and table.dim() == 2 and \
        table.numel() >= EMBEDDING_MIN_ELEMENTS


def embeddings_wanted(settings: QuantSettings) -> bool:
    """The settings' embeddings choice, else the platform's."""
    return bool(settings.embeddings if settings.embeddings is not None else settings.platform.embeddings)


class EmbeddingPass(PassBase):
    """Embedding tables int8 per row where the settings (or the platform) ask for it (module docstring)."""

    name: ClassVar[str] = "embedding tables"
    requires: ClassVar[frozenset[Condition]] = frozenset({Condition.CONFIGS})
    ensures: ClassVar[frozenset[Condition]] = frozenset()

    def run(self, ctx: PassContext) -> None:
        s = ctx.settings
        if not embeddings_wanted(s):
            return
        qgraph = ctx.quantized
        graph = qgraph.graph
        fp32 = [o for o in resolve_overrides(graph, s.force_fp32, ()) if o.fp32]
        for node in graph.nodes:
            if any(o.select.matches(node) for o in fp32):
                continue
            if node.op_type == "Gather" and int(node.attrs.get("axis", 0)) == 0:
                slots: tuple[int, ...] = (0,)
            elif node.op_type == "EmbedLayerNormalization" and node.domain == "com.microsoft":
                slots = EMBED_LAYER_NORM_TABLES
            else:
                continue
            for i in slots:
                table = graph.initializers.get(node.inputs[i]) if i < len(node.inputs) and node.inputs[i] else None
                if table is None or table.dtype != torch.float32 or table.dim() != 2 or \
                        table.numel() < EMBEDDING_MIN_ELEMENTS:
                    continue
                amax = table.detach().abs().amax(dim=1)
                params = choose_qparams(-amax, amax, EMBEDDING_SPEC, name=node.inputs[i])
                params = QParams(coded_row_scales(params.scale, amax), params.zero_point)
                cfg = TensorQuantConfig(EMBEDDING_SPEC, QuantState.ACTIVATED, observer="minmax", params=params,
                                        name=node.inputs[i])
                oc = qgraph.op_configs.get(node.name)
                if oc is None:
                    oc = OpQuantConfig(node, [None] * len(node.inputs), [None] * len(node.outputs))
                    qgraph.op_configs[node.name] = oc
                oc.inputs[i] = cfg
                oc.roles[i] = TensorRole.WEIGHT
