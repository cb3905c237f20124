"""QDQ ONNX export: onnxruntime reproduces the fake-quant model for every preset; errors; atomic writes."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import netquant.nn as nqnn
from netquant.core.spec import QuantSpec, RoundingPolicy
from netquant.errors import ExportError
from netquant.nn.rules import LayerQuantConfig, QuantizerConfig, QuantRule
from tests.helpers.ranges import amax_out


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2), nn.Flatten(),
                         nn.Linear(8 * 4 * 4, 32), nn.ReLU(), nn.Linear(32, 4))


def _calibrated(cfg: nqnn.ModelQuantConfig, x: torch.Tensor) -> nn.Module:
    q = nqnn.quantize_model(_model(), cfg)
    with nqnn.calibrate(q):
        q(x)
    return q


def _run_literal(path, x: torch.Tensor) -> np.ndarray:
    """onnxruntime without graph fusion: the Q/DQ nodes are computed as written."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]


PRESETS = {
    "int8": (nqnn.ModelQuantConfig.int8_tensorrt(), 21, "INT8"),
    "int8_opset18": (nqnn.ModelQuantConfig.int8_tensorrt(), 18, "INT8"),
    "w4a4_opset18": (nqnn.ModelQuantConfig.w4a4(activation_observer="minmax"), 18, "INT8"),  # int8 + clamp
    "w4a4": (nqnn.ModelQuantConfig.w4a4(activation_observer="minmax"), 21, "INT4"),
    "w4a16_per_group": (nqnn.ModelQuantConfig.w4a16(group_size=16), 21, "INT4"),
    "fp8": (nqnn.ModelQuantConfig.fp8(), 21, "FLOAT8E4M3FN"),
}


SLOW_PRESETS = {"int8_opset18", "w4a4_opset18"}


@pytest.mark.parametrize("preset", [pytest.param(p, marks=pytest.mark.slow) if p in SLOW_PRESETS else p
                                    for p in PRESETS])
def test_onnxruntime_matches_fake_quant_model(preset, tmp_path):
    cfg, opset, qtype = PRESETS[preset]
    x = torch.rand(6, 3, 8, 8)
    q = _calibrated(cfg, x)
    path = nqnn.export_onnx(q, x[:2], tmp_path / f"{preset}.onnx", opset=opset)
    proto = onnx.load(path)
    assert proto.opset_import[0].version == opset
    dq_nodes = [n for n in proto.graph.node if n.op_type == "DequantizeLinear"]
    assert dq_nodes
    # the integer type of the DQ inputs (zero-point initializers / constants carry it)
    zp_types = set()
    inits = {i.name: i for i in proto.graph.initializer}
    for node in dq_nodes:
        if len(node.input) > 2 and node.input[2] in inits:
            zp_types.add(onnx.TensorProto.DataType.Name(inits[node.input[2]].data_type))
    assert qtype in zp_types, zp_types
    # weights are stored in their quantized type (no float weight -> QuantizeLinear left), FP8 too
    assert not [n for n in proto.graph.node if n.op_type == "QuantizeLinear" and n.input[0] in inits]
    int_weights = [inits[n.input[0]] for n in dq_nodes if n.input[0] in inits]
    assert len(int_weights) == 3 and all(onnx.TensorProto.DataType.Name(t.data_type) == qtype for t in int_weights)
    if preset == "w4a16_per_group":
        blocks = [a.i for n in dq_nodes for a in n.attribute if a.name == "block_size"]
        assert 16 in blocks
        assert not [n for n in proto.graph.node if n.op_type == "QuantizeLinear"]  # weight-only: no Q at all
    with torch.no_grad():
        ref = q(x).numpy()
    got = _run_literal(path, x)  # dynamic batch: 6 rows through a model exported with 2
    close = np.isclose(got, ref, rtol=1e-4, atol=1e-4)
    assert close.mean() >= 0.95, (preset, close.mean(), np.abs(got - ref).max())
    assert np.abs(got - ref).max() < 0.1 * np.abs(ref).max()


def test_weights_exported_exactly_for_any_rounding(tmp_path):
    spec = QuantSpec.int8_per_channel(axis=0, narrow_range=True, rounding=RoundingPolicy.ROUND_HALF_UP)
    layer = LayerQuantConfig(weight=QuantizerConfig(spec))
    q = nqnn.quantize_model(nn.Linear(16, 4), nqnn.ModelQuantConfig((QuantRule(layer=layer),)))
    x = torch.randn(3, 16)
    path = nqnn.export_onnx(q, x, tmp_path / "w.onnx")
    with torch.no_grad():
        np.testing.assert_allclose(_run_literal(path, x), q(x).numpy(), rtol=1e-5, atol=1e-6)


def test_reduced_bit_activations_get_a_clamp(tmp_path):
    act = QuantizerConfig(QuantSpec(bits=6, signed=False, symmetric=False))
    q = nqnn.quantize_model(nn.Linear(8, 3), nqnn.ModelQuantConfig((QuantRule(layer=LayerQuantConfig(input=act)),)))
    calib = torch.randn(32, 8)
    with nqnn.calibrate(q):
        q(calib)
    x = calib * 3  # outside the calibrated range: the 6-bit clamp matters
    path = nqnn.export_onnx(q, x, tmp_path / "a6.onnx", opset=18)
    with torch.no_grad():
        np.testing.assert_allclose(_run_literal(path, x), q(x).numpy(), rtol=1e-5, atol=1e-5)


def test_uncalibrated_quantizers_are_named_and_nothing_is_written(tmp_path):
    q = nqnn.quantize_model(_model())
    target = tmp_path / "m.onnx"
    with pytest.raises(ExportError, match=r"0\.input_quantizer.*4\.input_quantizer"):
        nqnn.export_onnx(q, torch.rand(2, 3, 8, 8), target)
    assert not target.exists() and list(tmp_path.iterdir()) == []


def test_export_errors(tmp_path):
    x = torch.rand(2, 3, 8, 8)
    q = _calibrated(nqnn.ModelQuantConfig.int8_tensorrt(), x)
    with pytest.raises(ExportError, match="opset"):
        nqnn.export_onnx(q, x, tmp_path / "m.onnx", opset=11)
    with pytest.raises(ExportError, match="does not exist"):
        nqnn.export_onnx(q, x, tmp_path / "missing" / "m.onnx")
    w4 = _calibrated(nqnn.ModelQuantConfig.w4a16(group_size=16), x)
    with pytest.raises(ExportError, match="per-group.*opset >= 21"):
        nqnn.export_onnx(w4, x, tmp_path / "m.onnx", opset=18)
    fp8 = _calibrated(nqnn.ModelQuantConfig.fp8(), x)
    with pytest.raises(ExportError, match="FP8.*opset >= 19"):
        nqnn.export_onnx(fp8, x, tmp_path / "m.onnx", opset=18)
    with pytest.raises(ExportError, match="calibration mode"), nqnn.calibrate(q):
        nqnn.export_onnx(q, x, tmp_path / "m.onnx")
    assert list(tmp_path.iterdir()) == []
    torch.testing.assert_close(q(x), q(x))  # the model still runs after the failures


def test_overwrite_is_atomic_and_deterministic(tmp_path):
    x = torch.rand(2, 3, 8, 8)
    q = _calibrated(nqnn.ModelQuantConfig.int8_tensorrt(), x)
    path = tmp_path / "m.onnx"
    nqnn.export_onnx(q, x, path)
    first = path.read_bytes()
    nqnn.export_onnx(q, x, path)
    assert path.read_bytes() == first
    assert [p.name for p in tmp_path.iterdir()] == ["m.onnx"]


class _EveryModule(nn.Module):
    """Embedding -> LSTM -> add / matmul / cat sites -> ConvTranspose1d -> adaptive pool."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.lstm = nn.LSTM(8, 8, batch_first=True)
        self.ct = nn.ConvTranspose1d(8, 4, 3, stride=2)
        self.pool = nn.AdaptiveAvgPool1d(2)
        self.add, self.mm, self.cat = nqnn.QuantAdd(), nqnn.QuantMatmul(), nqnn.QuantCat(dim=1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        e = self.emb(idx)
        h, _ = self.lstm(e)
        z = self.add(h, e)
        z = self.mm(z, z.transpose(1, 2))
        return self.pool(self.ct(self.cat([z, z])[:, :8]))


def test_every_module_kind_exports_and_matches(tmp_path):
    torch.manual_seed(0)
    q = nqnn.quantize_model(_EveryModule())
    assert isinstance(q.lstm, nqnn.QuantLSTM) and isinstance(q.ct, nqnn.QuantConvTranspose1d)
    idx = torch.randint(0, 20, (4, 6))
    with nqnn.calibrate(q):
        q(idx)
    path = nqnn.export_onnx(q, idx, tmp_path / "every.onnx")
    ops = {n.op_type for n in onnx.load(path).graph.node}
    assert {"LSTM", "ConvTranspose", "Gather", "MatMul", "Concat"} <= ops
    with torch.no_grad():
        np.testing.assert_allclose(_run_literal(path, idx), q(idx).numpy(), rtol=1e-5, atol=1e-5)


def test_whole_quantized_model_pickles():
    import io

    x = torch.rand(2, 3, 8, 8)
    q = _calibrated(nqnn.ModelQuantConfig.int8_tensorrt(), x)
    buffer = io.BytesIO()
    torch.save(q, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(loaded(x), q(x))


class _SharedInput(nn.Module):
    """One Embedding output read by two quantized Linears: two identical narrow-range clamps on one tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        e = self.emb(idx)
        return self.a(e) + self.b(e)


def test_narrow_activation_clip_on_a_shared_tensor_exports(tmp_path):
    """int8_tensorrt activations are [-127, 127]: the file clips at +-127 s before QuantizeLinear (exact vs
    the eager fake quant), and a tensor feeding two quantizers exports (torch.onnx once lost a clamp bound)."""
    torch.manual_seed(0)
    q = nqnn.quantize_model(_SharedInput(), nqnn.ModelQuantConfig.int8_tensorrt())
    idx = torch.randint(0, 20, (4, 6))
    with nqnn.calibrate(q):
        q(idx)
    s = q.a.input_quantizer.scale.item()
    assert s == pytest.approx(amax_out(q.emb(idx).detach().abs().max()) / 127)
    path = nqnn.export_onnx(q, idx, tmp_path / "shared.onnx")
    proto = onnx.load(path)
    clips = [n for n in proto.graph.node if n.op_type == "Clip"]
    assert clips
    consts = {n.output[0]: onnx.numpy_helper.to_array(n.attribute[0].t) for n in proto.graph.node
              if n.op_type == "Constant"}
    consts.update({i.name: onnx.numpy_helper.to_array(i) for i in proto.graph.initializer})
    bounds = {(float(consts[c.input[1]]), float(consts[c.input[2]])) for c in clips}
    assert bounds == {(np.float32(-127 * np.float32(s)), np.float32(127 * np.float32(s)))}
    with torch.no_grad():
        np.testing.assert_allclose(_run_literal(path, idx), q(idx).numpy(), rtol=1e-6, atol=1e-6)
