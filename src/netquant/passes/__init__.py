"""PTQ passes: the quantized graph, the quantizer and the passes that calibrate it.

Every pass is a `PassBase` subclass declaring what it `requires` and `ensures` (`Condition`s the
`PassManager` checks around it); `default_passes` is the PTQ pipeline, `quantize_onnx(passes=[...])`
adds your own where each one's `Stage` says (repairs: passes.smoothquant, passes.equalization, passes.adaround,
passes.reconstruction, passes.learned_scales).
"""

from netquant.passes.base import Condition, PassBase, PassConditionError, PassContext, Stage
from netquant.passes.manager import PassManager
from netquant.passes.overrides import OpSelector, Override
from netquant.passes.progress import ProgressReporter, RichProgress
from netquant.passes.quant_graph import CalibrationCounts, CleanupCounts, OpQuantConfig, QuantizedGraph
from netquant.passes.quantizer import Quantizer, QuantizerWarning, build_quant_graph
from netquant.passes.settings import QuantSettings

__all__ = ["CalibrationCounts", "CleanupCounts", "Condition", "OpQuantConfig", "OpSelector", "Override",
           "PassBase", "PassConditionError", "PassContext", "PassManager", "ProgressReporter", "QuantSettings",
           "QuantizedGraph", "Quantizer", "QuantizerWarning", "RichProgress", "Stage", "build_quant_graph"]
