"""A user's GPU model: quantize_torch given a CUDA module with CUDA example and calibration tensors, and
calibration on the GPU (device='cuda'), against the same model quantized on the CPU; the files checked in
onnxruntime. Skipped on machines without CUDA (CI has none: these run on a GPU machine)."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper as nh

import netquant

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def _cnn() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10)).eval()


def _batches(count: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.rand(4, 3, 32, 32, generator=g) for _ in range(count)]


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _scales(path) -> dict[str, np.ndarray]:
    """Every float initializer feeding a QuantizeLinear / DequantizeLinear as its scale (input 1), by node name."""
    proto = onnx.load(str(path))
    inits = {t.name: nh.to_array(t) for t in proto.graph.initializer}
    return {n.name: inits[n.input[1]] for n in proto.graph.node
            if n.op_type in ("QuantizeLinear", "DequantizeLinear") and n.input[1] in inits}


def _ort(path, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


def test_cuda_module_and_tensors_give_the_cpu_copy_s_quantization(tmp_path):
    model, batches = _cnn(), _batches()
    on_cpu = netquant.quantize_torch(model, batches[0], batches, quiet=True, objective=None)
    cpu_path = on_cpu.export(tmp_path / "cpu.onnx").path
    gpu_model = copy.deepcopy(model).cuda()
    on_gpu = netquant.quantize_torch(gpu_model, batches[0].cuda(), [b.cuda() for b in batches], quiet=True,
                                     objective=None)
    gpu_path = on_gpu.export(tmp_path / "gpu.onnx").path
    assert next(gpu_model.parameters()).is_cuda  # the caller's module stays where it was
    cpu_scales, gpu_scales = _scales(cpu_path), _scales(gpu_path)
    assert cpu_scales.keys() == gpu_scales.keys() and cpu_scales
    for name, s in cpu_scales.items():  # the CUDA export's weights differ from the CPU's in float rounding only
        np.testing.assert_allclose(gpu_scales[name], s, rtol=1e-4, err_msg=name)
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ref = model(x).numpy()
    assert _cosine(ref, _ort(gpu_path, x.numpy())) > 0.999
    assert _cosine(_ort(cpu_path, x.numpy()), _ort(gpu_path, x.numpy())) > 0.9999


def test_calibration_on_the_gpu_matches_the_cpu(tmp_path):
    model, batches = _cnn(), _batches()
    on_cpu = netquant.quantize_torch(model, batches[0], batches, quiet=True, objective=None)
    on_gpu = netquant.quantize_torch(model, batches[0], batches, quiet=True, objective=None, device="cuda")
    cpu_scales = _scales(on_cpu.export(tmp_path / "cpu.onnx").path)
    gpu_path = on_gpu.export(tmp_path / "gpu.onnx").path
    gpu_scales = _scales(gpu_path)
    assert cpu_scales.keys() == gpu_scales.keys() and cpu_scales
    for name, s in cpu_scales.items():  # (cuDNN's convolutions round differently from the CPU's)
        np.testing.assert_allclose(gpu_scales[name], s, rtol=1e-3, err_msg=name)
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ref = model(x).numpy()
    assert _cosine(ref, _ort(gpu_path, x.numpy())) > 0.999


def test_hf_bert_on_the_gpu_with_keyword_inputs(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=64)
    model = transformers.BertModel(cfg).eval()
    rng = np.random.default_rng(0)

    def feeds(batch: int, seq: int) -> dict[str, np.ndarray]:
        mask = np.ones((batch, seq), dtype=np.int64)
        mask[0, seq - seq // 4:] = 0
        return {"input_ids": rng.integers(0, 1000, (batch, seq), dtype=np.int64), "attention_mask": mask,
                "token_type_ids": np.zeros((batch, seq), dtype=np.int64)}

    def on_gpu(f: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        return {k: torch.from_numpy(v).cuda() for k, v in f.items()}

    gpu_model = copy.deepcopy(model).cuda()
    calib = [on_gpu(feeds(2, 16)) for _ in range(8)]
    qm = netquant.quantize_torch(gpu_model, on_gpu(feeds(1, 16)), calib, quiet=True, objective=None,
                                 device="cuda")
    path = qm.export(tmp_path / "bert.onnx").path
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    f = feeds(3, 24)
    with torch.no_grad():
        ref = model(**{k: torch.from_numpy(v) for k, v in f.items()}).last_hidden_state.numpy()
    assert _cosine(ref, sess.run(None, f)[0]) > 0.995
