"""Executor: inputs as dict / list / numpy, intermediates, keep, hooks, autograd, freeing, subgraphs, errors."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nh

from netquant.api.zoo import ppocr_model_path
from netquant.errors import DataError, ModelError, UnsupportedOpError
from netquant.graph import Executor, load_onnx
from tests.helpers.graph_helpers import ort_run, ppocr_input
from tests.helpers.ir import make_model

RNG = np.random.default_rng(0)
W = RNG.standard_normal((4, 3, 3, 3)).astype(np.float32)
B = RNG.standard_normal(4).astype(np.float32)
FC = RNG.standard_normal((5, 4 * 6 * 6)).astype(np.float32)


def conv_model(opset: int = 17) -> onnx.ModelProto:
    """x[N,3,8,8] -> Conv(W,B) -> Relu -> Flatten -> Gemm(FC^T) -> y[N,5]"""
    nodes = [oh.make_node("Conv", ["x", "W", "B"], ["c"], name="conv"),
             oh.make_node("Relu", ["c"], ["r"], name="relu"),
             oh.make_node("Flatten", ["r"], ["f"], name="flat"),
             oh.make_node("Gemm", ["f", "FC"], ["y"], name="fc", transB=1)]
    graph = oh.make_graph(nodes, "convnet", [oh.make_tensor_value_info("x", TP.FLOAT, ["N", 3, 8, 8])],
                          [oh.make_tensor_value_info("y", TP.FLOAT, ["N", 5])],
                          [nh.from_array(W, "W"), nh.from_array(B, "B"), nh.from_array(FC, "FC")])
    model = make_model(graph, opset_imports=[oh.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def torch_reference(x: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
    w = torch.from_numpy(W) if w is None else w
    r = F.relu(F.conv2d(x, w, torch.from_numpy(B)))
    return r.flatten(1) @ torch.from_numpy(FC).T


X = RNG.standard_normal((2, 3, 8, 8)).astype(np.float32)


def test_dict_list_numpy_inputs_agree_with_torch_and_ort() -> None:
    ex = Executor(load_onnx(conv_model()))
    ref = torch_reference(torch.from_numpy(X))
    for feeds in ({"x": torch.from_numpy(X)}, [torch.from_numpy(X)], [X], {"x": X}):
        y = ex.run(feeds)["y"]
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ex.run([X])["y"].numpy(), ort_run(conv_model(), {"x": X})[0], rtol=1e-5, atol=1e-5)


def test_intermediate_outputs_and_keep() -> None:
    ex = Executor(load_onnx(conv_model()))
    x = torch.from_numpy(X)
    c_ref = F.conv2d(x, torch.from_numpy(W), torch.from_numpy(B))
    only_c = ex.run([x], outputs=["c"])
    assert set(only_c) == {"c"}
    torch.testing.assert_close(only_c["c"], c_ref, rtol=1e-5, atol=1e-5)
    kept = ex.run([x], keep=["r"])
    assert set(kept) == {"y", "r"}
    torch.testing.assert_close(kept["r"], F.relu(c_ref), rtol=1e-5, atol=1e-5)
    everything = ex.run([x], keep=True)
    assert {"x", "c", "r", "f", "y", "W"} <= set(everything)


def test_activations_are_freed_after_last_use_unless_kept() -> None:
    ex = Executor(load_onnx(conv_model()))
    refs: dict[str, weakref.ref] = {}
    ex.add_post_hook(lambda node, outs: refs.update({node.outputs[0]: weakref.ref(outs[0])}))
    with torch.no_grad():
        result = ex.run([X])
    gc.collect()
    assert refs["c"]() is None and refs["r"]() is None and refs["f"]() is None
    assert refs["y"]() is result["y"]
    refs.clear()
    with torch.no_grad():
        kept = ex.run([X], keep=["c"])
    gc.collect()
    assert refs["c"]() is kept["c"] and refs["r"]() is None


def test_pre_hook_sees_initializers_and_can_replace_them() -> None:
    ex = Executor(load_onnx(conv_model()))
    seen: dict[str, list[tuple[int, ...]]] = {}

    def observe(node, inputs):
        seen[node.name] = [tuple(t.shape) for t in inputs if t is not None]

    def halve_conv_weight(node, inputs):
        if node.op_type == "Conv":
            return [inputs[0], inputs[1] * 0.5, inputs[2]]
        return None

    h1 = ex.add_pre_hook(observe)
    ex.run([X])
    assert seen["conv"] == [(2, 3, 8, 8), (4, 3, 3, 3), (4,)]
    assert seen["fc"] == [(2, 144), (5, 144)]
    h2 = ex.add_pre_hook(halve_conv_weight)
    y = ex.run([X])["y"]
    torch.testing.assert_close(y, torch_reference(torch.from_numpy(X), torch.from_numpy(W) * 0.5),
                               rtol=1e-5, atol=1e-5)
    h2.remove()
    h1.remove()
    torch.testing.assert_close(ex.run([X])["y"], torch_reference(torch.from_numpy(X)), rtol=1e-5, atol=1e-5)


def test_post_hook_replaces_outputs() -> None:
    ex = Executor(load_onnx(conv_model()))
    ex.add_post_hook(lambda node, outs: [outs[0] * 0] if node.op_type == "Relu" else None)
    assert torch.count_nonzero(ex.run([X])["y"]) == 0


def test_autograd_through_executor_matches_torch() -> None:
    ex = Executor(load_onnx(conv_model()))
    x1 = torch.from_numpy(X).requires_grad_(True)
    ex.initializers["W"].requires_grad_(True)
    ex.run([x1])["y"].square().sum().backward()
    x2 = torch.from_numpy(X).requires_grad_(True)
    w2 = torch.from_numpy(W.copy()).requires_grad_(True)
    torch_reference(x2, w2).square().sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ex.initializers["W"].grad, w2.grad, rtol=1e-4, atol=1e-4)


def test_hook_parameter_gets_gradient() -> None:
    """A learnable scale applied in a pre hook (as fake quantizers will be) receives a gradient."""
    ex = Executor(load_onnx(conv_model()))
    scale = torch.tensor(1.5, requires_grad=True)
    ex.add_pre_hook(lambda node, ins: [ins[0] * scale, *ins[1:]] if node.op_type == "Gemm" else None)
    y = ex.run([X])["y"]
    y.sum().backward()
    # y = scale * (f @ FC^T)  =>  dL/dscale = sum(f @ FC^T)
    expected = torch_reference(torch.from_numpy(X)).sum()
    torch.testing.assert_close(scale.grad, expected, rtol=1e-4, atol=1e-3)


def test_no_grad_mode_by_default_without_hooks() -> None:
    ex = Executor(load_onnx(conv_model()))
    y = ex.run([X])["y"]
    assert not y.requires_grad and y.is_inference()


def test_input_errors_name_the_input() -> None:
    ex = Executor(load_onnx(conv_model()))
    with pytest.raises(DataError, match="'x'.*float32.*float64"):
        ex.run([X.astype(np.float64)])
    with pytest.raises(DataError, match="'x'.*rank 4"):
        ex.run([X[0]])
    with pytest.raises(DataError, match=r"'x'.*dim 1: 2 != 3"):
        ex.run([X[:, :2]])
    with pytest.raises(DataError, match="missing input"):
        ex.run({})
    with pytest.raises(DataError, match="unknown input name"):
        ex.run({"x": X, "z": X})
    with pytest.raises(DataError, match="takes 1 input"):
        ex.run([X, X])
    with pytest.raises(DataError, match="'nope'"):
        ex.run([X], outputs=["nope"])


def test_unsupported_op_names_type_node_and_opset() -> None:
    node = oh.make_node("FancyOp", ["x"], ["y"], name="my_fancy_node", domain="")
    graph = oh.make_graph([node], "g", [oh.make_tensor_value_info("x", TP.FLOAT, [2])],
                          [oh.make_tensor_value_info("y", TP.FLOAT, [2])])
    model = make_model(graph, opset_imports=[oh.make_opsetid("", 15)])
    with pytest.raises(UnsupportedOpError, match=r"FancyOp.*my_fancy_node.*opset 15"):
        Executor(load_onnx(model, infer_shapes=False))


def test_op_failure_names_node() -> None:
    nodes = [oh.make_node("MatMul", ["a", "b"], ["y"], name="mm")]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("a", TP.FLOAT, ["n", "k"]),
                                       oh.make_tensor_value_info("b", TP.FLOAT, ["k2", "m"])],
                          [oh.make_tensor_value_info("y", TP.FLOAT, None)])
    ex = Executor(load_onnx(make_model(graph, opset_imports=[oh.make_opsetid("", 17)])))
    with pytest.raises(DataError, match="MatMul node 'mm'"):
        ex.run([np.ones((2, 3), np.float32), np.ones((4, 5), np.float32)])


def _if_model() -> onnx.ModelProto:
    """y = cond ? x * w_outer : x - w_outer   (branches read outer-scope values)"""
    then_g = oh.make_graph([oh.make_node("Mul", ["x", "w"], ["t"], name="then_mul")], "then", [],
                           [oh.make_tensor_value_info("t", TP.FLOAT, [3])])
    else_g = oh.make_graph([oh.make_node("Sub", ["x", "w"], ["e"], name="else_sub")], "else", [],
                           [oh.make_tensor_value_info("e", TP.FLOAT, [3])])
    nodes = [oh.make_node("Relu", ["x0"], ["x"], name="pre"),
             oh.make_node("If", ["cond"], ["y"], name="branch", then_branch=then_g, else_branch=else_g)]
    graph = oh.make_graph(nodes, "ifg", [oh.make_tensor_value_info("x0", TP.FLOAT, [3]),
                                         oh.make_tensor_value_info("cond", TP.BOOL, [])],
                          [oh.make_tensor_value_info("y", TP.FLOAT, [3])],
                          [nh.from_array(np.array([2.0, 3.0, 4.0], np.float32), "w")])
    model = make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_if_with_outer_scope_values_and_hooks_inside_branches() -> None:
    model = _if_model()
    ex = Executor(load_onnx(model))
    visited: list[str] = []
    ex.add_post_hook(lambda node, outs: visited.append(node.name))
    x0 = np.array([1.0, -2.0, 3.0], np.float32)
    for cond in (True, False):
        feeds = {"x0": x0, "cond": np.array(cond)}
        got = ex.run(feeds)["y"].numpy()
        np.testing.assert_allclose(got, ort_run(model, feeds)[0], rtol=1e-6)
    assert visited == ["pre", "then_mul", "branch", "pre", "else_sub", "branch"]


def test_loop_accumulates_like_onnxruntime() -> None:
    """Loop: acc_{i+1} = acc_i + x * i for i < M; scan output collects acc."""
    body = oh.make_graph(
        [oh.make_node("Cast", ["i"], ["fi"], to=TP.FLOAT), oh.make_node("Mul", ["x", "fi"], ["xi"]),
         oh.make_node("Add", ["acc", "xi"], ["acc_out"]), oh.make_node("Identity", ["cond"], ["cond_out"]),
         oh.make_node("Identity", ["acc_out"], ["scan_out"])],
        "body", [oh.make_tensor_value_info("i", TP.INT64, []), oh.make_tensor_value_info("cond", TP.BOOL, []),
                 oh.make_tensor_value_info("acc", TP.FLOAT, [2])],
        [oh.make_tensor_value_info("cond_out", TP.BOOL, []), oh.make_tensor_value_info("acc_out", TP.FLOAT, [2]),
         oh.make_tensor_value_info("scan_out", TP.FLOAT, [2])])
    graph = oh.make_graph([oh.make_node("Loop", ["M", "", "acc0"], ["acc", "hist"], body=body)], "loopg",
                          [oh.make_tensor_value_info("M", TP.INT64, []),
                           oh.make_tensor_value_info("acc0", TP.FLOAT, [2]),
                           oh.make_tensor_value_info("x", TP.FLOAT, [2])],
                          [oh.make_tensor_value_info("acc", TP.FLOAT, [2]),
                           oh.make_tensor_value_info("hist", TP.FLOAT, [None, 2])])
    model = make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    feeds = {"M": np.array(4, np.int64), "acc0": np.array([1.0, 0.5], np.float32),
             "x": np.array([1.0, -1.0], np.float32)}
    out = Executor(load_onnx(model)).run(feeds)
    ref = ort_run(model, feeds)
    np.testing.assert_allclose(out["acc"].numpy(), ref[0], rtol=1e-6)
    np.testing.assert_allclose(out["hist"].numpy(), ref[1], rtol=1e-6)


def test_constant_subexpressions_folded_at_construction() -> None:
    """ConstantOfShape weights (as in onnx's light models) are computed once, not per run."""
    nodes = [oh.make_node("ConstantOfShape", ["shape"], ["w"], value=nh.from_array(np.array([0.5], np.float32))),
             oh.make_node("Mul", ["x", "w"], ["y"], name="mul")]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TP.FLOAT, [2, 3])],
                          [oh.make_tensor_value_info("y", TP.FLOAT, [2, 3])],
                          [nh.from_array(np.array([2, 3], np.int64), "shape")])
    ex = Executor(load_onnx(make_model(graph, opset_imports=[oh.make_opsetid("", 17)])))
    assert set(ex.folded) == {"w"}
    ran: list[str] = []
    ex.add_pre_hook(lambda node, ins: ran.append(node.op_type))
    y = ex.run([np.ones((2, 3), np.float32)])["y"]
    assert ran == ["Mul"] and torch.equal(y, torch.full((2, 3), 0.5))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_matches_cpu() -> None:
    graph = load_onnx(conv_model())
    cpu = Executor(graph).run([X])["y"]
    cuda = Executor(graph, "cuda").run([X])["y"]
    assert cuda.is_cuda
    torch.testing.assert_close(cuda.cpu(), cpu, rtol=1e-3, atol=1e-3)


def test_model_error_for_missing_subgraph_runner() -> None:
    from netquant.graph.ops.control import if_
    from netquant.graph.ops.registry import OpContext

    with pytest.raises(ModelError, match="no subgraph runner"):
        if_([torch.tensor(True)], {"then_branch": None, "else_branch": None}, OpContext("If", "n"))


# ---------------------------------------------------------------------------- fast path
def _alias_model() -> onnx.ModelProto:
    """a = Relu(x); b = Identity(a); r = Reshape(a); c = Add(a, one) (a's last use); outputs b, r, c, x2"""
    nodes = [oh.make_node("Relu", ["x"], ["a"]), oh.make_node("Identity", ["a"], ["b"]),
             oh.make_node("Reshape", ["a", "shape"], ["r"]), oh.make_node("Add", ["a", "one"], ["c"]),
             oh.make_node("Mul", ["x", "one"], ["x2"])]
    graph = oh.make_graph(nodes, "alias", [oh.make_tensor_value_info("x", TP.FLOAT, [2, 3])],
                          [oh.make_tensor_value_info(n, TP.FLOAT, None) for n in ("b", "r", "c", "x2")],
                          [nh.from_array(np.array(1.0, np.float32), "one"),
                           nh.from_array(np.array([3, 2], np.int64), "shape")])
    model = make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_inplace_never_overwrites_aliases_or_user_inputs() -> None:
    ex = Executor(load_onnx(_alias_model()))
    x = torch.tensor([[-1.0, 2.0, -3.0], [4.0, -5.0, 6.0]])
    x_before = x.clone()
    out = ex.run([x])
    relu = torch.relu(x_before)
    assert torch.equal(x, x_before)
    assert torch.equal(out["b"], relu) and torch.equal(out["r"], relu.reshape(3, 2))
    assert torch.equal(out["c"], relu + 1) and torch.equal(out["x2"], x_before)


@pytest.fixture
def inplace_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Op types for which the executor's in-place fast path produced the result, in call order."""
    from netquant.graph import fastpath

    calls: list[str] = []
    for op, fn in list(fastpath.INPLACE.items()):
        def counting(inputs, attrs, opset, idx, _fn=fn, _op=op):
            out = _fn(inputs, attrs, opset, idx)
            if out is not None:
                calls.append(_op)
            return out
        monkeypatch.setitem(fastpath.INPLACE, op, counting)
    return calls


def test_inplace_path_is_taken_and_bit_identical(inplace_calls: list[str]) -> None:
    calls = inplace_calls
    graph = load_onnx(ppocr_model_path("cls"))
    x = ppocr_input("cls")
    fast = Executor(graph).run([x])
    assert calls.count("Add") > 10 and calls.count("Relu") > 5
    slow = Executor(graph, inplace=False).run([x])
    for name in fast:
        assert torch.equal(fast[name], slow[name])


def test_no_inplace_when_hooks_observe() -> None:
    ex = Executor(load_onnx(_alias_model()))
    seen = {}

    def keep_first_input(node, ins):
        seen[node.op_type] = ins[0]

    ex.add_pre_hook(keep_first_input)
    x = torch.tensor([[-1.0, 2.0, -3.0], [4.0, -5.0, 6.0]])
    ex.run([x])
    assert torch.equal(seen["Add"], torch.relu(x))  # the hook's reference was not overwritten


def test_channels_last_gives_same_values_and_contiguous_outputs() -> None:
    graph = load_onnx(ppocr_model_path("det"))
    x = ppocr_input("det")
    fast = Executor(graph, channels_last=True)
    assert fast.channels_last and Executor(graph, channels_last=None).channels_last
    conv = next(n for n in graph.nodes if n.op_type == "Conv")
    weight = {**fast.initializers, **fast.folded}[conv.inputs[1]]  # Constant-node weights are folded
    assert weight.is_contiguous(memory_format=torch.channels_last)
    a = fast.run([x])
    b = Executor(graph, channels_last=False, inplace=False).run([x])
    for name in a:
        assert a[name].is_contiguous()
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5)


def test_model_local_functions_are_inlined() -> None:
    """y = MyScale(x) with a model-local function MyScale(a) = a * 2 + 1."""
    two = oh.make_node("Constant", [], ["two"], value=nh.from_array(np.array(2.0, np.float32)))
    one = oh.make_node("Constant", [], ["one"], value=nh.from_array(np.array(1.0, np.float32)))
    fn = oh.make_function("local", "MyScale", ["a"], ["b"],
                          [two, one, oh.make_node("Mul", ["a", "two"], ["t"]), oh.make_node("Add", ["t", "one"], ["b"])],
                          [oh.make_opsetid("", 17)])
    graph = oh.make_graph([oh.make_node("MyScale", ["x"], ["y"], domain="local")], "g",
                          [oh.make_tensor_value_info("x", TP.FLOAT, [3])], [oh.make_tensor_value_info("y", TP.FLOAT, [3])])
    model = make_model(graph, functions=[fn], opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("local", 1)])
    model.ir_version = 8
    x = np.array([1.0, -2.0, 0.5], np.float32)
    g = load_onnx(model)
    np.testing.assert_array_equal(Executor(g).run([x])["y"].numpy(), ort_run(model, {"x": x})[0])
    assert len(to_onnx_functions(g)) == 1  # the loaded graph itself keeps the function


def to_onnx_functions(graph):
    from netquant.graph import to_onnx

    return to_onnx(graph).functions


def test_inplace_with_observing_hooks_keeps_hook_lists_intact(inplace_calls: list[str]) -> None:
    calls = inplace_calls
    graph = load_onnx(ppocr_model_path("cls"))
    x = ppocr_input("cls")
    ex = Executor(graph)
    maxima: list[float] = []
    kept_lists: list[list] = []

    def observe(node, inputs):  # an observer: reads statistics, keeps no tensor
        if inputs and isinstance(inputs[0], torch.Tensor) and inputs[0].is_floating_point():
            maxima.append(float(inputs[0].abs().max()))

    def keep_list(node, inputs):  # keeps the list object it was given
        if node.op_type == "Relu":
            kept_lists.append(inputs)

    ex.add_pre_hook(observe)
    ex.add_pre_hook(keep_list)
    with torch.no_grad():
        fast = ex.run([x])
    assert calls.count("Add") > 10  # the in-place path stayed on
    ref_ex = Executor(graph, inplace=False)
    ref_max: list[float] = []
    ref_lists: list[list] = []
    ref_ex.add_pre_hook(lambda n, ins: ref_max.append(float(ins[0].abs().max()))
                        if ins and isinstance(ins[0], torch.Tensor) and ins[0].is_floating_point() else None)
    ref_ex.add_pre_hook(lambda n, ins: ref_lists.append(ins) if n.op_type == "Relu" else None)
    with torch.no_grad():
        slow = ref_ex.run([x])
    assert maxima == ref_max
    for a, b in zip(kept_lists, ref_lists):
        assert torch.equal(a[0], b[0])  # what the hook kept was not overwritten
    for name in fast:
        assert torch.equal(fast[name], slow[name])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on machines without CUDA")
def test_cuda_unavailable_is_a_config_error() -> None:
    from netquant.errors import ConfigError

    with pytest.raises(ConfigError, match="CUDA is not available"):
        Executor(load_onnx(conv_model()), "cuda")


def test_hook_handles_form_no_cycle_and_remove_their_hook() -> None:
    """An object holding the handles of its own methods' hooks (QuantizedGraph's fake-quant hooks) is freed by
    reference counting once nothing else holds it: no garbage collection needed for the memory it holds."""

    class Hooks:
        def __init__(self, ex: Executor) -> None:
            self.calls = 0
            self.handles = [ex.add_pre_hook(self.pre), ex.add_post_hook(self.post)]

        def pre(self, node, inputs):
            self.calls += 1

        def post(self, node, outputs):
            self.calls += 1

    ex = Executor(load_onnx(conv_model()))
    hooks = Hooks(ex)
    with torch.no_grad():
        plain = ex.run([X])["y"]
    assert hooks.calls == 2 * len(ex.graph.nodes)
    for handle in hooks.handles:
        handle.remove()
    with torch.no_grad():
        again = ex.run([X])["y"]
    assert hooks.calls == 2 * len(ex.graph.nodes) and torch.equal(again, plain)
    gc.disable()
    try:
        hooks = Hooks(ex)
        gone = weakref.ref(hooks)
        del hooks
        ex = None  # the executor (and its hook lists) dropped: nothing but a cycle could keep Hooks alive
        assert gone() is None
    finally:
        gc.enable()
