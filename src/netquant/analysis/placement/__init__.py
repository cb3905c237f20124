"""Automatic placement (analysis.placement): each region runs in INT8 only where that is faster in onnxruntime here and accurate enough.

The algorithm (`search_placement`), deterministic for a given set of measurements:
1. regions: analysis.regions.find_regions of the quantized graph (each Conv / MatMul / Gemm with the quantized ops
   that ride on it);
2. measure: profile the FP32 graph and the all-INT8 QDQ export in onnxruntime (CPU, batch 1, one thread; per-node
   medians) and charge each node, with its Q/DQ and layout glue, to a region (analysis.profile): fp32_ms and
   int8_ms per region;
3. speed: a region is "slower" where int8_ms > 1.05 fp32_ms + 2 us (the profiler's noise). LATENCY keeps every
   slower region float; BALANCED and ACCURACY put the model really in INT8: they float only the slower regions
   needed (largest INT8 excess first) for the model to be no slower than FP32, the rest stay INT8;
4. accuracy budget (budget, analysis.sensitivity): over max_loss in all INT8, first repair (repair: the cheapest
   of the effort's repairs that brings the loss within max_loss, quantizing the model again with it); then, while
   the fake-quant loss exceeds max_loss, keep in float the region with the largest measured gain
   (loss(all INT8) - loss(all but it)). This step uses no timing and no clock (one torch thread, a fixed amount of
   work per effort): the same model, data and effort give the same accuracy decisions on any machine load;
5. iterate: export the candidate, profile it, refresh each region's time in its current state (its glue changes
   with its neighbours), decide step 3 again (the budget's floats of step 4 stay); stop when nothing changes, after MAX_ROUNDS or at the time cap;
6. keep, among the measured candidates that meet the budget (the all-INT8 graph included), the fastest (LATENCY) or
   the one with the fewest float regions that is no slower than FP32 (BALANCED, ACCURACY; the fastest where none is).
7. static or dynamic (onnxruntime, `dynamic.choose_dynamic`, started only within the time cap: past it every region
   stays static): the INT8 MatMul regions are profiled once more with their
   activation quantized at run time (export.dynamic: DynamicQuantizeLinear + MatMulInteger, onnxruntime's
   DynamicQuantizeMatMul); regions clearly faster so are the per-region choice; the all-static file, the
   all-dynamic one and the per-region choice (where it is neither) are then compared: by their profile sums where
   the first two differ by more than PROFILE_CLEAR (15%), else timed against each other (wall clock, started within
   DYNAMIC_SHARE of the cap); the fastest whose onnxruntime output is as close to the source's as the static file's
   (or within max_loss) ships: decision DYNAMIC, with each region's dynamic_ms in the placement file. The attention
   step (analysis.attention) then starts its tries within ATTENTION_SHARE of the cap. One onnxruntime session of the
   source (one thread) serves every whole-model timing and output check, and export's FP32 reference
   (QuantizedGraph.fp32_session) where export runs with one thread.

BALANCED / ACCURACY first time the all-INT8 file against the user's FP32 model (wall clock, interleaved, within
WALL_BUDGET_S); when it is no slower and within the budget that decides, and steps 2-6 run only while the time cap
(TIME_SHARE of the quantization time, at least MIN_TIME_S) leaves room for them. Where it does not decide (and for
LATENCY) steps 2-6 make the decision, within SEARCH_SHARE of the quantization time, at least SEARCH_MIN_S. Platforms whose engine is not timed
here get step 4 alone (`search._budget_only`); where the platform names a wider integer format (Platform.wider: QNN HTP's
uint16 activations, int8 for a 4-bit scheme), the regions the budget needs run in that format first (the most
sensitive first, as many as the budget needs), and only if every region wide is still not within max_loss do the
most sensitive ones go float (analysis.wider).

The result is a `Placement`, saved as JSON (`Placement.save`) and re-applied without measuring (`placement_from`).
"""

from netquant.analysis.placement.budget import AccuracyBudget, WideFactory
from netquant.analysis.placement.constants import DEFAULT_MAX_LOSS, MIN_WEIGHTS, WIDER_SHARE
from netquant.analysis.placement.files import apply_placement_file
from netquant.analysis.placement.inputs import batch_axis, model_hash
from netquant.analysis.placement.records import (
           DECISIONS,
           DYNAMIC,
           FLOAT,
           INT8,
           WEIGHT_ONLY,
           WIDER,
           Placement,
           Reason,
           RegionDecision,
)
from netquant.analysis.placement.repair import Requantize, place_with_repair, try_repairs
from netquant.analysis.placement.search import applies, place, search_placement, timed

__all__ = ["DECISIONS", "DEFAULT_MAX_LOSS", "DYNAMIC", "FLOAT", "INT8", "MIN_WEIGHTS", "WEIGHT_ONLY", "WIDER", "WIDER_SHARE", "AccuracyBudget",
           "Placement", "Reason", "RegionDecision", "RepairTrial", "Requantize", "WideFactory", "applies", "apply_placement_file", "batch_axis",
           "model_hash", "place", "place_with_repair", "search_placement", "timed", "try_repairs"]
