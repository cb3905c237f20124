"""onnx.backend.base.Backend over the netquant executor, so ONNX's own test suite can run against it.

    import onnx.backend.test
    from netquant.graph.backend import NetquantBackend
    globals().update(onnx.backend.test.BackendTest(NetquantBackend, __name__).test_cases)

`run_node_testcase(case)` runs one case of onnx.backend.test.case.node.collect_testcases() in memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
import torch
from onnx.backend.base import Backend, BackendRep, Device, DeviceType

from netquant.errors import DataError, ModelError, NetquantError
from netquant.graph.dtypes import numpy_as_onnx_type, numpy_to_torch, torch_to_numpy
from netquant.graph.executor import Executor
from netquant.graph.load import load_onnx


def _device(device: str) -> torch.device:
    d = Device(device)
    if d.type == DeviceType.CUDA:
        return torch.device("cuda", d.device_id or 0)
    return torch.device("cpu")


def to_numpy(value: Any) -> Any:
    """Executor value -> what the ONNX backend tests compare (numpy arrays, lists for sequences)."""
    if isinstance(value, torch.Tensor):
        return torch_to_numpy(value)
    if isinstance(value, list | tuple):
        return [to_numpy(v) for v in value]
    return value


def from_numpy(value: Any) -> Any:
    if isinstance(value, np.ndarray | np.generic):
        arr = np.asarray(value)
        return arr if arr.dtype == object else numpy_to_torch(arr)
    if isinstance(value, onnx.TensorProto):
        return from_numpy(onnx.numpy_helper.to_array(value))
    if isinstance(value, list | tuple):
        return [from_numpy(v) for v in value]
    if isinstance(value, dict):
        return {k: from_numpy(v) for k, v in value.items()}
    return value


class NetquantRep(BackendRep):
    """A prepared model: run(inputs) -> tuple of numpy outputs in graph-output order."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor

    def run(self, inputs: Any, **kwargs: Any) -> tuple[Any, ...]:  # type: ignore[override]
        graph = self.executor.graph
        if isinstance(inputs, dict):
            feeds: Any = {k: from_numpy(v) for k, v in inputs.items()}
        else:
            items = [inputs] if isinstance(inputs, np.ndarray) else list(inputs)
            feeds = [from_numpy(v) for v in items]
            # the backend tests omit trailing optional inputs
            feeds = {v.name: x for v, x in zip(graph.inputs, feeds)}
        result = self.executor.run(feeds)
        outs = []
        for v in graph.outputs:
            out = to_numpy(result[v.name])
            if isinstance(out, np.ndarray) and v.elem_type is not None:
                out = numpy_as_onnx_type(out, v.elem_type)  # int4 etc. computed in a stand-in dtype
            outs.append(out)
        return tuple(outs)


class NetquantBackend(Backend):
    """ONNX backend running models with netquant's torch executor (CPU, or CUDA when available)."""

    @classmethod
    def is_compatible(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> bool:
        return cls.supports_device(device)

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> NetquantRep:
        graph = load_onnx(model, infer_shapes=kwargs.get("infer_shapes", True))
        # backend tests feed exactly what the model declares; keep dtype checks, relax nothing else
        return NetquantRep(Executor(graph, _device(device), check_inputs=kwargs.get("check_inputs", True)))

    @classmethod
    def run_model(cls, model: onnx.ModelProto, inputs: Any, device: str = "CPU", **kwargs: Any) -> tuple[Any, ...]:
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(cls, node: onnx.NodeProto, inputs: Any, device: str = "CPU",
                 outputs_info: Sequence[tuple[Any, tuple[int, ...]]] | None = None,
                 **kwargs: Any) -> tuple[Any, ...]:
        arrays = [np.asarray(x) for x in (inputs.values() if isinstance(inputs, dict) else inputs)]
        names = list(inputs.keys()) if isinstance(inputs, dict) else [n for n in node.input if n]
        graph_inputs = [onnx.helper.make_tensor_value_info(
            n, onnx.helper.np_dtype_to_tensor_dtype(a.dtype), a.shape) for n, a in zip(names, arrays)]
        graph_outputs = [onnx.helper.make_empty_tensor_value_info(o) for o in node.output if o]
        opset = kwargs.get("opset_version", onnx.defs.onnx_opset_version())
        model = onnx.helper.make_model(
            onnx.helper.make_graph([node], "run_node", graph_inputs, graph_outputs),
            opset_imports=[onnx.helper.make_opsetid(node.domain or "", opset)])
        return cls.run_model(model, arrays, device, check_inputs=False)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        d = Device(device)
        if d.type == DeviceType.CPU:
            return True
        return d.type == DeviceType.CUDA and torch.cuda.is_available()


prepare = NetquantBackend.prepare
run_model = NetquantBackend.run_model
run_node = NetquantBackend.run_node
supports_device = NetquantBackend.supports_device


def _assert_similar(ref: Any, out: Any, rtol: float, atol: float, where: str) -> None:
    """Same comparison as onnx.backend.test.runner.Runner.assert_similar_outputs."""
    if isinstance(ref, list | tuple):
        if not isinstance(out, list | tuple) or len(out) != len(ref):
            raise AssertionError(f"{where}: expected a sequence of {len(ref)}, got {type(out).__name__}")
        for j, (r, o) in enumerate(zip(ref, out)):
            _assert_similar(r, o, rtol, atol, f"{where}[{j}]")
        return
    if ref is None or out is None:
        if ref is not out:
            raise AssertionError(f"{where}: expected {type(ref).__name__}, got {type(out).__name__}")
        return
    ref = np.asarray(ref)
    out = np.asarray(out)
    np.testing.assert_array_equal(out.shape, ref.shape, err_msg=f"{where} has incorrect shape")
    if ref.dtype == object:
        np.testing.assert_array_equal(out, ref, err_msg=where)
        return
    np.testing.assert_equal(out.dtype, ref.dtype, err_msg=f"{where} has incorrect dtype")
    if ref.dtype.name == "bfloat16":
        rtol = max(rtol, 2**-6)
        out, ref = out.astype(np.float32), ref.astype(np.float32)
    elif ref.dtype.kind not in "biufc":  # float8 / int4 etc. from ml_dtypes
        out, ref = out.astype(np.float32), ref.astype(np.float32)
    np.testing.assert_allclose(out, ref, rtol=rtol, atol=atol, err_msg=where)


def run_node_testcase(case: Any, device: str = "CPU") -> tuple[bool, str]:
    """Run one onnx backend node TestCase (from collect_testcases()); (passed, message)."""
    try:
        rep = NetquantBackend.prepare(case.model, device)
        for k, (inputs, ref_outputs) in enumerate(case.data_sets or []):
            outputs = rep.run([onnx.numpy_helper.to_array(x) if isinstance(x, onnx.TensorProto) else x
                               for x in inputs])
            refs = [onnx.numpy_helper.to_array(x) if isinstance(x, onnx.TensorProto) else x
                    for x in ref_outputs]
            if len(outputs) != len(refs):
                return False, f"data set {k}: {len(outputs)} outputs, expected {len(refs)}"
            for i, (ref, out) in enumerate(zip(refs, outputs)):
                _assert_similar(ref, out, case.rtol, case.atol, f"data set {k} output {i}")
    except (NetquantError, AssertionError, DataError, ModelError) as exc:
        return False, f"{type(exc).__name__}: {str(exc)[:500]}"
    except Exception as exc:  # an op implementation crashing is a failure, reported not raised
        return False, f"{type(exc).__name__}: {str(exc)[:500]}"
    return True, "ok"
