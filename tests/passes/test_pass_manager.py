"""The pass infrastructure: declared requires / ensures checked by the PassManager, user passes in
quantize_onnx, progress events apart from pass logic, the typed facts passes record, and export taking
the typed QuantizedModel / QuantizedGraph."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import ClassVar

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import netquant
from netquant.core.tensor_config import QuantState
from netquant.errors import ConfigError, ExportError
from netquant.export.params import quant_params
from netquant.export.slots import unwrap
from netquant.graph import load_onnx
from netquant.passes import (
    Condition,
    PassBase,
    PassConditionError,
    PassContext,
    PassManager,
    ProgressReporter,
)
from netquant.passes.build_configs import BuildConfigsPass
from netquant.passes.calibration import CalibrationPass
from netquant.passes.ptq import default_passes
from netquant.passes.settings import QuantSettings
from tests.helpers.ir import make_model

DEFAULT_NAMES = ["graph clean-up", "calibration data", "quantization configs", "calibration", "scale alignment",
                 "bias quantization", "bias correction", "embedding tables", "deployability check"]


def conv_identity_relu() -> onnx.ModelProto:
    """x -> Conv(W, B) -> Identity -> Relu -> y (the Identity is removed by clean-up)."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "W")
    b = numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "B")
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Identity", ["c"], ["i"], name="ident"),
             helper.make_node("Relu", ["i"], ["y"], name="relu")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3 + 1, 8, 8])], [w, b])
    return make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def batches(n: int = 3) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [{"x": rng.standard_normal((2, 3, 8, 8)).astype(np.float32)} for _ in range(n)]


def context(quiet: bool = True) -> tuple[PassContext, QuantSettings]:
    settings = QuantSettings.from_kwargs("tflite_int8", {"quiet": quiet})
    return PassContext(settings=settings, graph=load_onnx(conv_identity_relu())), settings


@dataclass
class Recorder(PassBase):
    """A user pass: records the bias state and observed-tensor count it sees."""

    seen: list[tuple[QuantState, int]] = field(default_factory=list)
    name: ClassVar[str] = "recorder"
    requires: ClassVar[frozenset[Condition]] = frozenset({Condition.BIASES})

    def run(self, ctx: PassContext) -> None:
        qg = ctx.quantized
        self.seen.append((qg.op_configs["conv"].inputs[2].state, qg.calibration.observed_tensors))


class ClaimsCalibrated(PassBase):
    """Declares an ensures it does not establish."""

    name: ClassVar[str] = "liar"
    ensures: ClassVar[frozenset[Condition]] = frozenset({Condition.CALIBRATED})

    def run(self, ctx: PassContext) -> None:
        return None


def test_default_passes_establish_every_condition() -> None:
    ctx, settings = context()
    assert [p.name for p in default_passes(settings, batches())] == DEFAULT_NAMES
    PassManager(default_passes(settings, batches())).run(ctx)
    assert {c: c.unmet(ctx) for c in Condition} == dict.fromkeys(Condition)
    assert list(ctx.timings) == DEFAULT_NAMES and all(t >= 0 for t in ctx.timings.values())


def test_pass_run_before_what_it_requires_is_named() -> None:
    ctx, _ = context()
    with pytest.raises(PassConditionError, match=r"pass 'calibration' \(CalibrationPass\) before: condition "
                                                 r"'quantization configs' does not hold.*BuildConfigsPass"):
        PassManager([CalibrationPass()]).run(ctx)
    assert ctx.timings == {}  # nothing ran


def test_unmet_ensures_is_named_after_the_pass() -> None:
    ctx, _ = context()
    with pytest.raises(PassConditionError, match=r"pass 'liar' \(ClaimsCalibrated\) after: condition 'calibrated'"
                                                 r" does not hold: config of tensor '\w+' is still INITIAL"):
        PassManager([BuildConfigsPass(), ClaimsCalibrated()]).run(ctx)
    assert list(ctx.timings) == ["quantization configs", "liar"]


def test_unchecked_manager_runs_the_same_passes_without_conditions() -> None:
    ctx, _ = context()
    PassManager([BuildConfigsPass(), ClaimsCalibrated()], check=False).run(ctx)
    assert ctx.qgraph is not None and Condition.CALIBRATED.unmet(ctx) is not None


def test_non_pass_objects_are_refused() -> None:
    with pytest.raises(ConfigError, match="PassBase instances, got str"):
        PassManager(["calibration"])  # type: ignore[list-item]


def test_user_pass_runs_after_bias_before_the_deployability_check() -> None:
    rec = Recorder()
    qm = netquant.quantize_onnx(conv_identity_relu(), batches(), "tflite_int8", quiet=True, passes=[rec])
    assert rec.seen == [(QuantState.PASSIVE, qm.qgraph.calibration.observed_tensors)]
    assert list(qm.qgraph.timings) == [*DEFAULT_NAMES[:-1], "recorder", DEFAULT_NAMES[-1]]
    assert set(qm.timings) == {*qm.qgraph.timings, "total", "placement"}  # the accuracy budget ran after the passes


def test_typed_facts_replace_the_info_dict() -> None:
    qm = netquant.quantize_onnx(conv_identity_relu(), batches(), "tflite_int8", quiet=True)
    qg = qm.qgraph
    assert not hasattr(qg, "info")
    assert (qg.cleanup.nodes_before, qg.cleanup.nodes_after) == (3, 2)  # the Identity is gone
    assert qg.fusions == {"relu": "conv"}  # TFLite fuses Conv -> Relu: one quantizer after the Relu
    assert qg.shared_scale_groups == [] and qg.aligned_groups == 0 and qg.bias_scale_adjustments == []
    assert qg.calibration.observed_tensors == 2  # the conv input and the relu output
    assert len(qg.validation_batches) == 3 and qg.sample_inputs is qg.validation_batches[0]
    s = qm.summary()
    assert s["cleanup"] == {"nodes_before": 3, "nodes_after": 2, "simplified": qg.cleanup.simplified}
    assert s["calibration"] == {"observed_tensors": 2, "flat_bounds": qg.calibration.flat_bounds,
                                "executor_runs": qg.calibration.executor_runs, "stack_samples": 1,
                                "stack_blocker": qg.calibration.stack_blocker, "engine": "executor",
                                "engine_note": qg.calibration.engine_note, "exact_reruns": 0, "ort_runs": 0,
                                "sample_workers": 1}
    assert set(s["timings_s"]) == {*DEFAULT_NAMES, "placement", "total"}  # counts are not timings


class Events(ProgressReporter):
    def __init__(self) -> None:
        self.events: list[str] = []

    def start(self, total: int) -> None:
        self.events.append(f"start {total}")

    def begin(self, name: str) -> None:
        self.events.append(f"begin {name}")

    def end(self, name: str, seconds: float) -> None:
        self.events.append(f"end {name}")

    def finish(self) -> None:
        self.events.append("finish")

    def track(self, items, description, total=None):  # type: ignore[no-untyped-def]
        for item in items:
            self.events.append(f"{description} {total}")
            yield item


def test_progress_events_come_from_the_manager_and_tracked_loops() -> None:
    ctx, settings = context()
    ctx.progress = Events()
    PassManager(default_passes(settings, batches(2))).run(ctx)
    events = ctx.progress.events
    assert events[0] == f"start {len(DEFAULT_NAMES)}" and events[-1] == "finish"
    calib = events.index("begin calibration")
    assert events[calib + 1:calib + 4] == ["calibrating 2", "calibrating 2", "end calibration"]
    assert [e for e in events if e.startswith("end ")] == [f"end {n}" for n in DEFAULT_NAMES]


def test_export_takes_the_model_or_its_graph_and_refuses_lookalikes() -> None:
    qm = netquant.quantize_onnx(conv_identity_relu(), batches(), "tflite_int8", quiet=True)
    assert unwrap(qm) is qm.qgraph and unwrap(qm.qgraph) is qm.qgraph
    assert quant_params(qm) == quant_params(qm.qgraph) and quant_params(qm)["platform"] == "tflite_int8"
    fake = SimpleNamespace(graph=qm.graph, op_configs=qm.qgraph.op_configs, quantized_graph=qm.qgraph)
    with pytest.raises(ExportError, match="cannot export a SimpleNamespace: expected a netquant QuantizedModel"):
        quant_params(fake)  # type: ignore[arg-type]
