"""quantize_torch cases that gave tracebacks or changed the caller's module (issue 19)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from netquant.api import quantize_torch
from netquant.errors import ModelError


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                               torch.nn.Dropout(0.5), torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 8, 4))


def _data(n: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(1, 3, 8, 8, generator=g) for _ in range(n)]


def _agrees_with_torch(qm, net: torch.nn.Module, tmp_path: Path) -> float:
    qm.export(tmp_path / "q.onnx")
    x = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = net.eval()(x).numpy()
    out = ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"]).run(
        None, {"input_0": x.numpy()})[0]
    return float((out * ref).sum() / np.linalg.norm(out) / np.linalg.norm(ref))


def test_the_callers_train_mode_is_restored(tmp_path: Path) -> None:
    net = _net().train()
    net[3].eval()  # a mixed mode survives too
    qm = quantize_torch(net, _data()[0], _data(), quiet=True, objective=None)
    assert net.training and net[1].training and not net[3].training
    assert _agrees_with_torch(qm, net, tmp_path) > 0.99  # exported in eval mode (BatchNorm statistics, no dropout)


def test_under_inference_mode(tmp_path: Path) -> None:
    net = _net().eval()
    with torch.inference_mode():
        data = _data()  # inference tensors
        qm = quantize_torch(net, data[0], data, quiet=True, objective=None)
    assert _agrees_with_torch(qm, net, tmp_path) > 0.99


def test_a_meta_module_is_refused_naming_the_tensor() -> None:
    with pytest.raises(ModelError, match=r"Sequential has tensor '0.weight' on the 'meta' device.*to_empty"):
        quantize_torch(_net().to("meta"), _data()[0], _data(), quiet=True)


def test_an_already_quantized_module_is_refused_in_one_clean_line() -> None:
    from netquant.nn import quantize_model

    with pytest.raises(ModelError) as info:
        quantize_torch(quantize_model(_net()), _data()[0], _data(), quiet=True)
    message = str(info.value)
    assert "already quantized by netquant.nn" in message and "'0.input_quantizer' is a TensorQuantizer" in message
    assert "\x1b[" not in message and "\n" not in message and "export_onnx" in message


def test_torch_export_failures_report_the_root_cause_without_colour_codes() -> None:
    """A module torch.export cannot trace: the message is the cause's first line, not torch.onnx's step banner."""

    class DataDependent(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[x > 0].reshape(1, -1) if int(x.sum()) > 0 else x

    with pytest.raises(ModelError) as info:
        quantize_torch(DataDependent(), _data()[0], _data(), quiet=True)
    message = str(info.value)
    assert "\x1b[" not in message and "\n" not in message and "step 1/3" not in message
    assert "quantize_torch: torch.onnx could not export DataDependent:" in message
