"""Tiny evaluator running ONNX backend node cases straight through the op registry (no IR needed)."""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

import netquant.graph.ops  # noqa: F401  (registers the ops)
from netquant.core.int_kernels import Accumulation
from netquant.errors import UnsupportedOpError
from netquant.graph.dtypes import BITCAST_DTYPES
from netquant.graph.ops.registry import OpContext, lookup_op
from netquant.platforms.targets import host_accumulation
from tests.helpers.ir import make_model

_ML_DTYPES = BITCAST_DTYPES  # numpy (ml_dtypes) dtype name -> (bit view, torch dtype)

_STAND_IN = {"int4": np.int8, "int2": np.int8, "uint4": np.uint8, "uint2": np.uint8, "float4_e2m1fn": np.float32}


class Skip(Exception):
    pass


def np_to_torch(a):
    if a is None:
        return None
    if isinstance(a, list):
        return [np_to_torch(x) for x in a]
    if isinstance(a, onnx.TensorProto):
        a = numpy_helper.to_array(a)
    a = np.asarray(a)
    name = a.dtype.name
    if name in _ML_DTYPES:
        view, dt = _ML_DTYPES[name]
        return torch.from_numpy(np.array(a, order="C", copy=True).view(view)).view(dt)
    if a.dtype.kind in "OSU":
        raise Skip(f"string tensor ({a.dtype})")
    if a.dtype.name in _STAND_IN:  # sub-byte types travel in a wider dtype with the same values
        return torch.from_numpy(a.astype(_STAND_IN[a.dtype.name]))
    if a.dtype.kind == "V" and a.dtype.name not in _ML_DTYPES:
        raise Skip(f"dtype {a.dtype.name} has no torch equivalent")
    try:
        return torch.from_numpy(np.array(a, order="C", copy=True))
    except TypeError as e:
        raise Skip(f"dtype {a.dtype}") from e


def torch_to_np(t):
    if isinstance(t, list):
        return [torch_to_np(x) for x in t]
    t = t.detach().cpu()
    if t.dtype in (torch.bfloat16, *(_ML_DTYPES[k][1] for k in _ML_DTYPES)):
        return t.float().numpy()
    return t.numpy()


def decode_attrs(node: onnx.NodeProto) -> dict:
    out = {}
    for a in node.attribute:
        if a.type == onnx.AttributeProto.TENSOR:
            out[a.name] = np_to_torch(numpy_helper.to_array(a.t))
        elif a.type == onnx.AttributeProto.TENSORS:
            out[a.name] = [np_to_torch(numpy_helper.to_array(t)) for t in a.tensors]
        elif a.type == onnx.AttributeProto.STRING:
            out[a.name] = a.s.decode("utf-8")
        elif a.type == onnx.AttributeProto.STRINGS:
            out[a.name] = [s.decode("utf-8") for s in a.strings]
        elif a.type in (onnx.AttributeProto.SPARSE_TENSOR, onnx.AttributeProto.SPARSE_TENSORS):
            raise Skip("sparse tensor attribute")
        else:
            out[a.name] = helper.get_attribute_value(a)
    return out


def run_model(model: onnx.ModelProto, inputs: list, accumulation: Accumulation = Accumulation.EXACT) -> list:
    """Run the model's nodes through netquant's op registry; integer ops sum products as `accumulation`."""
    opsets = {(o.domain or ""): o.version for o in model.opset_import}
    g = model.graph
    env = {}
    for init in g.initializer:
        env[init.name] = np_to_torch(numpy_helper.to_array(init))
    feeds = [vi for vi in g.input if vi.name not in env]
    for vi, x in zip(feeds, inputs):
        env[vi.name] = np_to_torch(x)
    elem = {v.name: v.type.tensor_type.elem_type for v in (*g.input, *g.output, *g.value_info)}
    for init in g.initializer:
        elem[init.name] = init.data_type
    for node in g.node:
        dom = node.domain if node.domain != "ai.onnx" else ""
        opset = opsets.get(dom, opsets.get("", 21))
        try:
            fn = lookup_op(node.op_type, dom, opset, node.name)
        except UnsupportedOpError as e:
            raise Skip(str(e)) from e
        ctx = OpContext(op_type=node.op_type, name=node.name, domain=dom, opset=opset,
                        num_outputs=len(node.output),
                        extras={"input_elem_types": [elem.get(n) for n in node.input],
                                "output_elem_types": [elem.get(n) for n in node.output],
                                "accumulation": accumulation})
        args = [env[n] if n else None for n in node.input]
        try:
            res = fn(args, decode_attrs(node), ctx)
        except UnsupportedOpError as e:
            if "no torch dtype" in str(e):
                raise Skip(str(e)) from e
            raise
        for name, v in zip(node.output, res):
            if name:
                env[name] = v
    return [env[o.name] for o in g.output]


def check_case(case) -> None:
    """Raise AssertionError on mismatch, Skip when the case can't be run here."""
    for inputs, expected in case.data_sets:
        got = run_model(case.model, list(inputs))
        assert len(got) >= len(expected), f"{len(got)} outputs, expected {len(expected)}"
        for i, (g, e) in enumerate(zip(got, expected)):
            if isinstance(e, list):
                assert isinstance(g, list) and len(g) == len(e), f"output {i}: sequence mismatch"
                pairs = list(zip(g, e))
            else:
                pairs = [(g, e)]
            for gg, ee in pairs:
                if isinstance(ee, onnx.TensorProto):
                    ee = numpy_helper.to_array(ee)
                ee = np.asarray(ee)
                if ee.dtype.name in _STAND_IN:
                    ee = ee.astype(_STAND_IN[ee.dtype.name])
                elif ee.dtype.kind == "V" and ee.dtype.name not in _ML_DTYPES:
                    raise Skip(f"dtype {ee.dtype.name} has no torch equivalent")
                gn = torch_to_np(gg)
                if ee.dtype.name in _ML_DTYPES:
                    ee = ee.astype(np.float32)
                assert gn.shape == ee.shape, f"output {i}: shape {gn.shape} != {ee.shape}"
                if ee.dtype.kind in "fc":
                    assert gn.dtype == ee.dtype or ee.dtype == np.float32, f"output {i}: dtype {gn.dtype} != {ee.dtype}"
                    rtol = case.rtol
                    if str(gg.dtype) == "torch.bfloat16":
                        rtol = max(rtol, 2.0**-6)  # bfloat16 has 8 significant bits: 1e-3 is below one ulp; allow 2
                    np.testing.assert_allclose(gn, ee, rtol=rtol, atol=case.atol, err_msg=f"output {i}")
                else:
                    assert gn.dtype == ee.dtype, f"output {i}: dtype {gn.dtype} != {ee.dtype}"
                    np.testing.assert_array_equal(gn, ee, err_msg=f"output {i}")


def single_node_model(node: onnx.NodeProto, inputs: dict[str, np.ndarray], n_out: int | None = None,
                      opset: int = 17, domain_opsets: dict[str, int] | None = None) -> onnx.ModelProto:
    """A one-node model whose graph inputs are `inputs` (name -> array); outputs typed as undefined."""
    from onnx import helper as oh

    vis = [oh.make_tensor_value_info(k, oh.np_dtype_to_tensor_dtype(v.dtype), v.shape) for k, v in inputs.items()]
    outs = [oh.make_empty_tensor_value_info(o) for o in list(node.output)[: n_out or len(node.output)] if o]
    graph = oh.make_graph([node], "g", vis, outs)
    imports = [oh.make_opsetid("", opset)] + [oh.make_opsetid(d, v) for d, v in (domain_opsets or {}).items()]
    return make_model(graph, opset_imports=imports, ir_version=8)


def ort_and_ours(node: onnx.NodeProto, inputs: dict[str, np.ndarray], opset: int = 17,
                 domain_opsets: dict[str, int] | None = None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Run a single node in onnxruntime and through netquant's op registry; both output lists."""
    import onnxruntime as ort

    model = single_node_model(node, inputs, opset=opset, domain_opsets=domain_opsets)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    ref = sess.run(None, inputs)
    # onnxruntime's int8 kernels: exact on VNNI / ARM, int16 pair saturation on x86 without VNNI
    ours = [torch_to_np(t) for t in run_model(model, list(inputs.values()), host_accumulation())]
    return ref, ours
