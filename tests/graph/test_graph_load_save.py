"""Loading and saving: errors on bad files, external data, opsets 7..newest, atomic checked writes."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nh

from netquant.errors import ModelError
from netquant.graph import Executor, Node, load_onnx, save_onnx, to_onnx
from tests.helpers.graph_helpers import ort_run
from tests.helpers.ir import make_model

RNG = np.random.default_rng(1)


def small_model() -> onnx.ModelProto:
    w = RNG.standard_normal((4, 6)).astype(np.float32)
    nodes = [oh.make_node("MatMul", ["x", "w"], ["m"], name="mm"), oh.make_node("Relu", ["m"], ["y"], name="relu")]
    graph = oh.make_graph(nodes, "small", [oh.make_tensor_value_info("x", TP.FLOAT, ["N", 4])],
                          [oh.make_tensor_value_info("y", TP.FLOAT, ["N", 6])], [nh.from_array(w, "w")])
    model = make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_malformed_protobuf_names_the_file(tmp_path) -> None:
    bad = tmp_path / "broken.onnx"
    bad.write_bytes(b"\x08\x07\x12\xff\xff\xff garbage that is not a protobuf" * 3)
    with pytest.raises(ModelError, match="broken.onnx"):
        load_onnx(bad)
    trunc = tmp_path / "truncated.onnx"
    trunc.write_bytes(small_model().SerializeToString()[:-7])
    with pytest.raises(ModelError, match="truncated.onnx"):
        load_onnx(trunc)


def test_missing_file() -> None:
    with pytest.raises(ModelError, match="not found"):
        load_onnx("/nonexistent/model.onnx")


def test_missing_initializer_names_node_and_value() -> None:
    model = small_model()
    del model.graph.initializer[:]
    with pytest.raises(ModelError, match=r"'mm'.*'w'.*missing initializer"):
        load_onnx(model)


def test_cycle_is_reported() -> None:
    nodes = [oh.make_node("Relu", ["b"], ["a"], name="first"), oh.make_node("Relu", ["a"], ["b"], name="second"),
             oh.make_node("Add", ["x", "a"], ["y"], name="out")]
    graph = oh.make_graph(nodes, "cyc", [oh.make_tensor_value_info("x", TP.FLOAT, [1])],
                          [oh.make_tensor_value_info("y", TP.FLOAT, [1])])
    with pytest.raises(ModelError, match=r"cycle.*first.*second"):
        load_onnx(make_model(graph, opset_imports=[oh.make_opsetid("", 17)]))


def test_no_graph() -> None:
    with pytest.raises(ModelError, match="no graph"):
        load_onnx(onnx.ModelProto())


def test_unsorted_file_is_sorted_on_load() -> None:
    model = small_model()
    nodes = list(model.graph.node)[::-1]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    graph = load_onnx(model)
    assert [n.name for n in graph.nodes] == ["mm", "relu"]


def test_external_data_round_trip(tmp_path) -> None:
    model = small_model()
    graph = load_onnx(model)
    graph.initializers["w"] = torch.from_numpy(RNG.standard_normal((4, 6)).astype(np.float32))
    path = tmp_path / "ext" / "model.onnx"
    save_onnx(graph, path, external_data=True, check=True, size_threshold=0)
    assert (tmp_path / "ext" / "model.onnx.data").stat().st_size == 4 * 6 * 4
    assert os.path.getsize(path) < 1000
    back = load_onnx(path)
    assert torch.equal(back.initializers["w"], graph.initializers["w"])
    # the files it was read from, for the no-overwrite check (api: the model is not parsed again for them)
    assert back.model_info.data_files == [os.path.abspath(tmp_path / "ext" / "model.onnx.data")]
    assert load_onnx(model).model_info.data_files == []
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    np.testing.assert_allclose(Executor(back).run([x])["y"].numpy(), ort_run(str(path), {"x": x})[0], rtol=1e-6)
    with torch.no_grad():
        expected = torch.relu(torch.from_numpy(x) @ graph.initializers["w"])
    np.testing.assert_allclose(ort_run(str(path), {"x": x})[0], expected.numpy(), rtol=1e-6)
    # no temp files left behind
    assert sorted(p.name for p in (tmp_path / "ext").iterdir()) == ["model.onnx", "model.onnx.data"]


def test_external_data_missing_file_is_model_error(tmp_path) -> None:
    path = tmp_path / "m.onnx"
    save_onnx(load_onnx(small_model()), path, external_data=True, size_threshold=0)
    os.remove(tmp_path / "m.onnx.data")
    with pytest.raises(ModelError, match="m.onnx"):
        load_onnx(path)


def test_invalid_graph_is_not_written(tmp_path) -> None:
    graph = load_onnx(small_model())
    graph.nodes.append(Node("bad", "Relu", inputs=["does_not_exist"], outputs=["z"]))
    path = tmp_path / "out.onnx"
    with pytest.raises(ModelError, match="onnx.checker"):
        save_onnx(graph, path)
    assert list(tmp_path.iterdir()) == []


def test_save_overwrites_atomically(tmp_path) -> None:
    path = tmp_path / "m.onnx"
    path.write_bytes(b"old")
    save_onnx(load_onnx(small_model()), path)
    assert onnx.load(str(path)).graph.name == "small"
    assert [p.name for p in tmp_path.iterdir()] == ["m.onnx"]


def _opset_model(opset: int) -> onnx.ModelProto:
    """Conv -> BatchNorm -> Relu -> MaxPool -> Reshape -> Gemm -> Softmax, valid at every opset >= 7."""
    inits = [nh.from_array(RNG.standard_normal((4, 2, 3, 3)).astype(np.float32), "W"),
             nh.from_array(RNG.standard_normal(4).astype(np.float32), "Bc"),
             nh.from_array(RNG.uniform(0.5, 1.5, 4).astype(np.float32), "g"),
             nh.from_array(RNG.standard_normal(4).astype(np.float32), "b"),
             nh.from_array(RNG.standard_normal(4).astype(np.float32), "mu"),
             nh.from_array(RNG.uniform(0.5, 1.5, 4).astype(np.float32), "var"),
             nh.from_array(np.array([2, 36], np.int64), "shape"),
             nh.from_array(RNG.standard_normal((36, 5)).astype(np.float32), "Wfc"),
             nh.from_array(RNG.standard_normal(5).astype(np.float32), "Bfc")]
    nodes = [oh.make_node("Conv", ["x", "W", "Bc"], ["c"], pads=[1, 1, 1, 1]),
             oh.make_node("BatchNormalization", ["c", "g", "b", "mu", "var"], ["bn"]),
             oh.make_node("Relu", ["bn"], ["r"]),
             oh.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             oh.make_node("Reshape", ["p", "shape"], ["f"]),
             oh.make_node("Gemm", ["f", "Wfc", "Bfc"], ["g_out"]),
             oh.make_node("Softmax", ["g_out"], ["y"], axis=1)]
    graph = oh.make_graph(nodes, f"opset{opset}", [oh.make_tensor_value_info("x", TP.FLOAT, [2, 2, 6, 6])],
                          [oh.make_tensor_value_info("y", TP.FLOAT, [2, 5])], inits)
    opsets = [oh.make_opsetid("", opset)]
    model = make_model(graph, opset_imports=opsets)
    model.ir_version = oh.find_min_ir_version_for(opsets)
    if model.ir_version < 4:  # initializers must be listed among the inputs too
        for init in inits:
            model.graph.input.append(oh.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    onnx.checker.check_model(model)
    return model


@pytest.mark.parametrize("opset", range(7, onnx.defs.onnx_opset_version() + 1))
def test_every_opset_loads_runs_and_round_trips(opset: int) -> None:
    model = _opset_model(opset)
    x = RNG.standard_normal((2, 2, 6, 6)).astype(np.float32)
    graph = load_onnx(model)
    assert graph.opset == opset
    got = Executor(graph).run([x])["y"].numpy()
    back = to_onnx(graph)
    assert back.ir_version == model.ir_version and back.opset_import[0].version == opset
    try:
        ref = ort_run(model, {"x": x})[0]
    except Exception:  # onnxruntime lags behind the newest onnx opsets
        ref = ort_run(_opset_model_like(model, 21), {"x": x})[0]
    else:
        np.testing.assert_array_equal(ort_run(back, {"x": x})[0], ref)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def _opset_model_like(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.opset_import[0].version = opset
    m.ir_version = oh.find_min_ir_version_for(list(m.opset_import))
    return m


def test_ir3_initializers_listed_as_inputs_survive() -> None:
    """ir_version 3 models list initializers among the inputs; they are not inputs of the Graph, and
    a save writes them back as inputs so old runtimes still accept the file."""
    model = _opset_model(8)
    assert model.ir_version == 3
    graph = load_onnx(model)
    assert graph.input_names == ["x"]
    back = to_onnx(graph)
    assert {i.name for i in back.graph.input} == {i.name for i in model.graph.input}


def test_attributes_and_doc_strings_preserved() -> None:
    model = _opset_model(13)
    model.graph.node[0].doc_string = "the first conv"
    model.doc_string = "model doc"
    back = to_onnx(load_onnx(model))
    assert back.graph.node[0].doc_string == "the first conv" and back.doc_string == "model doc"
    for a, b in zip(model.graph.node, back.graph.node):
        assert [oh.get_attribute_value(x) for x in a.attribute] == [oh.get_attribute_value(x) for x in b.attribute]


def test_value_info_from_shape_inference() -> None:
    graph = load_onnx(_opset_model(13))
    assert graph.value_info["c"].shape == (2, 4, 6, 6) and graph.value_info["c"].dtype == torch.float32
    assert graph.value_info["p"].shape == (2, 4, 3, 3)


def test_float16_bfloat16_and_int4_initializers_round_trip() -> None:
    f16 = RNG.standard_normal((3, 2)).astype(np.float16)
    bf16 = oh.make_tensor("bf", TP.BFLOAT16, [4], [1.0, -2.5, 3.25, 0.0078125])
    i4 = oh.make_tensor("i4", TP.INT4, [5], [-8, -1, 0, 3, 7])
    nodes = [oh.make_node("Cast", ["h"], ["h32"], to=TP.FLOAT), oh.make_node("Cast", ["bf"], ["bf32"], to=TP.FLOAT),
             oh.make_node("Identity", ["i4"], ["i4_out"])]
    graph = oh.make_graph(nodes, "types", [], [oh.make_tensor_value_info("h32", TP.FLOAT, [3, 2]),
                                               oh.make_tensor_value_info("bf32", TP.FLOAT, [4]),
                                               oh.make_tensor_value_info("i4_out", TP.INT4, [5])],
                          [nh.from_array(f16, "h"), bf16, i4])
    model = make_model(graph, opset_imports=[oh.make_opsetid("", 21)])
    model.ir_version = 10
    g = load_onnx(model)
    assert g.initializers["h"].dtype == torch.float16 and g.initializers["bf"].dtype == torch.bfloat16
    assert g.initializers["i4"].tolist() == [-8, -1, 0, 3, 7]
    back = to_onnx(g)
    by_name = {t.name: t for t in back.graph.initializer}
    assert by_name["i4"].data_type == TP.INT4 and by_name["bf"].data_type == TP.BFLOAT16
    for name in ("h", "bf", "i4"):
        orig = next(t for t in model.graph.initializer if t.name == name)
        assert np.array_equal(nh.to_array(orig).astype(np.float32), nh.to_array(by_name[name]).astype(np.float32))


def test_overridable_initializer_inputs_survive_ir4() -> None:
    """ir_version >= 4: an input that names an initializer is a default the caller may override."""
    model = small_model()
    model.graph.input.append(oh.make_tensor_value_info("w", TP.FLOAT, [4, 6]))
    graph = load_onnx(model)
    assert graph.input_names == ["x"]
    back = to_onnx(graph)
    assert [i.name for i in back.graph.input] == ["x", "w"]
    x = RNG.standard_normal((2, 4)).astype(np.float32)
    w = np.ones((4, 6), np.float32)
    np.testing.assert_allclose(ort_run(back, {"x": x, "w": w})[0], np.maximum(x @ w, 0), rtol=1e-6)
    np.testing.assert_allclose(Executor(graph).run({"x": x, "w": w})["y"].numpy(), np.maximum(x @ w, 0), rtol=1e-6)


def test_large_model_code_paths(tmp_path, monkeypatch) -> None:
    """Above the 2 GiB protobuf limit, checking, shape inference and saving go through files and
    external data.  Exercised here by lowering the limit instead of building a 2 GiB model."""
    from netquant.graph import save as save_mod
    from netquant.graph import shape_inference

    monkeypatch.setattr(save_mod, "_PROTO_LIMIT", 10)
    monkeypatch.setattr(shape_inference, "_PROTO_LIMIT", 10)
    model = _opset_model(17)
    graph = load_onnx(model)
    assert graph.value_info["c"].shape == (2, 4, 6, 6)  # inferred with the weights stripped
    path = tmp_path / "big.onnx"
    save_onnx(graph, path, size_threshold=64)  # automatically external (small shape tensors inline)
    assert (tmp_path / "big.onnx.data").exists()
    x = RNG.standard_normal((2, 2, 6, 6)).astype(np.float32)
    np.testing.assert_array_equal(ort_run(str(path), {"x": x})[0], ort_run(model, {"x": x})[0])
