"""Edge floats (analysis.placement.edges): a ViT-like encoder's patch embedding, a small share of the weights that
reads the pixels, stays float (or weight-only: activations float, weights int8) where the budget measures a large loss
saving; onnxruntime confirms the lower error; the decision is recorded, deterministic and re-applied from its file."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import netquant
from netquant.analysis.placement import FLOAT, WEIGHT_ONLY, Reason
from netquant.analysis.placement.constants import WEIGHT_ONLY_SHARE
from netquant.analysis.placement.edges import edge_candidates
from netquant.analysis.regions import find_regions
from tests.helpers.ir import make_model

C, LAYERS, IMAGE, PATCH = 96, 4, 32, 4
TOKENS = (IMAGE // PATCH) ** 2


def vit_like(seed: int = 0) -> onnx.ModelProto:
    """pixels[N, 3, 32, 32] -> Conv 4x4 stride 4 (the patch embedding, 3 -> C) -> tokens [N, 64, C] -> LAYERS x
    (LayerNorm -> MatMul [C, 4C] -> erf GELU -> MatMul [4C, C] -> + residual) -> y."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in {
        "wp": rng.normal(0, 0.1, (C, 3, PATCH, PATCH)), "bp": rng.normal(0, 0.02, C),
        "shape": np.array([0, C, TOKENS]), "half": np.array(0.5), "one": np.array(1.0),
        "rsqrt2": np.array(1 / np.sqrt(2))}.items()]
    inits[2] = numpy_helper.from_array(np.array([0, C, TOKENS], np.int64), "shape")
    nodes = [helper.make_node("Conv", ["pixels", "wp", "bp"], ["p0"], name="patch", kernel_shape=[PATCH, PATCH],
                              strides=[PATCH, PATCH]),
             helper.make_node("Reshape", ["p0", "shape"], ["p1"], name="flatten"),
             helper.make_node("Transpose", ["p1"], ["h_0"], name="to_tokens", perm=[0, 2, 1])]
    for i in range(LAYERS):
        inits += [numpy_helper.from_array(v.astype(np.float32), f"{k}{i}") for k, v in {
            "g": rng.uniform(0.8, 1.2, C), "b": rng.normal(0, 0.05, C), "w1_": rng.normal(0, 0.02, (C, 4 * C)),
            "w2_": rng.normal(0, 0.02, (4 * C, C))}.items()]
        x, o = f"h_{i}", f"h_{i + 1}"
        nodes += [helper.make_node("LayerNormalization", [x, f"g{i}", f"b{i}"], [f"ln{i}"], name=f"ln{i}", axis=-1),
                  helper.make_node("MatMul", [f"ln{i}", f"w1_{i}"], [f"f{i}"], name=f"fc1_{i}"),
                  helper.make_node("Mul", [f"f{i}", "rsqrt2"], [f"e{i}"], name=f"gs{i}"),
                  helper.make_node("Erf", [f"e{i}"], [f"r{i}"], name=f"erf{i}"),
                  helper.make_node("Add", [f"r{i}", "one"], [f"a{i}"], name=f"ga{i}"),
                  helper.make_node("Mul", [f"f{i}", f"a{i}"], [f"m{i}"], name=f"gm{i}"),
                  helper.make_node("Mul", [f"m{i}", "half"], [f"gelu{i}"], name=f"gh{i}"),
                  helper.make_node("MatMul", [f"gelu{i}", f"w2_{i}"], [f"d{i}"], name=f"fc2_{i}"),
                  helper.make_node("Add", [f"d{i}", x], [o], name=f"res{i}")]
    nodes[-1].output[0] = "y"
    graph = helper.make_graph(nodes, "vit_like", [helper.make_tensor_value_info("pixels", TensorProto.FLOAT,
                                                                                 ["N", 3, IMAGE, IMAGE])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", TOKENS, C])], inits)
    model = make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    return model


def pixels(n: int, seed: int) -> np.ndarray:
    """Normalized images: smooth content plus a few bright pixels (the tail that sets a per-tensor input range)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (n, 3, IMAGE, IMAGE))
    spots = rng.random(x.shape) < 0.002
    return (x + spots * rng.uniform(4, 8, x.shape)).astype(np.float32)


def _loss(model: onnx.ModelProto, path, x: np.ndarray) -> float:
    def run(m):
        s = ort.InferenceSession(m, providers=["CPUExecutionProvider"])
        return s.run(None, {"pixels": x})[0].ravel().astype(np.float64)

    a, b = run(model.SerializeToString()), run(str(path))
    return 1.0 - float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def placed(tmp_path_factory):
    """The model quantized by the rules alone and placed twice; its patch embedding (4,608 weights) counts as large
    enough for weight-only here (WEIGHT_ONLY_MIN_WEIGHTS lowered: ViT-B/16's has 590,592)."""
    import netquant.analysis.placement.search as search

    model = vit_like()
    calib = [pixels(1, s) for s in range(8)]
    folder = tmp_path_factory.mktemp("edges")
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(search, "WEIGHT_ONLY_MIN_WEIGHTS", 1)
        for label, kw in (("rules", {"objective": None}), ("placed", {}), ("again", {})):
            q = netquant.quantize_onnx(model, calib, "onnxruntime_int8", quiet=True, matmul_ranges=False, **kw)
            q.export(folder / f"{label}.onnx")
            out[label] = q
    return model, out, folder


def test_patch_embedding_is_the_only_edge_candidate(placed):
    _, out, _ = placed
    q = out["rules"]
    candidates = edge_candidates(q.qgraph.graph, find_regions(q.qgraph))
    assert list(candidates) == ["patch"]
    assert 0 < candidates["patch"] <= 0.02  # 3 x 16 x 96 of the 4 x 2 x 96 x 384 MatMul weights


def test_edge_weight_only_lowers_the_error_in_onnxruntime_and_keeps_int8_weights(placed):
    """The patch embedding's activations float and its weights int8 keep most of what floating it saves: the file
    holds its weights int8 behind a DequantizeLinear, reading the pixels unquantized."""
    model, out, folder = placed
    p = out["placed"].placement
    patch = next(r for r in p.regions if r.anchor == "patch")
    assert patch.decision == WEIGHT_ONLY and patch.reason == Reason.EDGE_WEIGHT_ONLY
    edge = p.measured["edge_floats"]["patch"]
    base, lf, lw = edge["loss_all_int8"], edge["loss_float"], edge["loss_weight_only"]
    assert edge["weight_only"] and lf <= 0.9 * base and base - lw >= WEIGHT_ONLY_SHARE * (base - lf)
    assert all(r.decision not in (FLOAT, WEIGHT_ONLY) for r in p.regions if r.anchor != "patch")
    assert p.summary()["weight_only_regions"] == 1
    x = pixels(8, 1000)  # held out
    rules, placed_loss = _loss(model, folder / "rules.onnx", x), _loss(model, folder / "placed.onnx", x)
    assert placed_loss < 0.9 * rules  # the pixels' per-tensor error is gone
    g = onnx.load(str(folder / "placed.onnx")).graph
    producer = {o: n for n in g.node for o in n.output}
    conv = next(n for n in g.node if n.op_type == "Conv")
    assert conv.input[0] == "pixels" and producer[conv.input[1]].op_type == "DequantizeLinear"
    weight = next(t for t in g.initializer if t.name == producer[conv.input[1]].input[0])
    assert weight.data_type == TensorProto.INT8 and list(weight.dims) == [C, 3, PATCH, PATCH]


@pytest.mark.parametrize("why", ["keeps too little", "too few weights"])
def test_edge_float_where_weight_only_keeps_too_little_or_saves_too_few_bytes(monkeypatch, tmp_path, why):
    """Where weight-only keeps less than WEIGHT_ONLY_SHARE of floating's saving, or the region holds fewer than
    WEIGHT_ONLY_MIN_WEIGHTS weights (not even measured), the edge is float (FP32 weights in the file)."""
    import netquant.analysis.placement.edges as edges
    import netquant.analysis.placement.search as search

    if why == "keeps too little":
        monkeypatch.setattr(search, "WEIGHT_ONLY_MIN_WEIGHTS", 1)
        monkeypatch.setattr(edges, "WEIGHT_ONLY_SHARE", 1.01)  # never enough
    q = netquant.quantize_onnx(vit_like(), [pixels(1, s) for s in range(8)], "onnxruntime_int8", quiet=True,
                               matmul_ranges=False)
    patch = next(r for r in q.placement.regions if r.anchor == "patch")
    assert patch.decision == FLOAT and patch.reason == Reason.EDGE
    edge = q.placement.measured["edge_floats"]["patch"]
    assert edge.get("weight_only") is (False if why == "keeps too little" else None)
    q.export(tmp_path / "f.onnx")
    g = onnx.load(str(tmp_path / "f.onnx")).graph
    conv = next(n for n in g.node if n.op_type == "Conv")
    assert next(t for t in g.initializer if t.name == conv.input[1]).data_type == TensorProto.FLOAT


def test_the_int8_first_check_times_the_file_with_its_edge_float_and_the_export_reuses_it(monkeypatch, tmp_path):
    """The INT8-first check times the file that ships (the edge float float, not the all-INT8 build) against the
    source; where it decides, that pair is the export's timing (placed_wall_ms; no timing of the export's own).
    Static regions only and no per-region profiles here, so that the INT8-first check is the decision."""
    import netquant.analysis.placement.search as search

    monkeypatch.setattr(search, "choose_dynamic_and_attention", lambda s, placement, *args: placement)
    monkeypatch.setattr(search, "PROFILE_AFTER_SHARE", 0.0)
    q = netquant.quantize_onnx(vit_like(), [pixels(1, s) for s in range(8)], "onnxruntime_int8", quiet=True,
                               matmul_ranges=False)
    m = q.placement.measured
    if m["all_int8_wall_ms"] > m["source_fp32_wall_ms"]:
        pytest.skip("the INT8 file timed slower than FP32 on this CPU: the per-region search decides")
    assert [r.anchor for r in q.placement.regions if r.decision == FLOAT] == ["patch"]
    assert m["placed_wall_ms"] == m["all_int8_wall_ms"]
    assert q.qgraph.whole_model_timing is not None
    report = q.export(tmp_path / "e.onnx")
    assert report.vs_fp32.timed_by == "placement"
    assert report.vs_fp32.int8_ms == pytest.approx(m["placed_wall_ms"], rel=1e-3)
    assert report.vs_fp32.fp32_ms == pytest.approx(m["source_fp32_wall_ms"], rel=1e-3)


def test_a_weight_only_placement_file_is_reapplied_to_the_same_bytes(placed, tmp_path):
    model, out, folder = placed
    out["placed"].placement.save(tmp_path / "p.json")
    again = netquant.quantize_onnx(model, [pixels(1, s) for s in range(8)], "onnxruntime_int8", quiet=True,
                                   matmul_ranges=False, placement_from=str(tmp_path / "p.json"))
    assert next(r for r in again.placement.regions if r.anchor == "patch").decision == WEIGHT_ONLY
    again.export(tmp_path / "again.onnx")
    assert (tmp_path / "again.onnx").read_bytes() == (folder / "placed.onnx").read_bytes()


def test_edge_floats_are_deterministic_and_saved(placed, tmp_path):
    _, out, folder = placed
    a, b = out["placed"].placement, out["again"].placement
    assert a.measured["edge_floats"] == b.measured["edge_floats"]
    # the float decisions (static or dynamic INT8 follows the timings: analysis.placement.dynamic)
    assert [r.anchor for r in a.regions if r.decision == WEIGHT_ONLY] == [r.anchor for r in b.regions
                                                                          if r.decision == WEIGHT_ONLY] == ["patch"]
    a.save(tmp_path / "p.json")
    text = (tmp_path / "p.json").read_text()
    assert "edge_floats" in text and Reason.EDGE_WEIGHT_ONLY in text


def test_an_all_int8_loss_at_float_noise_tries_no_edge_and_measures_no_sensitivity() -> None:
    """squeezenet with its test-data weights (every element 0.02): all INT8 gives FP32's output to float precision
    (loss ~1e-32), so no edge float is tried and the report measures no sensitivity (gains of float noise)."""
    from netquant.analysis.placement.constants import LOSS_NOISE
    from netquant.api import quantize_onnx, zoo

    path, _ = zoo.light_model_path("squeezenet")
    shape = [d if isinstance(d, int) else 1 for d in ort.InferenceSession(str(path)).get_inputs()[0].shape]
    rng = np.random.default_rng(0)
    qm = quantize_onnx(str(path), [rng.standard_normal(shape).astype(np.float32) for _ in range(4)], quiet=True)
    p = qm.placement
    assert p.measured["loss_all_int8"] <= LOSS_NOISE and "edge_floats" not in p.measured
    assert all(r.gain is None and r.loss_only is None for r in p.regions)


def test_a_placement_file_naming_an_unknown_weight_only_region_is_refused(placed, tmp_path):
    """A weight-only decision for a region this quantized graph lacks: ConfigError naming the file and the region."""
    from netquant.errors import ConfigError

    model, out, _ = placed
    p = out["placed"].placement
    patch = next(r for r in p.regions if r.anchor == "patch")
    patch.anchor = "no_such_conv"
    try:
        p.save(tmp_path / "bad.json")
    finally:
        patch.anchor = "patch"
    with pytest.raises(ConfigError, match=r"bad\.json.*no_such_conv.*weight-only.*measure\s+again"):
        netquant.quantize_onnx(model, [pixels(1, s) for s in range(8)], "onnxruntime_int8", quiet=True,
                               matmul_ranges=False, placement_from=str(tmp_path / "bad.json"))
