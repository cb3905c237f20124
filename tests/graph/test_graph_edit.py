"""Clean-ups and rewrites: BatchNorm folding, constant folding, Identity/Dropout removal, Constant nodes,
pattern matching.  Every edited graph is saved (onnx.checker) and run in onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nh

from netquant.api.zoo import light_model_path, ppocr_model_path
from netquant.graph import Executor, load_onnx, save_onnx, to_onnx
from netquant.graph.edit import (
    cleanup,
    constants_to_initializers,
    fold_batchnorm,
    fold_constants,
    fold_conv_affine,
    remove_identity,
)
from netquant.graph.pattern import match_chains
from tests.helpers.graph_helpers import ort_run, ppocr_input, rel_err
from tests.helpers.ir import make_model

RNG = np.random.default_rng(3)


def _bn_inits(c: int, prefix: str = "bn") -> list[onnx.TensorProto]:
    return [nh.from_array(RNG.uniform(0.5, 2.0, c).astype(np.float32), f"{prefix}_g"),
            nh.from_array(RNG.standard_normal(c).astype(np.float32), f"{prefix}_b"),
            nh.from_array(RNG.standard_normal(c).astype(np.float32), f"{prefix}_m"),
            nh.from_array(RNG.uniform(0.1, 3.0, c).astype(np.float32), f"{prefix}_v")]


def _bn(inp: str, out: str, prefix: str = "bn") -> onnx.NodeProto:
    return oh.make_node("BatchNormalization", [inp, f"{prefix}_g", f"{prefix}_b", f"{prefix}_m", f"{prefix}_v"],
                        [out], name=prefix, epsilon=1e-3)


def _model(nodes, inputs, outputs, inits, opset: int = 17) -> onnx.ModelProto:
    model = make_model(oh.make_graph(nodes, "m", inputs, outputs, inits),
                          opset_imports=[oh.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _check_same(model: onnx.ModelProto, edited: onnx.ModelProto, feeds: dict[str, np.ndarray],
                tol: float = 1e-5) -> None:
    for a, b in zip(ort_run(model, feeds), ort_run(edited, feeds)):
        assert rel_err(b, a) <= tol, rel_err(b, a)


def conv_bn_relu_model(bias: bool, transpose: bool = False, group: int = 1) -> onnx.ModelProto:
    cin, cout = 4, 6
    if transpose:
        w = RNG.standard_normal((cin, cout // group, 3, 3)).astype(np.float32)
    else:
        w = RNG.standard_normal((cout, cin // group, 3, 3)).astype(np.float32)
    inits = [nh.from_array(w, "W"), *_bn_inits(cout)]
    conv_in = ["x", "W"]
    if bias:
        inits.append(nh.from_array(RNG.standard_normal(cout).astype(np.float32), "B"))
        conv_in.append("B")
    nodes = [oh.make_node("ConvTranspose" if transpose else "Conv", conv_in, ["c"], name="conv", group=group),
             _bn("c", "n"), oh.make_node("Relu", ["n"], ["y"], name="relu")]
    return _model(nodes, [oh.make_tensor_value_info("x", TP.FLOAT, [2, cin, 7, 7])],
                  [oh.make_tensor_value_info("y", TP.FLOAT, ["n", "c", "h", "w"])], inits)


@pytest.mark.parametrize(("bias", "transpose", "group"),
                         [(True, False, 1), (False, False, 1), (True, False, 2), (True, True, 1), (False, True, 2)])
def test_fold_bn_into_conv(bias: bool, transpose: bool, group: int, tmp_path) -> None:
    model = conv_bn_relu_model(bias, transpose, group)
    g = load_onnx(model)
    assert fold_batchnorm(g) == 1
    assert [n.op_type for n in g.nodes] == ["ConvTranspose" if transpose else "Conv", "Relu"]
    assert not any(k.startswith("bn_") for k in g.initializers)
    save_onnx(g, tmp_path / "folded.onnx")
    x = RNG.standard_normal((2, 4, 7, 7)).astype(np.float32)
    _check_same(model, onnx.load(str(tmp_path / "folded.onnx")), {"x": x})


@pytest.mark.parametrize(("trans_b", "c_shape", "beta"), [(0, (5,), 1.0), (1, (1, 5), 0.5), (1, None, 1.0),
                                                          (0, (3, 5), 2.0)])
def test_fold_bn_into_gemm(trans_b: int, c_shape, beta: float) -> None:
    b = RNG.standard_normal((5, 4) if trans_b else (4, 5)).astype(np.float32)
    inits = [nh.from_array(b, "Bw"), *_bn_inits(5)]
    ins = ["a", "Bw"]
    if c_shape is not None:
        inits.append(nh.from_array(RNG.standard_normal(c_shape).astype(np.float32), "C"))
        ins.append("C")
    nodes = [oh.make_node("Gemm", ins, ["g"], name="gemm", transB=trans_b, beta=beta, alpha=0.75), _bn("g", "y")]
    model = _model(nodes, [oh.make_tensor_value_info("a", TP.FLOAT, [3, 4])],
                   [oh.make_tensor_value_info("y", TP.FLOAT, [3, 5])], inits)
    g = load_onnx(model)
    assert fold_batchnorm(g) == 1 and [n.op_type for n in g.nodes] == ["Gemm"]
    _check_same(model, to_onnx(g), {"a": RNG.standard_normal((3, 4)).astype(np.float32)})


def test_bn_not_folded_when_conv_output_has_other_readers() -> None:
    model = conv_bn_relu_model(True)
    model.graph.node.append(oh.make_node("Sigmoid", ["c"], ["s"], name="side"))
    model.graph.output.append(oh.make_tensor_value_info("s", TP.FLOAT, ["n", "c", "h", "w"]))
    g = load_onnx(model)
    assert fold_batchnorm(g) == 0 and len(g.nodes) == 4


def test_shared_weight_is_not_modified_in_place() -> None:
    model = conv_bn_relu_model(True)
    model.graph.node.append(oh.make_node("Conv", ["x", "W"], ["c2"], name="conv2"))
    model.graph.output.append(oh.make_tensor_value_info("c2", TP.FLOAT, ["n", "c", "h", "w"]))
    g = load_onnx(model)
    assert fold_batchnorm(g) == 1
    assert g.node("conv2").inputs[1] == "W" and g.node("conv").inputs[1] != "W"
    _check_same(model, to_onnx(g), {"x": RNG.standard_normal((2, 4, 7, 7)).astype(np.float32)})


@pytest.mark.parametrize("which", ["cls", "det"])
def test_fold_bn_and_cleanup_on_ppocr_match_onnxruntime(which: str, tmp_path) -> None:
    path = ppocr_model_path(which)
    g = load_onnx(path)
    n_bn = sum(n.op_type == "BatchNormalization" for n in g.nodes)
    original = len(g.nodes)
    n_conv_bn = len(match_chains(g, ["Conv", "BatchNormalization"]))
    assert fold_batchnorm(g) == n_conv_bn > 0
    assert sum(n.op_type == "BatchNormalization" for n in g.nodes) == n_bn - n_conv_bn
    cleanup(g)
    assert len(g.nodes) < original - n_conv_bn  # Constant (and Identity) nodes are gone too
    save_onnx(g, tmp_path / "edited.onnx")
    x = ppocr_input(which)
    ref = ort_run(str(path), {"x": x})[0]
    assert rel_err(ort_run(str(tmp_path / "edited.onnx"), {"x": x})[0], ref) <= 1e-4
    assert rel_err(Executor(g).run([x])[g.outputs[0].name].numpy(), ref) <= 1e-4


def test_fold_constants_on_light_resnet50(tmp_path) -> None:
    """The light models compute their weights with ConstantOfShape: folding turns them into initializers."""
    model_path, _ = light_model_path("squeezenet")
    g = load_onnx(model_path)
    n_cos = sum(n.op_type == "ConstantOfShape" for n in g.nodes)
    assert fold_constants(g) == n_cos > 0
    assert all(n.op_type != "ConstantOfShape" for n in g.nodes)
    save_onnx(g, tmp_path / "folded.onnx")
    model = onnx.load(str(model_path))
    from tests.helpers.graph_helpers import light_input

    x = light_input(model)
    name = g.inputs[0].name
    for a, b in zip(ort_run(model, {name: x}), ort_run(str(tmp_path / "folded.onnx"), {name: x})):
        np.testing.assert_array_equal(a, b)


def test_fold_constants_arithmetic_and_shape_chain() -> None:
    inits = [nh.from_array(np.array([1.0, 2.0, 3.0, 4.0], np.float32), "c1"),
             nh.from_array(np.array([2, 2], np.int64), "shp")]
    nodes = [oh.make_node("Constant", [], ["k"], value_float=3.0),
             oh.make_node("Mul", ["c1", "k"], ["c2"]), oh.make_node("Reshape", ["c2", "shp"], ["c3"]),
             oh.make_node("Add", ["x", "c3"], ["y"], name="add")]
    model = _model(nodes, [oh.make_tensor_value_info("x", TP.FLOAT, [2, 2])],
                   [oh.make_tensor_value_info("y", TP.FLOAT, [2, 2])], inits)
    g = load_onnx(model)
    assert fold_constants(g) == 2
    assert [n.name for n in g.nodes] == ["add"]
    np.testing.assert_array_equal(g.initializers["c3"].numpy(), [[3, 6], [9, 12]])
    assert set(g.initializers) == {"c3"}  # the inputs of folded nodes are gone
    _check_same(model, to_onnx(g), {"x": np.ones((2, 2), np.float32)}, tol=0)


def test_random_ops_are_not_folded() -> None:
    nodes = [oh.make_node("RandomUniform", [], ["r"], shape=[2]), oh.make_node("Add", ["x", "r"], ["y"])]
    model = _model(nodes, [oh.make_tensor_value_info("x", TP.FLOAT, [2])],
                   [oh.make_tensor_value_info("y", TP.FLOAT, [2])], [])
    g = load_onnx(model)
    assert fold_constants(g) == 0 and len(g.nodes) == 2


def test_remove_identity_and_dropout() -> None:
    inits = [nh.from_array(np.array(0.5, np.float32), "ratio")]
    nodes = [oh.make_node("Identity", ["x"], ["i1"], name="id1"),
             oh.make_node("Dropout", ["i1", "ratio"], ["d"], name="drop"),
             oh.make_node("Relu", ["d"], ["r"], name="relu"),
             oh.make_node("Dropout", ["r"], ["d2", "mask"], name="drop_mask"),  # mask used: must stay
             oh.make_node("Cast", ["mask"], ["m"], to=TP.FLOAT),
             oh.make_node("Identity", ["d2"], ["y"], name="id_out")]            # graph output
    model = _model(nodes, [oh.make_tensor_value_info("x", TP.FLOAT, [4])],
                   [oh.make_tensor_value_info("y", TP.FLOAT, [4]), oh.make_tensor_value_info("m", TP.FLOAT, [4])],
                   inits)
    g = load_onnx(model)
    assert remove_identity(g) == 3
    assert [n.name for n in g.nodes] == ["relu", "drop_mask", "Cast_4"]
    assert g.node("drop_mask").outputs[0] == "y"
    _check_same(model, to_onnx(g), {"x": np.array([-1.0, 2.0, -3.0, 4.0], np.float32)}, tol=0)


def test_identity_between_graph_input_and_output_stays() -> None:
    model = _model([oh.make_node("Identity", ["x"], ["y"])], [oh.make_tensor_value_info("x", TP.FLOAT, [1])],
                   [oh.make_tensor_value_info("y", TP.FLOAT, [1])], [])
    g = load_onnx(model)
    assert remove_identity(g) == 0 and len(g.nodes) == 1


def test_constants_to_initializers_all_kinds() -> None:
    nodes = [oh.make_node("Constant", [], ["a"], value=nh.from_array(np.array([1.5, 2.5], np.float32))),
             oh.make_node("Constant", [], ["b"], value_floats=[1.0, 2.0]),
             oh.make_node("Constant", [], ["c"], value_int=3),
             oh.make_node("Constant", [], ["d"], value_ints=[4, 5]),
             oh.make_node("Add", ["a", "b"], ["ab"]), oh.make_node("Add", ["c", "d"], ["cd"]),
             oh.make_node("Cast", ["cd"], ["cdf"], to=TP.FLOAT), oh.make_node("Add", ["ab", "cdf"], ["y"])]
    model = _model(nodes, [], [oh.make_tensor_value_info("y", TP.FLOAT, [2])], [])
    g = load_onnx(model)
    assert constants_to_initializers(g) == 4
    assert g.initializers["c"].dtype.is_floating_point is False and g.initializers["c"].shape == ()
    _check_same(model, to_onnx(g), {}, tol=0)
    np.testing.assert_array_equal(Executor(g).run({})["y"].numpy(), [9.5, 12.5])


def test_match_chains() -> None:
    model = conv_bn_relu_model(True)
    g = load_onnx(model)
    chains = match_chains(g, ["Conv", "BatchNormalization", "Relu"])
    assert [[n.name for n in c] for c in chains] == [["conv", "bn", "relu"]]
    assert match_chains(g, ["Conv", "BatchNormalization", "Relu|Clip"]) == chains
    assert match_chains(g, ["Conv", {"Sigmoid"}]) == []
    assert len(match_chains(g, [lambda n: n.op_type.startswith("Conv")])) == 1
    # a second reader of the conv output breaks the chain
    model.graph.node.append(oh.make_node("Sigmoid", ["c"], ["s"]))
    model.graph.output.append(oh.make_tensor_value_info("s", TP.FLOAT, ["n", "c", "h", "w"]))
    assert match_chains(load_onnx(model), ["Conv", "BatchNormalization"]) == []


def test_match_chains_on_ppocr_cls() -> None:
    g = load_onnx(ppocr_model_path("cls"))
    assert len(match_chains(g, ["Conv", "BatchNormalization"])) == 35
    chains = match_chains(g, ["Conv", "BatchNormalization", "Relu|HardSigmoid|Clip"])
    assert len(chains) >= 5
    for conv, bn, act in chains:
        assert bn.inputs[0] == conv.outputs[0] and act.inputs[0] == bn.outputs[0]
        assert g.consumers(conv.outputs[0]) == [bn]


@pytest.mark.parametrize("order", ["mul_first", "add_first", "const_left"])
def test_fold_conv_affine(order: str) -> None:
    w = RNG.standard_normal((6, 4, 3, 3)).astype(np.float32)
    inits = [nh.from_array(w, "W"), nh.from_array(RNG.standard_normal(6).astype(np.float32), "B"),
             nh.from_array(RNG.standard_normal((6, 1, 1)).astype(np.float32), "s"),
             nh.from_array(RNG.standard_normal((1, 6, 1, 1)).astype(np.float32), "d")]
    conv = oh.make_node("Conv", ["x", "W", "B"], ["c"], name="conv")
    if order == "mul_first":
        tail = [oh.make_node("Mul", ["c", "s"], ["m"]), oh.make_node("Add", ["m", "d"], ["y"])]
    elif order == "add_first":
        tail = [oh.make_node("Add", ["c", "d"], ["m"]), oh.make_node("Mul", ["m", "s"], ["y"])]
    else:
        tail = [oh.make_node("Mul", ["s", "c"], ["m"]), oh.make_node("Add", ["d", "m"], ["y"])]
    model = _model([conv, *tail], [oh.make_tensor_value_info("x", TP.FLOAT, [2, 4, 7, 7])],
                   [oh.make_tensor_value_info("y", TP.FLOAT, ["n", "c", "h", "w"])], inits)
    g = load_onnx(model)
    assert fold_conv_affine(g) == 2
    assert [n.op_type for n in g.nodes] == ["Conv"] and g.nodes[0].outputs == ["y"]
    assert set(g.initializers) == set(g.nodes[0].inputs[1:])
    _check_same(model, to_onnx(g), {"x": RNG.standard_normal((2, 4, 7, 7)).astype(np.float32)})


def test_fold_conv_affine_skips_non_per_channel_constants() -> None:
    inits = [nh.from_array(RNG.standard_normal((6, 4, 1, 1)).astype(np.float32), "W"),
             nh.from_array(RNG.standard_normal((1, 1, 7, 7)).astype(np.float32), "spatial")]
    nodes = [oh.make_node("Conv", ["x", "W"], ["c"]), oh.make_node("Mul", ["c", "spatial"], ["y"])]
    model = _model(nodes, [oh.make_tensor_value_info("x", TP.FLOAT, [2, 4, 7, 7])],
                   [oh.make_tensor_value_info("y", TP.FLOAT, [2, 6, 7, 7])], inits)
    g = load_onnx(model)
    assert fold_conv_affine(g) == 0 and len(g.nodes) == 2


def test_fold_conv_affine_on_ppocr_rec(tmp_path) -> None:
    path = ppocr_model_path("rec")
    g = load_onnx(path)
    assert fold_conv_affine(g) > 50
    save_onnx(g, tmp_path / "rec.onnx")
    x = ppocr_input("rec")
    assert rel_err(ort_run(str(tmp_path / "rec.onnx"), {"x": x})[0], ort_run(str(path), {"x": x})[0]) <= 1e-4
