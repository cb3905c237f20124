"""FP32 calibration statistics from onnxruntime (passes.calib_ort): the scales and zero points of executor-only
calibration, bit for bit, on a CNN with a static batch dim, a hard-swish model whose range end recurs on a rounding
boundary (settled by executor re-runs), and the light models squeezenet / inception_v1 (slow); the rule that settles
a range end from onnxruntime's value, hand-checked."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from netquant.api import quantize_onnx, zoo
from netquant.graph import Executor, load_onnx
from netquant.passes.calib_ort import CalibEngine, LaterBatches, rounded, undecided, zero_end_without_floor
from netquant.passes.flat_ranges import clip_bounds
from netquant.passes.quantizer import GraphIndex
from netquant.passes.value_floors import value_floors
from tests.helpers.export_models import conv_net
from tests.helpers.ir import make_model
from tests.helpers.quant_params import tensor_params as _params


def _both(model: Any, batches: list[Any], **settings: Any) -> tuple[Any, Any]:
    kw = {"objective": None, "quiet": True, "threads": 1, **settings}
    return (quantize_onnx(model, batches, calib_engine="executor", **kw),
            quantize_onnx(model, batches, calib_engine="onnxruntime", **kw))


def _assert_same_params(a_qm: Any, b_qm: Any) -> None:
    a, b = _params(a_qm), _params(b_qm)
    assert a and a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key][0], b[key][0]) and torch.equal(a[key][1], b[key][1]), key


def _images(n: int, shape: tuple[int, ...] = (1, 3, 16, 16), seed: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) * (1 + i % 3) for i in range(n)]


def test_cnn_scales_bit_identical() -> None:
    ex, ort = _both(conv_net(batch=1), _images(20))
    assert ex.qgraph.calibration.engine == "executor" and ex.qgraph.calibration.executor_runs == 20
    c = ort.qgraph.calibration
    assert c.engine == "onnxruntime" and c.engine_note == ""
    # a static batch dim rules out stacking up front: the executor runs the first batch, onnxruntime the other 19
    # (with the graph outputs of the other two validation batches: export validation's FP32 reference)
    assert c.ort_runs == 19 and c.executor_runs == 1 + c.exact_reruns
    _assert_same_params(ex, ort)
    assert len(ort.qgraph.validation_fp32) == len(ex.qgraph.validation_fp32) == 3
    for a, b in zip(ex.qgraph.validation_fp32, ort.qgraph.validation_fp32):
        assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-5) for k in a)


def _hard_swish_model(activation: str = "hard_swish") -> onnx.ModelProto:
    """x[1,8] -> MatMul -> h * HardSigmoid(h) (hard-swish: minimum -0.375 at h = -1.5, a rounding boundary) -> z =
    0.031 * a - 4.7e-5 (PP-OCRv4's learned affine after hard-swish) -> MatMul; activation 'max': a = Max(h, -0.375)
    -> MatMul instead (the same minimum on every batch, a rounding boundary without a floor netquant derives)."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array((rng.standard_normal((8, 4096)) * 0.7).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((4096, 4)).astype(np.float32), "w2")
    consts = [numpy_helper.from_array(np.array(v, np.float32), k)
              for k, v in (("k", [0.03095054]), ("b", [-4.651e-05]), ("m", -0.375))]
    act = ([helper.make_node("HardSigmoid", ["h"], ["g"], alpha=1 / 6, beta=0.5),
            helper.make_node("Mul", ["h", "g"], ["a"])] if activation == "hard_swish" else
           [helper.make_node("Max", ["h", "m"], ["a"])])
    affine = [helper.make_node("Mul", ["k", "a"], ["ka"]), helper.make_node("Add", ["ka", "b"], ["z"])]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), *act, *(affine if activation == "hard_swish" else []),
             helper.make_node("MatMul", ["z" if activation == "hard_swish" else "a", "w2"], ["y"])]
    graph = helper.make_graph(nodes, "hswish", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], [w1, w2, *consts])
    return make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _auto(model: onnx.ModelProto, batches: list[Any], monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr("netquant.passes.calibration.ORT_WORTH_S", 0.0)  # auto's speed rules aside: tiny model
    monkeypatch.setattr("netquant.passes.calibration.ORT_FASTER", math.inf)
    return quantize_onnx(model, batches, objective=None, quiet=True, threads=1, simplify=False)


def test_later_batches_on_onnxruntime_batch_threads_give_the_same_scales(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the policy leaves sample threads, onnxruntime's later batches run on that many threads at once (one
    intra-op thread each): the scales are the executor's, bit for bit, and the threads are gone after."""
    import threading

    import netquant.passes.calibration as calibration

    monkeypatch.setattr(calibration, "sample_workers", lambda: 2)
    ex, on_ort = _both(conv_net(batch=1), _images(20))
    c = on_ort.qgraph.calibration
    assert c.engine == "onnxruntime" and c.sample_workers == 2 and c.ort_runs >= 19
    _assert_same_params(ex, on_ort)
    assert not [t for t in threading.enumerate() if t.name.startswith("netquant-calib-ort")]


def test_hard_swish_minimum_is_settled_by_its_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    model, batches = _hard_swish_model(), _images(12, (1, 8), seed=5)
    graph = load_onnx(model)
    floors = value_floors(graph, lambda n: -math.inf)
    assert floors["a"] == -0.375 and floors["ka"] == float(np.float32(np.float32(0.03095054) * np.float32(-0.375)))
    assert floors["z"] == float(np.float32(floors["ka"]) + np.float32(-4.651e-05))
    # the data reach it: every batch's minimum of a lies within 6e-6 of -0.375 (a rounding boundary: undecided
    # without the floor), none below it (here, on AVX2, one batch's is -0.375 itself and z's the floor of z; a CPU
    # whose MatMul kernels sum x w1 in another order may stop a float step short of it)
    with torch.no_grad():
        runs = [Executor(graph).run({"x": torch.from_numpy(b)}, outputs=["a", "z"]) for b in batches]
    lows = [float(r["a"].min()) for r in runs]
    assert min(lows) >= -0.375 and max(lows) < -0.375 + 6e-6
    assert min(float(r["z"].min()) for r in runs) >= floors["z"]
    ex, ort = _both(model, batches, simplify=False)
    c = ort.qgraph.calibration
    assert c.engine == "onnxruntime" and c.exact_reruns == 0  # no batch goes below the floor: nothing to re-run
    _assert_same_params(ex, ort)
    auto = _auto(model, batches, monkeypatch)
    assert auto.qgraph.calibration.engine == "onnxruntime" and auto.qgraph.calibration.exact_reruns == 0
    _assert_same_params(ex, auto)


def test_range_end_on_a_rounding_boundary_is_settled_by_the_executor(monkeypatch: pytest.MonkeyPatch) -> None:
    model, batches = _hard_swish_model("max"), _images(12, (1, 8), seed=5)
    assert "a" not in value_floors(load_onnx(model), lambda n: -math.inf)  # (Max has no floor here)
    ex, ort = _both(model, batches, simplify=False)
    c = ort.qgraph.calibration
    assert c.engine == "onnxruntime" and c.exact_reruns > 0  # -0.375 +- noise: the executor's value decides
    _assert_same_params(ex, ort)
    auto = _auto(model, batches, monkeypatch)
    assert auto.qgraph.calibration.engine == "executor"
    assert "recurs on a rounding boundary" in auto.qgraph.calibration.engine_note
    _assert_same_params(ex, auto)


@pytest.mark.parametrize(("settings", "why"), [({"range_bits": None}, "range_bits=None"),
                                               ({"activation_observer": "percentile"}, "reads more than the extrema"),
                                               ({"calib_engine": "executor"}, "calib_engine is 'executor'")])
def test_executor_where_onnxruntime_cannot_give_the_statistics(settings: dict[str, Any], why: str) -> None:
    kw = {"calib_engine": "onnxruntime", **settings}
    qm = quantize_onnx(conv_net(batch=1), _images(6), objective=None, quiet=True, threads=1, **kw)
    assert qm.qgraph.calibration.engine == "executor" and why in qm.qgraph.calibration.engine_note
    assert qm.qgraph.calibration.executor_runs == 6


def test_auto_keeps_stacking_where_it_applies() -> None:
    qm = quantize_onnx(conv_net(), _images(20), objective=None, quiet=True, threads=1)
    assert qm.qgraph.calibration.stack_blocker == "" and qm.qgraph.calibration.engine == "executor"


def test_calib_engine_setting_is_checked() -> None:
    from netquant.errors import ConfigError

    assert CalibEngine.parse("onnxruntime") is CalibEngine.ONNXRUNTIME
    with pytest.raises(ConfigError, match="calib_engine must be one of auto, executor, onnxruntime"):
        quantize_onnx(conv_net(batch=1), _images(2), objective=None, quiet=True, calib_engine="ort")


def test_undecided_range_ends_by_hand() -> None:
    # 8 significant bits: 0.5 .. 1 has steps of 2^-8; 0.7 rounds outward to 0.703125 (180 / 256)
    assert rounded(0.7, 8) == 180 / 256 and rounded(180 / 256, 8) == 180 / 256
    # far from a boundary: onnxruntime's max settles it, whatever the executor's value within the margin
    assert undecided(None, [0.5, 0.7], 1e-6, 8) == []
    # at a boundary (179/256 exactly): +-margin rounds to 179/256 or 180/256: the batches that could be the max
    edge = 179 / 256
    assert undecided(None, [0.5, edge, edge - 5e-7], 1e-6, 8) == [1, 2]
    # an exactly known part above every possible value decides it
    assert undecided(0.9, [0.5, edge], 1e-6, 8) == []
    # choose_qparams covers max(hi, 0): ends on the far side of zero are decided
    assert undecided(None, [-0.3, -edge], 1e-6, 8) == []
    # a ReLU's lower end 0 (negated: values <= 0 by the op's definition): decided with the floor, not without
    assert undecided(None, [0.0, 0.0], 1e-6, 8, ceiling=0.0) == []
    assert undecided(None, [0.0, 0.0], 1e-6, 8) == [0, 1]
    # lower ends: LaterBatches negates them; minimum -0.375 is a boundary, a floor of -inf leaves it undecided
    later = LaterBatches()
    for i, lo in enumerate([-0.375, -0.2, -0.37499997]):
        later.add(i, {"t": (lo, 0.7 + 0.01 * i)})  # upper end 0.72: far from a boundary
    assert later.undecided_batches({}, 1e-6, 8, {}) == {"t": {0, 2}}
    assert later.undecided_batches({}, 1e-6, 8, {"t": -0.375}) == {}
    # a graph input's extrema are read from the batch itself: exact, never undecided
    assert later.undecided_batches({}, 1e-6, 8, {}, exact_tensors=frozenset({"t"})) == {}


def test_value_floors_follow_op_definitions() -> None:
    graph = load_onnx(conv_net(batch=1))
    index = GraphIndex(graph)
    floors = value_floors(graph, lambda n: clip_bounds(index, n)[0])
    # Relu -> 0; Add of two ReLUs is not followed (sums can round either way), MaxPool keeps its input's floor
    assert floors["r1"] == 0.0 and floors["r2"] == 0.0 and "s" not in floors and "p" not in floors
    assert "c1" not in floors and "y" not in floors


@pytest.mark.slow
@pytest.mark.parametrize("name", ["squeezenet", "inception_v1"])
def test_light_models_scales_bit_identical(name: str) -> None:
    import onnxruntime as ort

    path, _ = zoo.light_model_path(name)
    inp = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).get_inputs()[0]
    ex, on_ort = _both(str(path), _images(16, tuple(d if isinstance(d, int) else 1 for d in inp.shape)))
    assert on_ort.qgraph.calibration.engine == "onnxruntime"
    _assert_same_params(ex, on_ort)


def test_a_zero_end_without_a_floor_keeps_auto_on_the_executor_before_onnxruntime_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An end at exactly 0 with no floor of 0 is undecided on every batch reaching it (any margin straddles 0), so auto
    decides from the executor's first batches without building a session: shufflenet's Concat of a ReLU'd branch and
    a BatchNormalization output (min 0 on every image)."""
    assert zero_end_without_floor({"c": (0.0, 3.0)}, {}) == "c"  # no floor
    assert zero_end_without_floor({"c": (0.0, 3.0)}, {"c": 0.0}) is None  # a ReLU's floor: decided
    assert zero_end_without_floor({"n": (-2.0, 0.0)}, {}) == "n"  # an upper end at 0
    assert zero_end_without_floor({"x": (0.0, 1.0)}, {}, frozenset({"x"})) is None  # read from the batch itself
    assert zero_end_without_floor({"c": (-0.5, 3.0)}, {}) is None
    import onnxruntime as ort

    monkeypatch.setattr("netquant.passes.calibration.ORT_WORTH_S", 0.0)  # (6 images: worth trying on any CPU)
    path, _ = zoo.light_model_path("shufflenet")
    inp = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).get_inputs()[0]
    qm = quantize_onnx(str(path), _images(6, tuple(d if isinstance(d, int) else 1 for d in inp.shape)), objective=None,
                       quiet=True, threads=1)
    c = qm.qgraph.calibration
    assert c.engine == "executor" and c.ort_runs == 0 and "sits at 0 with no value floor" in c.engine_note


def test_auto_keeps_large_weights_on_the_executor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("netquant.passes.calibration.ORT_WORTH_S", 0.0)
    monkeypatch.setattr("netquant.passes.calibration.AUTO_MAX_WEIGHT_BYTES", 1000)  # conv_net holds ~3.5 kB
    qm = quantize_onnx(conv_net(batch=1), _images(6), objective=None, quiet=True, threads=1)
    assert qm.qgraph.calibration.engine == "executor" and "MiB of weights" in qm.qgraph.calibration.engine_note


@pytest.mark.slow
def test_ppocr_rec_scales_bit_identical(monkeypatch: pytest.MonkeyPatch) -> None:
    # PP-OCRv4 rec: its hard-swish minima behind learned affines (w * h + b) end on a rounding boundary in every
    # batch (the recurring end that kept auto on the executor); their floors, the graph input's exact extrema and each
    # tensor's own noise leave at most one later batch to re-run
    from netquant.data.ocr import rec_batch
    from netquant.data.text_render import make_text_lines

    x = rec_batch(make_text_lines(128, seed=1000))
    batches = [x[i:i + 16] for i in range(0, len(x), 16)]
    path = str(zoo.ppocr_model_path("rec"))
    kw: dict[str, Any] = {"objective": None, "quiet": True, "threads": 1}
    ex = quantize_onnx(path, batches, **kw)  # auto: batches of 16 samples stay on the executor
    assert ex.qgraph.calibration.engine == "executor" and "hold 16 samples" in ex.qgraph.calibration.engine_note
    monkeypatch.setattr("netquant.passes.calibration.ORT_BELOW_SAMPLES", 10 ** 6)  # auto's speed rules aside
    monkeypatch.setattr("netquant.passes.calibration.ORT_FASTER", math.inf)
    auto = quantize_onnx(path, batches, **kw)
    c = auto.qgraph.calibration
    assert c.engine == "onnxruntime" and c.engine_note == "" and c.ort_runs == 6 and c.exact_reruns <= 1
    _assert_same_params(ex, auto)


def test_auto_keeps_batches_of_many_samples_on_the_executor() -> None:
    qm = quantize_onnx(conv_net(), [np.concatenate(_images(8, seed=s)) for s in range(4)], objective=None,
                       quiet=True, threads=1)
    c = qm.qgraph.calibration
    assert c.stack_blocker == "the batches already hold 8 samples" and c.engine == "executor"
    assert "hold 8 samples" in c.engine_note and c.ort_runs == 0


def test_onnxruntime_by_name_runs_where_stacking_would_apply() -> None:
    """calib_engine='onnxruntime' on batches the executor could stack: onnxruntime calibrates (not a silent executor
    run), with the executor's scales bit for bit."""
    batches = _images(12, shape=(1, 3, 16, 16))
    ex, ort = _both(conv_net(), batches)
    assert ex.qgraph.calibration.stack_blocker == ""  # the executor stacks these
    c = ort.qgraph.calibration
    assert c.engine == "onnxruntime" and c.engine_note == "" and c.ort_runs >= 9
    assert c.stack_blocker == "calib_engine is 'onnxruntime': it runs the batches as given"
    _assert_same_params(ex, ort)
