"""PTQ passes: the quantized graph, the quantizer and the pipeline that calibrates it."""

from netquant.passes.overrides import OpSelector, Override
from netquant.passes.quant_graph import OpQuantConfig, QuantizedGraph
from netquant.passes.quantizer import Quantizer, QuantizerWarning, build_quant_graph
from netquant.passes.settings import QuantSettings

__all__ = ["OpQuantConfig", "OpSelector", "Override", "QuantSettings", "QuantizedGraph", "Quantizer",
           "QuantizerWarning", "build_quant_graph"]
