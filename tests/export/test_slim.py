"""export.slim: the exported file carries no per-node metadata (exporters' annotations no engine reads)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

import netquant
from netquant.export.slim import strip_node_metadata
from netquant.nn.export import torch_to_onnx
from tests.helpers.ir import make_model


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(512, 64)
        self.fc1 = torch.nn.Linear(64, 128)
        self.fc2 = torch.nn.Linear(128, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        return h + self.fc2(torch.nn.functional.gelu(self.fc1(h)))


def _node_metadata_bytes(model: onnx.ModelProto) -> int:
    return sum(sum(p.ByteSize() for p in n.metadata_props) + len(n.doc_string) for n in model.graph.node)


def test_dynamo_export_quantized_file_has_no_per_node_metadata(tmp_path: Path) -> None:
    ids = torch.randint(0, 512, (1, 16))
    source = torch_to_onnx(_Tiny().eval(), (ids,), input_names=["ids"], output_names=["out"])
    assert _node_metadata_bytes(source) > 1000  # torch.onnx's dynamo exporter annotates every node
    src = tmp_path / "tiny.onnx"
    onnx.save(source, str(src))
    calib = [{"ids": np.random.default_rng(i).integers(0, 512, (1, 16)).astype(np.int64)} for i in range(4)]
    out = tmp_path / "q.onnx"
    netquant.quantize_onnx(str(src), calib, objective=None, quiet=True).export(out)
    model = onnx.load(str(out))
    assert _node_metadata_bytes(model) == 0
    assert not any(v.metadata_props for v in (*model.graph.input, *model.graph.output, *model.graph.value_info))
    assert {p.key: p.value for p in model.metadata_props}.get("netquant.platform")  # the model-level metadata stays
    # same bytes on a second export; onnxruntime's output stays that of FP32
    again = tmp_path / "q2.onnx"
    netquant.quantize_onnx(str(src), calib, objective=None, quiet=True).export(again)
    assert out.read_bytes() == again.read_bytes()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    ref = ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"]).run(None, calib[0])[0]
    got = ort.InferenceSession(str(out), so, providers=["CPUExecutionProvider"]).run(None, calib[0])[0]
    cos = float((ref * got).sum() / np.linalg.norm(ref) / np.linalg.norm(got))
    assert cos > 0.999, cos


def test_strip_node_metadata_reaches_subgraphs_and_keeps_model_metadata() -> None:
    def annotated(node: onnx.NodeProto) -> onnx.NodeProto:
        node.doc_string = "stack trace"
        p = node.metadata_props.add()
        p.key, p.value = "pkg.torch.onnx.name_scopes", "['', 'fc1']"
        return node

    then = helper.make_graph([annotated(helper.make_node("Identity", ["x"], ["t"]))], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2])])
    other = helper.make_graph([annotated(helper.make_node("Neg", ["x"], ["e"]))], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, [2])])
    nodes = [annotated(helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other))]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                                           helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    helper.set_model_props(model, {"netquant.platform": "onnxruntime_int8"})
    before = model.ByteSize()
    freed = strip_node_metadata(model)
    assert freed > 0 and model.ByteSize() <= before - freed
    for g in (model.graph, model.graph.node[0].attribute[0].g, model.graph.node[0].attribute[1].g):
        assert all(not n.metadata_props and not n.doc_string for n in g.node)
    assert {p.key: p.value for p in model.metadata_props} == {"netquant.platform": "onnxruntime_int8"}
    onnx.checker.check_model(model)
    x = np.array([1.0, -2.0], np.float32)
    out = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"c": np.array(False), "x": x})[0]
    np.testing.assert_array_equal(out, -x)


def test_equal_initializers_are_stored_once_with_the_same_outputs() -> None:
    from onnx import numpy_helper

    from netquant.export.slim import share_equal_initializers

    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 64)).astype(np.float32)
    zeros = np.zeros(64, np.float32)
    inits = [numpy_helper.from_array(w, "w1"), numpy_helper.from_array(w.copy(), "w2"),
             numpy_helper.from_array(zeros, "b1"), numpy_helper.from_array(zeros.copy(), "b2"),
             numpy_helper.from_array(zeros.copy(), "b3"),  # read by a subgraph: left alone
             numpy_helper.from_array(np.zeros((1, 64), np.float32), "b4"),  # other dims: another tensor
             numpy_helper.from_array(np.float32(2.0), "s1"), numpy_helper.from_array(np.float32(2.0), "s2")]
    sub = helper.make_graph([helper.make_node("Add", ["h2", "b3"], ["t"])], "then", [],
                            [helper.make_tensor_value_info("t", TensorProto.FLOAT, [1, 64])])
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["m1"]), helper.make_node("Add", ["m1", "b1"], ["h1"]),
             helper.make_node("MatMul", ["h1", "w2"], ["m2"]), helper.make_node("Add", ["m2", "b2"], ["h2"]),
             helper.make_node("Mul", ["h2", "s1"], ["h3"]), helper.make_node("Mul", ["h3", "s2"], ["h4"]),
             helper.make_node("Add", ["h4", "b4"], ["y"]),
             helper.make_node("If", ["c"], ["z"], then_branch=sub, else_branch=sub)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64]),
                                           helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64]),
                               helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 64])], inits)
    model = make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"x": rng.standard_normal((1, 64)).astype(np.float32), "c": np.array(True)}
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    freed = share_equal_initializers(model)
    names = sorted(t.name for t in model.graph.initializer)
    assert names == ["b1", "b3", "b4", "s1", "s2", "w1"]  # w2 -> w1, b2 -> b1; scalars are too small to bother
    assert freed >= 64 * 64 * 4 + 64 * 4
    assert [n.input[1] for n in model.graph.node[:4]] == ["w1", "b1", "w1", "b1"]
    onnx.checker.check_model(model)
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(a, b)
