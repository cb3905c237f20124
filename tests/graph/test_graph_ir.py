"""Graph IR edits: producer/consumers, insert on edge, remove, replace, toposort, copy."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nh

from netquant.errors import ModelError
from netquant.graph import Executor, Graph, Node, load_onnx, save_onnx, to_onnx
from tests.helpers.graph_helpers import ort_run
from tests.helpers.ir import make_model

X = np.random.default_rng(2).standard_normal((2, 3)).astype(np.float32)


def chain_model() -> onnx.ModelProto:
    """x -> Relu(a) -> Neg(b) -> Exp(y);  also Abs(a) -> z"""
    nodes = [oh.make_node("Relu", ["x"], ["a"], name="relu"), oh.make_node("Neg", ["a"], ["b"], name="neg"),
             oh.make_node("Exp", ["b"], ["y"], name="exp"), oh.make_node("Abs", ["a"], ["z"], name="abs")]
    graph = oh.make_graph(nodes, "chain", [oh.make_tensor_value_info("x", TP.FLOAT, [2, 3])],
                          [oh.make_tensor_value_info("y", TP.FLOAT, [2, 3]),
                           oh.make_tensor_value_info("z", TP.FLOAT, [2, 3])],
                          [nh.from_array(np.array(2.0, np.float32), "two")])
    model = make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def run(graph: Graph) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in Executor(graph).run([X]).items()}


def test_queries() -> None:
    g = load_onnx(chain_model())
    assert g.producer("a").name == "relu" and g.producer("x") is None
    assert [n.name for n in g.consumers("a")] == ["neg", "abs"]
    assert g.node("exp").op_type == "Exp"
    with pytest.raises(ModelError, match="no node named 'nope'"):
        g.node("nope")
    assert g.value("a").shape == (2, 3)  # from shape inference
    assert g.fresh_name("a") == "a_1" and g.fresh_name("fresh") == "fresh"


def test_insert_on_edge_all_consumers(tmp_path) -> None:
    g = load_onnx(chain_model())
    g.insert_node_on_edge(Node("scale", "Mul", inputs=["a", "two"], outputs=["a2"]), "a")
    assert [n.name for n in g.nodes] == ["relu", "scale", "neg", "exp", "abs"]
    out = run(g)
    a = np.maximum(X, 0)
    np.testing.assert_allclose(out["y"], np.exp(-2 * a), rtol=1e-6)
    np.testing.assert_allclose(out["z"], 2 * a, rtol=1e-6)
    save_onnx(g, tmp_path / "m.onnx")  # onnx.checker passes
    np.testing.assert_allclose(ort_run(str(tmp_path / "m.onnx"), {"x": X})[0], out["y"], rtol=1e-6)


def test_insert_on_edge_some_consumers() -> None:
    g = load_onnx(chain_model())
    g.insert_node_on_edge(Node("scale", "Mul", inputs=["a", "two"], outputs=["a2"]), "a", consumers=[g.node("abs")])
    out = run(g)
    a = np.maximum(X, 0)
    np.testing.assert_allclose(out["y"], np.exp(-a), rtol=1e-6)
    np.testing.assert_allclose(out["z"], 2 * a, rtol=1e-6)
    to_onnx(g)


def test_insert_before_graph_output_takes_over_its_name() -> None:
    g = load_onnx(chain_model())
    g.insert_node_on_edge(Node("scale", "Mul", inputs=["y", "two"], outputs=["unused_name"]), "y",
                          rewire_graph_output=True)
    assert g.output_names == ["y", "z"] and g.producer("y").name == "scale"
    np.testing.assert_allclose(run(g)["y"], 2 * np.exp(-np.maximum(X, 0)), rtol=1e-6)
    to_onnx(g)


def test_insert_errors() -> None:
    g = load_onnx(chain_model())
    with pytest.raises(ModelError, match="does not read edge 'a'"):
        g.insert_node_on_edge(Node("m", "Mul", inputs=["b", "two"], outputs=["o"]), "a")
    with pytest.raises(ModelError, match="no value named 'q'"):
        g.insert_node_on_edge(Node("m", "Mul", inputs=["q", "two"], outputs=["o"]), "q")


def test_remove_node_reconnects() -> None:
    g = load_onnx(chain_model())
    g.remove_node(g.node("neg"))
    np.testing.assert_allclose(run(g)["y"], np.exp(np.maximum(X, 0)), rtol=1e-6)
    to_onnx(g)


def test_remove_node_producing_graph_output_renames_upstream() -> None:
    g = load_onnx(chain_model())
    g.remove_node(g.node("exp"))  # y's producer gone: neg now writes 'y'
    assert g.producer("y").name == "neg"
    np.testing.assert_allclose(run(g)["y"], -np.maximum(X, 0), rtol=1e-6)
    to_onnx(g)


def test_remove_without_reconnect_requires_unused_outputs() -> None:
    g = load_onnx(chain_model())
    with pytest.raises(ModelError, match="still used"):
        g.remove_node(g.node("neg"), reconnect=False)
    assert [n.name for n in g.nodes] == ["relu", "neg", "exp", "abs"]  # unchanged


def test_replace_node() -> None:
    g = load_onnx(chain_model())
    g.replace_node(g.node("neg"), [Node("m1", "Mul", inputs=["a", "two"], outputs=["t"]),
                                   Node("m2", "Neg", inputs=["t"], outputs=["b"])])
    np.testing.assert_allclose(run(g)["y"], np.exp(-2 * np.maximum(X, 0)), rtol=1e-6)
    to_onnx(g)


def test_toposort_is_stable_and_detects_cycles() -> None:
    g = load_onnx(chain_model())
    order = [n.name for n in g.nodes]
    g.toposort()
    assert [n.name for n in g.nodes] == order  # already sorted: unchanged
    g.nodes.reverse()  # abs, exp, neg, relu
    g.toposort()  # ties broken by current position
    assert [n.name for n in g.nodes] == ["relu", "abs", "neg", "exp"]
    g.node("relu").inputs = ["b"]  # relu <- neg <- relu
    with pytest.raises(ModelError, match=r"cycle.*relu.*neg"):
        g.toposort()


def test_copy_is_deep() -> None:
    g = load_onnx(chain_model())
    c = g.copy()
    c.initializers["two"].fill_(5.0)
    c.node("neg").inputs = ["x"]
    assert g.initializers["two"].item() == 2.0 and g.node("neg").inputs == ["a"]


def test_add_node_finds_position_and_remove_unused() -> None:
    g = load_onnx(chain_model())
    g.add_node(Node("sq", "Mul", inputs=["b", "b"], outputs=["b2"]))
    assert [n.name for n in g.nodes].index("sq") == 2
    g.remove_unused()  # b2 reaches no output
    assert "sq" not in [n.name for n in g.nodes] and "two" not in g.initializers


def test_subgraph_references_are_tracked() -> None:
    then_g = oh.make_graph([oh.make_node("Neg", ["a"], ["t"])], "then", [], [oh.make_tensor_value_info("t", TP.FLOAT, [2, 3])])
    else_g = oh.make_graph([oh.make_node("Abs", ["a"], ["e"])], "else", [], [oh.make_tensor_value_info("e", TP.FLOAT, [2, 3])])
    nodes = [oh.make_node("Relu", ["x"], ["a"], name="relu"),
             oh.make_node("If", ["c"], ["y"], name="if", then_branch=then_g, else_branch=else_g)]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TP.FLOAT, [2, 3]),
                                       oh.make_tensor_value_info("c", TP.BOOL, [])],
                          [oh.make_tensor_value_info("y", TP.FLOAT, [2, 3])],
                          [nh.from_array(np.array(2.0, np.float32), "two")])
    model = make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    g = load_onnx(model)
    assert [n.name for n in g.consumers("a")] == ["if"]
    g.insert_node_on_edge(Node("scale", "Mul", inputs=["a", "two"], outputs=["a2"]), "a")
    ex = Executor(g)
    y = ex.run({"x": X, "c": np.array(True)})["y"]
    torch.testing.assert_close(y, torch.from_numpy(-2 * np.maximum(X, 0)))
    to_onnx(g)


def test_shape_inference_after_edit() -> None:
    from netquant.graph.shape_inference import infer_graph_shapes

    g = load_onnx(chain_model())
    g.insert_node_on_edge(Node("tile", "Concat", inputs=["a", "a"], outputs=["a2"], attrs={"axis": 0}), "a",
                          consumers=[g.node("abs")])
    g.outputs[1].shape = None
    infer_graph_shapes(g)
    assert g.value_info["a2"].shape == (4, 3) and g.value_info["a2"].dtype == torch.float32
    assert run(g)["z"].shape == (4, 3)
