"""Measured speeds of this machine's onnxruntime kernels where an exact rewrite of the exported file can avoid a slow one.

onnxruntime fuses Add -> LayerNormalization into com.microsoft SkipLayerNormalization wherever it knows both Add inputs
are [B, S, H] with static S and H (dynamo exports, static-shape graphs). On an AMD EPYC with AVX-512 (onnxruntime
1.32, one thread) that kernel took 255 us for [1, 128, 384] and 502 us for [1, 128, 768], where Add + LayerNormalization
took 40 and 70 us: 24 such layers cost BERT-base 10 ms a run. Whether it is slower is measured here, per hidden size,
once per process (skip_layer_norm_probe), not assumed for every CPU.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass

import numpy as np

PROBE_ROWS = 128  # tokens per probe run ([1, PROBE_ROWS, hidden])
PROBE_ROUNDS = 5  # interleaved rounds ...
PROBE_RUNS = 8  # ... of this many runs of each model; medians of the rounds' per-run means
SLOWER_MARGIN = 1.25  # the fused kernel counts as slower only beyond this factor (noise and thread jitter stay below)


@dataclass(frozen=True)
class SkipLayerNormProbe:
    """Microseconds of one run of onnxruntime's fused SkipLayerNormalization (Add -> LayerNormalization as onnxruntime
    fuses it) and of the same two ops kept apart (Sum -> LayerNormalization, which it does not fuse), on
    [1, PROBE_ROWS, hidden] with one intra-op thread."""

    hidden: int
    fused_us: float
    apart_us: float

    @property
    def fused_slower(self) -> bool:
        return self.fused_us > SLOWER_MARGIN * self.apart_us

    def describe(self) -> str:
        return (f"onnxruntime's SkipLayerNormalization {self.fused_us:.0f} us vs Add + LayerNormalization "
                f"{self.apart_us:.0f} us on [1, {PROBE_ROWS}, {self.hidden}]")


def _add_layer_norm(op: str, hidden: int) -> bytes:
    """x + y (as `op`: Add or Sum) -> LayerNormalization over the last axis, [1, PROBE_ROWS, hidden] float32."""
    from onnx import TensorProto, helper, numpy_helper

    shape = [1, PROBE_ROWS, hidden]
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32), "gamma"),
             numpy_helper.from_array((0.1 * rng.standard_normal(hidden)).astype(np.float32), "beta")]
    nodes = [helper.make_node(op, ["x", "y"], ["s"]),
             helper.make_node("LayerNormalization", ["s", "gamma", "beta"], ["z"], axis=-1, epsilon=1e-12)]
    graph = helper.make_graph(nodes, "netquant_layer_norm_probe",
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("x", "y")],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, shape)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


@functools.cache
def skip_layer_norm_probe(hidden: int) -> SkipLayerNormProbe:
    """SkipLayerNormProbe for `hidden`, measured once per process: both models in onnxruntime (all optimizations, one
    intra-op thread), one warm-up run each, then PROBE_ROUNDS interleaved rounds of PROBE_RUNS runs of each."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    sessions = [ort.InferenceSession(_add_layer_norm(op, hidden), so, providers=["CPUExecutionProvider"])
                for op in ("Add", "Sum")]
    rng = np.random.default_rng(1)
    feeds = {n: rng.standard_normal((1, PROBE_ROWS, hidden)).astype(np.float32) for n in ("x", "y")}
    for sess in sessions:
        sess.run(None, feeds)
    rounds: list[list[float]] = [[], []]
    for _ in range(PROBE_ROUNDS):
        for k, sess in enumerate(sessions):
            start = time.perf_counter()
            for _ in range(PROBE_RUNS):
                sess.run(None, feeds)
            rounds[k].append(1e6 * (time.perf_counter() - start) / PROBE_RUNS)
    return SkipLayerNormProbe(hidden, statistics.median(rounds[0]), statistics.median(rounds[1]))
