"""Placement's tuning constants: default budgets, time caps, profile and wall-clock settings."""

from __future__ import annotations

from netquant.passes.settings import Effort, Objective

FORMAT = "netquant.placement/1"
MAX_ROUNDS = 3
DEFAULT_MAX_LOSS = {Objective.BALANCED: 0.02, Objective.ACCURACY: 0.005, Objective.LATENCY: None}
MIN_WEIGHTS = 20_000  # below this many weight elements in all regions, per-op timing is noise: rules only
MIN_TIME_S = 0.25
TIME_SHARE = 0.15  # default cap: this share of the quantization time before placement (at least MIN_TIME_S)
SEARCH_MIN_S, SEARCH_SHARE = 1.5, 0.5  # the cap where the per-region search decides (INT8 slower than the source,
# over the budget, LATENCY): half the quantization time, at least 1.5 s (a few profiles of a small model)
REPORT_SHARE = 0.25  # share of the cap the report's extra sensitivities may use
PROFILE_AFTER_SHARE = 0.5  # all INT8 decided by the whole-model check after this share of the cap: no profiles
PROFILE_RUNS, PROFILE_WARMUP = 5, 1  # per-node medians of 5 batch-1 runs (20 runs cost 3x the time)
WALL_ROUNDS, WALL_RUNS = 5, 3  # INT8-first check: 5 interleaved rounds of 3 runs per model ...
WALL_BUDGET_S = 1.0  # ... fewer runs per round (at least 1) for models whose runs would take longer
WALL_CLEAR = 0.15  # ... and 3 rounds only when INT8 is this much faster or slower than FP32 by then
WALL_THREADS = 1  # whole-model timings: one intra-op thread (the timing export reuses: measure.whole_model_timing)
# the DYNAMIC step (dynamic.choose_dynamic): the profile sums of the all-static and all-dynamic files decide where they
# differ by more than PROFILE_CLEAR (of the smaller); else the files are timed (wall clock), started within
# DYNAMIC_SHARE of placement's cap after the step starts and ending by then
PROFILE_CLEAR = 0.15
DYNAMIC_SHARE = 0.25
ATTENTION_SHARE = 0.25  # the attention step's tries (analysis.attention) end within this share of the cap
# (each one as long as the one before it: analysis.attention._can_start)
SLOWER_MARGIN, SLOWER_MS = 1.05, 0.002  # INT8 counts as slower above 1.05 x FP32 + 2 us (profiler noise)
SENSITIVITY_SAMPLES = 4  # calibration samples the fake-quant loss is measured on
# platforms with a wider format (Platform.wider) widen regions until the loss is within this share of max_loss: a wide
# region stays integer on the engine, so it buys accuracy more cheaply than a float one. Measured (Q/DQ reference
# semantics, 64 calibration / 200 held-out lines, FP32 100%): academic_int4 classifier at max_loss 0.02 -> 40 of 53
# regions int8 (W8A8), 90.0% (as the 36 floats of the budget alone); 0.005 -> 50 wide, 99.5%; 0.002 -> 52, 100%
WIDER_SHARE = 0.25
# regions whose gain (the loss floating it saves) the budget measures, the noisiest first (None: all), per effort:
# one fake-quant pass each on SENSITIVITY_SAMPLES samples
RANKED_REGIONS: dict[Effort, int | None] = {Effort.FAST: 0, Effort.DEFAULT: 12, Effort.MAX: None}
# edge floats (placement.edges): a Conv / MatMul / Gemm reading a model input or writing an output, holding at most
# EDGE_MAX_WEIGHT_SHARE of the compute regions' weights, stays float where that saves at least EDGE_MIN_GAIN of the
# all-INT8 loss (ViT-B/16's patch embedding: 0.7% of the weights, ~45% of the loss with pixels per tensor uint8)
EDGE_MAX_WEIGHT_SHARE = 0.02
EDGE_MIN_GAIN = 0.10
# ... but an embedding table (a Gather of a constant) stays float under BALANCED only where floating it saves at least
# TABLE_MIN_GAIN of the loss: a float table costs 3 bytes per element, and onnxruntime's quantize_dynamic, the size
# users compare with, stores tables int8 (the position tables of random-init 6 x 384 BERT-like encoders hold 14-18%:
# int8 under BALANCED, float under ACCURACY)
TABLE_MIN_GAIN = 0.30
# ... and a Conv / MatMul / Gemm edge keeps its weights int8 (weight-only: activations float, the file 3 bytes per
# weight smaller) where that keeps at least WEIGHT_ONLY_SHARE of what floating it saves (ViT's patch embedding: 85%)
WEIGHT_ONLY_SHARE = 0.75
WEIGHT_ONLY_MIN_WEIGHTS = 1 << 16  # ... and holds this many weights (smaller edges save a few KB: they stay float)
LOSS_NOISE = 1e-12  # an all-INT8 loss at or below this is float noise (its output is FP32's): no edge float is tried
# and the report measures no sensitivities (a constant-weight model's 2e-32)
