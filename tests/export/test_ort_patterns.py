"""export.ort_patterns: the QDQ MatMul + bias Add of a static-shape transformer reaches onnxruntime's int8 kernels."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import netquant
from netquant.export.ort_patterns import keep_qdq_matmul_bias_apart
from tests.helpers.ir import make_model
from tests.helpers.transformer_models import SMALL, cosine, small_bert, small_bert_batches


def _session(path: str, level: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
             saved: Path | None = None) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.graph_optimization_level = level
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    if saved is not None:
        so.optimized_model_filepath = str(saved)
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def _weight_dq_feeds_float_matmul(model: onnx.ModelProto) -> list[str]:
    """Float MatMul / Gemm nodes of an optimized graph with an input written by DequantizeLinear (directly or
    through a Reshape)."""
    producer = {o: n for n in model.graph.node for o in n.output}

    def from_dq(name: str) -> bool:
        node = producer.get(name)
        while node is not None and node.op_type == "Reshape":
            node = producer.get(node.input[0])
        return node is not None and node.op_type == "DequantizeLinear"

    return [n.name for n in model.graph.node if n.op_type in ("MatMul", "Gemm") and any(map(from_dq, n.input))]


def _qdq_matmul_add(bias_shared: bool = False, rank: int = 3) -> onnx.ModelProto:
    """x [2, 5, 8] (or [10, 8]) -> Q/DQ -> MatMul(DQ(w int8)) -> Add(b) -> y; with bias_shared, b is also added to
    a second output."""
    rng = np.random.default_rng(0)
    shape = [2, 5, 8] if rank == 3 else [10, 8]
    w = rng.integers(-100, 100, size=(8, 6)).astype(np.int8)
    inits = [numpy_helper.from_array(w, "w_q"), numpy_helper.from_array(np.float32(0.01), "w_s"),
             numpy_helper.from_array(np.int8(0), "w_z"), numpy_helper.from_array(np.float32(0.02), "x_s"),
             numpy_helper.from_array(np.uint8(128), "x_z"),
             numpy_helper.from_array(rng.standard_normal(6).astype(np.float32), "b")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "x_s", "x_z"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "x_s", "x_z"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["wd"]),
             helper.make_node("MatMul", ["xd", "wd"], ["mm"]),
             helper.make_node("Add", ["mm", "b"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*shape[:-1], 6])]
    if bias_shared:
        nodes.append(helper.make_node("Add", ["z", "b"], ["y2"]))
        outputs.append(helper.make_tensor_value_info("y2", TensorProto.FLOAT, [6]))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)]
    if bias_shared:
        inputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [6]))
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    return make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("shared", [False, True])
def test_bias_gets_the_matmul_rank_and_the_same_outputs(tmp_path: Path, shared: bool) -> None:
    model = _qdq_matmul_add(bias_shared=shared)
    before = tmp_path / "before.onnx"
    onnx.save(model, before)
    assert keep_qdq_matmul_bias_apart(model, lambda name: 3 if name == "x" else None) == 1
    onnx.checker.check_model(model, full_check=True)
    after = tmp_path / "after.onnx"
    onnx.save(model, after)
    add = next(n for n in model.graph.node if n.op_type == "Add" and "mm" in n.input)
    bias = next(t for t in model.graph.initializer if t.name == add.input[1])
    assert list(bias.dims) == [1, 1, 6]
    if shared:  # the other reader keeps the 1-D bias
        assert [list(t.dims) for t in model.graph.initializer if t.name == "b"] == [[6]]
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((2, 5, 8)).astype(np.float32)}
    if shared:
        feeds["z"] = rng.standard_normal(6).astype(np.float32)
    off = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    for a, b in zip(_session(str(before), off).run(None, feeds), _session(str(after), off).run(None, feeds),
                    strict=True):
        np.testing.assert_array_equal(a, b)  # exact: the Add broadcasts the same values
    saved = tmp_path / "opt.onnx"
    _session(str(after), saved=saved)
    ops = Counter(n.op_type for n in onnx.load(str(saved)).graph.node)
    assert ops["MatMulIntegerToFloat"] == 1 and ops["Gemm"] == 0, ops
    saved_before = tmp_path / "opt_before.onnx"  # without the rewrite onnxruntime makes a float Gemm
    _session(str(before), saved=saved_before)
    assert Counter(n.op_type for n in onnx.load(str(saved_before)).graph.node)["MatMulIntegerToFloat"] == 0


def test_rank2_and_unknown_ranks_are_left_alone() -> None:
    model = _qdq_matmul_add(rank=2)
    assert keep_qdq_matmul_bias_apart(model, lambda name: 2 if name == "x" else None) == 0
    model = _qdq_matmul_add()
    assert keep_qdq_matmul_bias_apart(model, lambda name: None) == 0
    assert [list(t.dims) for t in model.graph.initializer if t.name == "b"] == [[6]]


@pytest.fixture(scope="module")
def static_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_bert(tmp_path_factory.mktemp("bert") / "bert.onnx", seq=32)


def test_static_shape_bert_runs_int8_kernels_in_onnxruntime(static_bert: Path, tmp_path: Path) -> None:
    calib = small_bert_batches(4)
    qmodel = netquant.quantize_onnx(str(static_bert), calib, objective=None, quiet=True)
    out = tmp_path / "bert_int8.onnx"
    report = qmodel.export(out)
    linears = 4 * SMALL["layers"]
    assert report.int8_kernels == {"MatMulIntegerToFloat": linears}
    saved = tmp_path / "opt.onnx"
    sess = _session(str(out), saved=saved)
    optimized = onnx.load(str(saved))
    assert _weight_dq_feeds_float_matmul(optimized) == []
    assert Counter(n.op_type for n in optimized.graph.node)["DequantizeLinear"] == 0
    feeds = small_bert_batches(1, seed=50)[0]
    ref = _session(str(static_bert)).run(None, feeds)[0]
    assert cosine(sess.run(None, feeds)[0], ref) > 0.999


def test_a_bias_shared_by_matmuls_gets_one_reshaped_copy(tmp_path: Path) -> None:
    """Exporters share equal initializers (e.g. zero biases of freshly initialised layers): the MatMul Adds that read
    one such bias share one reshaped copy, so the file does not grow by a copy per layer."""
    model = _qdq_matmul_add(bias_shared=True)
    g = model.graph
    g.node.extend([helper.make_node("MatMul", ["xd", "wd"], ["mm2"]), helper.make_node("Add", ["mm2", "b"], ["y3"])])
    g.output.append(helper.make_tensor_value_info("y3", TensorProto.FLOAT, [2, 5, 6]))
    before = tmp_path / "before.onnx"
    onnx.save(model, before)
    assert keep_qdq_matmul_bias_apart(model, lambda name: 3 if name == "x" else None) == 2
    copies = [t.name for t in g.initializer if list(t.dims) == [1, 1, 6]]
    assert len(copies) == 1
    assert {n.input[1] for n in g.node if n.op_type == "Add" and n.input[0] in ("mm", "mm2")} == set(copies)
    after = tmp_path / "after.onnx"
    onnx.save(model, after)
    rng = np.random.default_rng(2)
    feeds = {"x": rng.standard_normal((2, 5, 8)).astype(np.float32), "z": rng.standard_normal(6).astype(np.float32)}
    off = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    for a, b in zip(_session(str(before), off).run(None, feeds), _session(str(after), off).run(None, feeds),
                    strict=True):
        np.testing.assert_array_equal(a, b)


def test_gathers_of_one_int8_table_share_one_row_scale_column(tmp_path: Path) -> None:
    """Two Gathers of one per-row int8 table (the optimizer's EmbedLayerNormalization and another Gather read the
    word embeddings): one [V, 1] scale column, and both outputs equal to the DequantizeLinear -> Gather form."""
    from netquant.export.ort_patterns import gather_int8_rows

    rng = np.random.default_rng(0)
    codes = rng.integers(-127, 128, (50, 8)).astype(np.int8)
    scales = (rng.uniform(0.5, 2.0, 50) * 2.0 ** -7).astype(np.float16).astype(np.float32)  # float16-exact
    nodes = [helper.make_node("DequantizeLinear", ["codes", "scale", "zero"], ["table"], axis=0, name="dq"),
             helper.make_node("Gather", ["table", "ids"], ["a"], axis=0, name="g1"),
             helper.make_node("Gather", ["table", "ids2"], ["b"], axis=0, name="g2")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [4]),
                     helper.make_tensor_value_info("ids2", TensorProto.INT64, [3])],
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [4, 8]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, [3, 8])],
        [numpy_helper.from_array(codes, "codes"), numpy_helper.from_array(scales, "scale"),
         numpy_helper.from_array(np.zeros(50, np.int8), "zero")])
    model = make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"ids": np.array([0, 7, 49, 7]), "ids2": np.array([3, 3, 12])}
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    assert gather_int8_rows(model) == 2
    columns = [t for t in model.graph.initializer if list(t.dims) == [50, 1]]
    assert len(columns) == 1 and columns[0].data_type == TensorProto.FLOAT16
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for w, g in zip(want, got, strict=True):
        np.testing.assert_array_equal(w, g)


@pytest.mark.parametrize("kind", ["coded", "shared", "half", "float"])
def test_row_scales_stored_compactly_give_the_dequantize_gather_values(kind: str) -> None:
    """gather_int8_rows stores the per-row scales as uint8 codes c + one step where they are c * step
    (passes.embeddings.coded_row_scales), as one scalar where all rows share a scale, else float16 / float32; the
    gathered rows equal DequantizeLinear -> Gather's bit for bit."""
    from netquant.export.ort_patterns import gather_int8_rows

    rng = np.random.default_rng(1)
    v = 300
    codes = rng.integers(-127, 128, (v, 16)).astype(np.int8)
    step = np.float32(2.0 ** -7 * 1.234375)  # 8 significant bits: c * step exact
    scales = {"coded": rng.integers(1, 256, v).astype(np.float32) * step,
              "shared": np.full(v, 0.0123, np.float32),
              "half": (rng.uniform(0.5, 2.0, v) * 2.0 ** -7).astype(np.float16).astype(np.float32),
              "float": rng.uniform(0.5, 2.0, v).astype(np.float32) * np.float32(1.0 + 2.0 ** -20)}[kind]
    if kind == "coded":
        scales[0] = 255 * step  # the largest row's code is 255
    nodes = [helper.make_node("DequantizeLinear", ["codes", "scale", "zero"], ["table"], axis=0, name="dq"),
             helper.make_node("Gather", ["table", "ids"], ["a"], axis=0, name="g1")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 5])],
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 5, 16])],
        [numpy_helper.from_array(codes, "codes"), numpy_helper.from_array(scales, "scale"),
         numpy_helper.from_array(np.zeros(v, np.int8), "zero")])
    model = make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"ids": rng.integers(0, v, (2, 5))}
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    before = model.ByteSize()
    assert gather_int8_rows(model) == 1
    stored = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.name != "codes"}
    dtypes = sorted(f"{a.dtype.name}{list(a.shape)}" for a in stored.values())
    assert dtypes == {"coded": ["float32[]", f"uint8[{v}, 1]"], "shared": ["float32[]"],
                      "half": [f"float16[{v}, 1]"], "float": [f"float32[{v}, 1]"]}[kind]
    if kind != "float":
        assert model.ByteSize() < before - v * (2 if kind == "half" else 3 if kind == "coded" else 4) + 200
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_array_equal(want, got)
