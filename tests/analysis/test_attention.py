"""analysis.attention: transformer ops in int8 or float by measurement, recorded in and re-applied from the placement
file."""

from __future__ import annotations

import copy
import json
from collections import Counter
from pathlib import Path
from typing import Any

import onnx
import pytest

from netquant.analysis.attention import (
    FASTER_SHARE,
    LOSS_FLOOR,
    LOSS_GROWTH,
    PER_TOKEN_GAIN,
    PER_TOKEN_SLOWER,
    calibrated_ranges,
    choose_attention,
    executor_ranges,
)
from netquant.api import quantize_onnx
from netquant.errors import ConfigError
from netquant.export.attention import AttnKind, AttnMode, find_attention_ops, tensors_to_range
from netquant.export.onnx_qdq import build_qdq_model, fp32_onnx
from tests.helpers.transformer_models import SMALL, small_bert, small_bert_batches


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_bert(tmp_path_factory.mktemp("bert") / "bert.onnx", seq=32)


def test_every_kind_is_tried_and_kept_only_by_the_rule(bert: Path) -> None:
    q = quantize_onnx(str(bert), small_bert_batches(4), objective=None, quiet=True)
    base, fp32 = build_qdq_model(q.qgraph)[0], fp32_onnx(q.qgraph)
    batches = small_bert_batches(2, seed=30)
    result = choose_attention(base, onnx.load(str(bert)), fp32, batches[0], batches, all_losses=True)
    tried = {t.kind for t in result.tries}
    assert tried == {k.value for k in AttnKind}  # no dynamic MatMul in this file: no per-token try
    for t in result.tries:
        assert t.ms > 0 and t.current_ms > 0 and t.nodes > 0
        assert t.loss is not None and t.current_loss is not None and t.loss >= 0
        rule = (t.loss <= PER_TOKEN_GAIN * t.current_loss and t.ms <= PER_TOKEN_SLOWER * t.current_ms) \
            if t.kind == "per_token" else \
            (t.ms <= (1 - FASTER_SHARE) * t.current_ms and t.loss <= LOSS_GROWTH * t.current_loss + LOSS_FLOOR)
        assert t.kept == rule, t
    # placement's default: a loss only where the verdict needs it (a try its time rules out records none)
    lean = choose_attention(base, onnx.load(str(bert)), fp32, batches[0], batches)
    for t in lean.tries:
        faster = t.ms <= PER_TOKEN_SLOWER * t.current_ms if t.kind == "per_token" else \
            t.ms <= (1 - FASTER_SHARE) * t.current_ms
        assert (t.loss is not None) == faster and (t.current_loss is not None) == faster, t
        assert t.kept <= faster
    kept = {t.kind for t in result.tries if t.kept}
    kinds = find_attention_ops(base)
    assert set(result.modes) == {n for n, k in kinds.items() if k.value in kept}
    rewrite = result.rewrite()
    if rewrite is None:
        assert not kept
    else:  # the rewrite export applies gives the file the last kept try was measured on
        model = copy.deepcopy(base)
        assert rewrite.apply(model)
        ops = Counter(n.op_type for n in model.graph.node)
        assert ops["QuantizeLinear"] + ops["DynamicQuantizeLinear"] > \
            Counter(n.op_type for n in base.graph.node)["QuantizeLinear"]


def test_the_placement_file_reapplies_the_attention_rewrite(bert: Path, tmp_path: Path) -> None:
    calib = small_bert_batches(4)
    # a generous time cap: on a loaded machine the default cap can pass before the attention setup (then no try runs)
    qm = quantize_onnx(str(bert), calib, objective="balanced", quiet=True, placement_time_s=120.0)
    assert "attention" in qm.placement.measured and qm.placement.measured["attention"]["tries"]
    data = json.loads(qm.placement.to_json())
    # a hand-made decision: every Q·Kᵀ product static, with its calibrated ranges
    fp32 = fp32_onnx(qm.qgraph)
    scores = {n: k for n, k in find_attention_ops(fp32).items() if k is AttnKind.SCORES}
    ranges = calibrated_ranges(fp32, tensors_to_range(fp32, scores), calib)
    data["measured"]["attention"] = {"rewrite": {"modes": [[n, "static"] for n in sorted(scores)], "per_token": False,
                                                 "ranges": [[t, lo, hi] for t, (lo, hi) in sorted(ranges.items())]}}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    again = quantize_onnx(str(bert), calib, quiet=True, placement_from=str(path))
    assert again.qgraph.attention_rewrite is not None
    model = build_qdq_model(again.qgraph)[0]
    added = [n for n in model.graph.node if "/attn_Q/" in n.name]  # Q -> DQ on both inputs of each product
    assert len(added) == 2 * SMALL["layers"] and len(scores) == SMALL["layers"]
    data["measured"]["attention"]["rewrite"]["modes"] = [["x", "int4"]]
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="measured.attention.rewrite is malformed"):
        quantize_onnx(str(bert), calib, quiet=True, placement_from=str(path))


def test_setup_estimate_is_three_fp32_passes_over_the_loss_rows() -> None:
    import numpy as np

    from netquant.analysis.attention import SETUP_PASSES, setup_estimate_s

    batches = [{"ids": np.zeros((16, 32), np.int64)}, {"ids": np.zeros((16, 32), np.int64)}]
    assert SETUP_PASSES == 3 and setup_estimate_s(batches, 10.0) == pytest.approx(0.96)  # 3 x 32 rows x 10 ms


def test_no_attention_setup_where_no_try_could_start_by_the_deadline(bert: Path) -> None:
    import time

    from netquant.analysis.attention import place_attention
    from netquant.analysis.placement.inputs import batch1

    qm = quantize_onnx(str(bert), small_bert_batches(4), quiet=True)
    qg = qm.qgraph
    feeds = batch1(qg.validation_batches[0], qg)
    before = qg.attention_rewrite
    start = time.perf_counter()  # a 10 s batch-1 model cannot set up within 1 s: nothing run, nothing changed
    assert place_attention(qg, feeds, None, 30.0, deadline=start + 1.0, fp32_ms=10_000.0) is None
    assert time.perf_counter() - start < 0.5 and qg.attention_rewrite is before
    got = place_attention(qg, feeds, None, 30.0, deadline=time.perf_counter() + 60.0, fp32_ms=0.01)
    assert got is not None and got.tries  # time enough: measured as before


def test_no_setup_where_no_try_could_rewrite(bert: Path) -> None:
    """A classifier whose only Softmax is its final one (Flatten -> Softmax -> Reshape) has no attention op: a Softmax
    counts only where it feeds an A·V MatMul. A kind with no calibrated range is seen from the structure alone
    (any_static_rewrite), so choose_attention measures nothing; the encoder's tries stay possible."""
    import numpy as np

    from netquant.analysis.attention import any_static_rewrite
    from netquant.api import zoo

    path, _ = zoo.light_model_path("squeezenet")
    rng = np.random.default_rng(0)
    batches = [{"data_0": rng.standard_normal((1, 3, 224, 224)).astype(np.float32)} for _ in range(2)]
    q = quantize_onnx(str(path), batches, objective=None, quiet=True)
    base, fp32 = build_qdq_model(q.qgraph)[0], fp32_onnx(q.qgraph)
    assert [n.op_type for n in base.graph.node].count("Softmax") == 1
    assert find_attention_ops(base) == {}
    result = choose_attention(base, onnx.load(str(path)), fp32, batches[0], batches)
    assert result.tries == [] and result.ranges == {} and result.rewrite() is None

    q = quantize_onnx(str(bert), small_bert_batches(4), objective=None, quiet=True)
    base, fp32 = build_qdq_model(q.qgraph)[0], fp32_onnx(q.qgraph)
    kinds = find_attention_ops(base)
    layers = sum(k is AttnKind.CONTEXT for k in kinds.values())
    assert layers and sum(k is AttnKind.SOFTMAX for k in kinds.values()) == layers  # one Softmax per A·V
    assert any_static_rewrite(base, kinds, fp32)


def test_a_structural_check_sees_kinds_without_calibrated_ranges() -> None:
    """any_static_rewrite from the structure alone: a Softmax with no calibrated range cannot be rewritten, so the
    whole setup is skipped (the classifier's Softmax, forced in as if it were an attention op)."""
    import numpy as np

    from netquant.analysis.attention import any_static_rewrite
    from netquant.api import zoo

    path, _ = zoo.light_model_path("squeezenet")
    rng = np.random.default_rng(0)
    batches = [{"data_0": rng.standard_normal((1, 3, 224, 224)).astype(np.float32)} for _ in range(2)]
    q = quantize_onnx(str(path), batches, objective=None, quiet=True)
    base, fp32 = build_qdq_model(q.qgraph)[0], fp32_onnx(q.qgraph)
    kinds = {n.name: AttnKind.SOFTMAX for n in base.graph.node if n.op_type == "Softmax"}
    assert kinds and not any_static_rewrite(base, kinds, fp32)
    assert calibrated_ranges(fp32, tensors_to_range(base, kinds), batches) == {}


def test_setup_estimate_adds_the_ranges_session_build() -> None:
    import numpy as np

    from netquant.analysis.attention import setup_estimate_s

    batches = [{"ids": np.zeros((16, 32), np.int64)}, {"ids": np.zeros((16, 32), np.int64)}]
    assert setup_estimate_s(batches, 10.0, build_s=2.5) == pytest.approx(0.96 + 2.5)


def test_a_deadline_passed_during_the_setup_skips_the_rest_of_it(bert: Path) -> None:
    """No try could start any more: the ranges' session (the setup's dearest part) is not built, the result is the
    one the whole setup would have given (no tries, no modes)."""
    import time

    q = quantize_onnx(str(bert), small_bert_batches(4), objective=None, quiet=True)
    base, fp32 = build_qdq_model(q.qgraph)[0], fp32_onnx(q.qgraph)
    batches = small_bert_batches(2, seed=30)
    result = choose_attention(base, onnx.load(str(bert)), fp32, batches[0], batches, deadline=time.perf_counter())
    assert result.tries == [] and result.modes == {} and result.ranges == {} and result.rewrite() is None


def test_extra_outputs_appended_as_bytes_parse_to_the_model_with_those_outputs(bert: Path) -> None:
    import numpy as np
    import onnxruntime as ort

    from netquant.graph.light import with_outputs

    model = onnx.load(str(bert))
    names = [model.graph.node[3].output[0], model.graph.node[7].output[0]]
    got = onnx.load_from_string(with_outputs(model, names))
    want = copy.deepcopy(model)
    want.graph.output.extend(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in names)
    assert got.SerializeToString() == want.SerializeToString()
    assert with_outputs(model, []) == model.SerializeToString()
    sess = ort.InferenceSession(with_outputs(model, names), providers=["CPUExecutionProvider"])
    feeds = {k: np.asarray(v) for k, v in small_bert_batches(1)[0].items()}
    outs = sess.run(None, feeds)
    assert [o.name for o in sess.get_outputs()][-2:] == names and len(outs) == len(model.graph.output) + 2


def test_executor_ranges_are_onnxruntimes_ranges_of_the_fp32_graph(bert: Path) -> None:
    """Placement's static ranges come from the executor's FP32 run (no extra onnxruntime session): the same tensors
    and, to float noise, the same min / max as onnxruntime's run of the FP32 graph with those outputs."""
    import numpy as np

    q = quantize_onnx(str(bert), small_bert_batches(4), objective=None, quiet=True)
    base, fp32 = build_qdq_model(q.qgraph)[0], fp32_onnx(q.qgraph)
    batches = small_bert_batches(2, seed=30)
    names = tensors_to_range(base, find_attention_ops(base))
    ort_ranges = calibrated_ranges(fp32, names, batches)
    ours = executor_ranges(q.qgraph, names, batches)
    assert ort_ranges and set(ours) == set(ort_ranges)
    for name, (lo, hi) in ort_ranges.items():
        np.testing.assert_allclose(ours[name], (lo, hi), rtol=1e-4, atol=1e-5, err_msg=name)
    assert executor_ranges(q.qgraph, names, batches) == ours  # one thread: the same values every time


def test_stand_in_ranges_keep_each_zero_points_class(bert: Path) -> None:
    """The ranges a static try is first timed with: the Softmax outputs' (probabilities) give zero point 0 as their
    calibrated ranges do, every other tensor's a nonzero zero point as the calibrated ones (reaching below 0) do;
    scales aside, the stand-in file has the calibrated file's nodes."""
    from netquant.analysis.attention import _zero_point_classes, stand_in_ranges
    from netquant.export.attention import apply_attention

    q = quantize_onnx(str(bert), small_bert_batches(4), objective=None, quiet=True)
    base, fp32 = build_qdq_model(q.qgraph)[0], fp32_onnx(q.qgraph)
    kinds = find_attention_ops(base)
    names = tensors_to_range(base, kinds)
    calibrated = calibrated_ranges(fp32, names, small_bert_batches(2, seed=30))
    stand_in = stand_in_ranges(base, names)
    assert set(calibrated) == set(stand_in) == set(names)
    producer = {o: n.op_type for n in base.graph.node for o in n.output}
    softmax_out = {t for t in names if producer.get(t) == "Softmax"}
    assert softmax_out and all(stand_in[t] == (0.0, 1.0) for t in softmax_out)
    assert _zero_point_classes(stand_in) == _zero_point_classes(calibrated)
    assert {c for t, c in _zero_point_classes(calibrated).items() if t in softmax_out} == {True}
    assert not any(c for t, c in _zero_point_classes(calibrated).items() if t not in softmax_out)
    modes = {n: AttnMode.STATIC for n in kinds}
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    assert apply_attention(a, modes, stand_in) == apply_attention(b, modes, calibrated)
    assert [(n.op_type, list(n.input)) for n in a.graph.node] == [(n.op_type, list(n.input)) for n in b.graph.node]


def _counted_ranges(bert: Path) -> tuple[onnx.ModelProto, onnx.ModelProto, list[dict], list[list[str]], Any]:
    """(QDQ export, FP32 graph, two loss batches, the calls so far, a ranges_of for choose_attention that records
    each call's tensor names and returns their calibrated ranges)."""
    q = quantize_onnx(str(bert), small_bert_batches(4), objective=None, quiet=True)
    base, fp32 = build_qdq_model(q.qgraph)[0], fp32_onnx(q.qgraph)
    batches = small_bert_batches(2, seed=30)
    calls: list[list[str]] = []

    def ranges_of(names: list[str]) -> dict[str, tuple[float, float]]:
        calls.append(names)
        return calibrated_ranges(fp32, names, batches)

    return base, fp32, batches, calls, ranges_of


def test_the_ranges_are_calibrated_only_where_a_static_try_times_faster(bert: Path) -> None:
    """Placement's default: the calibrated ranges (the FP32 runs) are computed once, and only where a static try
    timed faster on its stand-in ranges; with every loss wanted, up front. A kept static try is the file built with
    the calibrated ranges (its rewrite re-applies them)."""
    base, fp32, batches, calls, ranges_of = _counted_ranges(bert)

    lean = choose_attention(base, onnx.load(str(bert)), fp32, batches[0], batches, ranges_of=ranges_of)
    static_faster = [t for t in lean.tries if t.mode == AttnMode.STATIC.value and
                     t.ms <= (1 - FASTER_SHARE) * t.current_ms]
    assert len(calls) == (1 if static_faster else 0)
    assert lean.ranges == (calibrated_ranges(fp32, calls[0], batches) if calls else {})
    for t in lean.tries:
        if t.kept and t.mode == AttnMode.STATIC.value:
            assert lean.rewrite() is not None and lean.rewrite().ranges  # the calibrated ranges of its tensors
    calls.clear()
    full = choose_attention(base, onnx.load(str(bert)), fp32, batches[0], batches, ranges_of=ranges_of,
                            all_losses=True)
    assert len(calls) == 1 and full.ranges and all(t.loss is not None for t in full.tries)


def test_a_try_timed_faster_on_stand_ins_is_measured_on_its_calibrated_file(bert: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Every candidate timed twice as fast (the clock replaced; onnxruntime still runs every loss): the first static
    try calibrates the ranges once, its loss is the calibrated file's (the one export writes from the rewrite: the
    same loss run again on that file), and later tries are built from the calibrated ranges directly."""
    import numpy as np

    import netquant.analysis.attention as attention
    from netquant.analysis.attention import _loss, _outputs

    def clock(models: list[onnx.ModelProto], *args: object, **kwargs: object) -> tuple[float, ...]:
        fewest = min(len(m.graph.node) for m in models)  # the current file: the candidate adds Q/DQ nodes
        return tuple(10.0 if len(m.graph.node) == fewest else 5.0 for m in models)

    monkeypatch.setattr(attention, "wall_clock_ms", clock)
    base, fp32, batches, calls, ranges_of = _counted_ranges(bert)

    reference = onnx.load(str(bert))
    result = choose_attention(base, reference, fp32, batches[0], batches, ranges_of=ranges_of)
    assert len(calls) == 1 and result.ranges == calibrated_ranges(fp32, calls[0], batches)
    static = [t for t in result.tries if t.mode == AttnMode.STATIC.value]
    assert static and all(t.loss is not None for t in static)
    kept = [t for t in result.tries if t.kept]
    assert kept and result.rewrite() is not None
    model = copy.deepcopy(base)
    assert result.rewrite().apply(model)
    ref = _outputs(reference, batches)
    assert np.isclose(_loss(ref, _outputs(model, batches)), kept[-1].loss, rtol=1e-9, atol=1e-12)


def test_a_try_starts_only_where_it_would_end_by_the_deadline() -> None:
    """The first try starts while the deadline has not passed; a later one only where it ends by the deadline taking
    as long as the try before it; no deadline: every try."""
    from netquant.analysis.attention import _can_start

    assert _can_start(10.0, 0.0, 10.0) and not _can_start(10.1, 0.0, 10.0)
    assert _can_start(10.0, 0.3, 10.3) and not _can_start(10.0, 0.31, 10.3)
    assert _can_start(1e9, 1e9, None)
