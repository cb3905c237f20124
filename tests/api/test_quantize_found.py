"""quantize_onnx on models that used to fail only at export (issue 19): initializers that are also graph inputs,
outputs / inputs whose type has no shape."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from netquant.api import quantize_onnx
from netquant.graph import load_onnx
from tests.helpers.found_models import initializer_inputs_model, untyped_io


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b))


def _ort(path: Path | onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    source = str(path) if isinstance(path, Path) else path.SerializeToString()
    return ort.InferenceSession(source, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _batches(shape: tuple[int, ...], n: int = 4, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(n)]


@pytest.mark.parametrize("objective", [None, "balanced"])
def test_initializers_listed_as_inputs_are_quantized_as_initializers(tmp_path: Path, objective: str | None) -> None:
    """The weights are constants, as onnxruntime runs them unfed: the export validates (it failed with "Required
    inputs (['wg', 'bg']) are missing") and takes x alone, and agrees with the FP32 model run in onnxruntime."""
    model = initializer_inputs_model()
    assert [i.name for i in model.graph.input] == ["x", "w", "b", "wg", "bg"]
    qm = quantize_onnx(model, _batches((1, 3, 8, 8)), quiet=True, objective=objective)
    out = tmp_path / "q.onnx"
    qm.export(out)
    q = onnx.load(out)
    assert [i.name for i in q.graph.input] == ["x"]
    assert {n.op_type for n in q.graph.node} >= {"QuantizeLinear", "DequantizeLinear", "Conv", "Gemm"}
    x = _batches((1, 3, 8, 8), 1, seed=9)[0]
    assert _cosine(_ort(out, {"x": x}), _ort(model, {"x": x})) > 0.99


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_torch_export_with_keep_initializers_as_inputs(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                              torch.nn.Flatten(), torch.nn.Linear(8, 4)).eval()
    path = tmp_path / "m.onnx"
    torch.onnx.export(net, (torch.randn(1, 3, 12, 12),), str(path), keep_initializers_as_inputs=True, dynamo=False,
                      input_names=["x"], output_names=["y"])
    assert len(onnx.load(path).graph.input) == 5
    qm = quantize_onnx(str(path), _batches((1, 3, 12, 12)), quiet=True, objective=None)
    qm.export(tmp_path / "q.onnx")
    x = _batches((1, 3, 12, 12), 1, seed=3)[0]
    with torch.no_grad():
        ref = net(torch.from_numpy(x)).numpy()
    assert _cosine(_ort(tmp_path / "q.onnx", {"x": x}), ref) > 0.99


def test_the_graph_layer_still_keeps_them_overridable() -> None:
    """load_onnx keeps them as inputs by default (a lossless round trip); overridable_inputs=False drops them."""
    model = initializer_inputs_model()
    assert [v.name for v in load_onnx(model).initializer_inputs] == ["w", "b", "wg", "bg"]
    plain = load_onnx(model, overridable_inputs=False)
    assert plain.initializer_inputs == [] and plain.input_names == ["x"] and "wg" in plain.initializers


@pytest.mark.filterwarnings("ignore::netquant.api.quantize.ModelCheckWarning")
@pytest.mark.parametrize("case", ["output_no_type", "output_no_elem", "output_no_shape", "input_no_shape"])
def test_incomplete_input_and_output_types_export_a_checked_model(tmp_path: Path, case: str) -> None:
    """The export writes the inferred type (rank from the calibration data where the input has none) instead of
    failing onnx.checker; the file runs in onnxruntime and matches the FP32 model."""
    model = untyped_io(case)
    batches = _batches((1, 3, 8, 8))
    qm = quantize_onnx(model, batches, quiet=True, objective=None)
    out = tmp_path / "q.onnx"
    qm.export(out, sample={"x": batches[0]}, allow_float=True)  # (dynamic input: validated on a real batch; the
    # untyped toy has nothing onnxruntime_int8 quantizes: this test is about its types)
    q = onnx.load(out)
    onnx.checker.check_model(q)
    y = q.graph.output[0].type.tensor_type
    assert y.elem_type == onnx.TensorProto.FLOAT and len(y.shape.dim) == 4 and y.shape.dim[1].dim_value == 4
    assert len(q.graph.input[0].type.tensor_type.shape.dim) == 4
    x = _batches((1, 3, 8, 8), 1, seed=5)[0]
    reference = untyped_io("output_no_shape")  # the same weights, a model onnxruntime loads in every case
    assert _cosine(_ort(out, {"x": x}), _ort(reference, {"x": x})) > 0.99
