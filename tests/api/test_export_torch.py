"""quantize_torch -> export_qdq: a torch module ends as a validated QDQ file onnxruntime runs."""

from __future__ import annotations

import warnings
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest
import torch

import netquant
from netquant.export import export_qdq
from netquant.export.validate import cosine


class SmallNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
            torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1))
        self.head = torch.nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def test_quantize_torch_exports_a_qdq_model_close_to_the_module(tmp_path: Path) -> None:
    net = SmallNet().eval()
    gen = torch.Generator().manual_seed(1)
    calib = torch.randn(32, 3, 12, 12, generator=gen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qm = netquant.quantize_torch(net, calib[:1], calib, dynamic_axes={"input_0": {0: "batch"}}, quiet=True)
    report = export_qdq(qm, tmp_path / "net.onnx")  # a QuantizedModel is accepted as well
    assert report.int8_kernels and report.int8_kernels.get("QLinearConv", 0) >= 1
    model = onnx.load(str(tmp_path / "net.onnx"))
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    x = torch.randn(4, 3, 12, 12, generator=gen)
    got = ort.InferenceSession(str(tmp_path / "net.onnx"), providers=["CPUExecutionProvider"]).run(
        None, {"input_0": x.numpy()})[0]
    with torch.no_grad():
        ref = net(x).numpy()
    assert got.shape == ref.shape and cosine(ref, got) > 0.99


def test_quantize_torch_uses_the_one_torch_to_onnx_path() -> None:
    """quantize_torch exports through netquant.nn.export.torch_to_onnx: opset EXPORT_OPSET by default, named
    dynamic dims kept, and an opset the torch.export-based exporter cannot emit is a ModelError saying so."""
    from netquant.errors import ModelError
    from netquant.nn.export import EXPORT_OPSET, MIN_OPSET, torch_to_onnx

    net = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU()).eval()
    x = torch.randn(3, 6)
    proto = torch_to_onnx(net, (x,), input_names=["x"], dynamic_axes={"x": {0: "batch"}})
    assert [o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")] == [EXPORT_OPSET]
    assert proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    with pytest.raises(ModelError, match=f"opset 17 is too old.*>= {MIN_OPSET}"):
        netquant.quantize_torch(net, x, x, opset=17, quiet=True)
