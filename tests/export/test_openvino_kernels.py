"""What OpenVINO's CPU plugin computes in its int8 Convolution / FullyConnected on this CPU, probed with one-layer
QDQ models, and the openvino_int8 weights that follow from it (platforms/builtin.py, OpenVINO section).

On x86 without VNNI the plugin shifts signed activations to u8 (+128) and adds the u8 x s8 products of input
channels (2j, 2j+1) of one kernel tap (MatMul: rows 2j, 2j+1 of K) in a saturating int16 (vpmaddubsw); odd channel
counts are padded. With VNNI / AMX / ARM every sum is exact.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import netquant
from netquant.errors import ExportError
from netquant.graph.op_config import TensorRole
from netquant.passes.quant_graph import constant_codes
from netquant.platforms.targets import WeightScheme, cpu_info
from tests.helpers.ir import make_model

ov = pytest.importorskip("openvino")

# int16 pair sums saturate in OpenVINO's u8 x s8 kernels only on x86 CPUs without VNNI (this EPYC: AVX2)
PAIRS_SATURATE = cpu_info().arch in ("x86_64", "AMD64") and not cpu_info().has_vnni
A = 127  # activation code: +128 in the kernel = 255, the largest u8


def _run(model: onnx.ModelProto, x: np.ndarray) -> tuple[np.ndarray, list[str]]:
    compiled = ov.Core().compile_model(ov.Core().read_model(model.SerializeToString(), b""), "CPU",
                                       {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": "1"})
    precisions = [op.get_rt_info()["runtimePrecision"].astype(str) for op in compiled.get_runtime_model().get_ordered_ops()
                  if op.get_rt_info()["layerType"].astype(str) in ("Convolution", "FullyConnected", "MatMul")]
    return compiled(x)[0], precisions


def _one_layer(op: str, codes: np.ndarray, x_shape: tuple[int, ...]) -> onnx.ModelProto:
    """x -> Q/DQ (int8, scale 1) -> Conv / MatMul with int8 weight `codes` (per-channel scale 1): integer outputs."""
    channels = codes.shape[0] if op == "Conv" else codes.shape[1]
    inits = [numpy_helper.from_array(np.array(1.0, np.float32), "s"), numpy_helper.from_array(np.array(0, np.int8), "z"),
             numpy_helper.from_array(codes.astype(np.int8), "wq"),
             numpy_helper.from_array(np.ones(channels, np.float32), "ws"),
             numpy_helper.from_array(np.zeros(channels, np.int8), "wz")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["w"], axis=0 if op == "Conv" else 1),
             helper.make_node(op, ["xd", "w"], ["y"])]
    graph = helper.make_graph(nodes, "probe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def _expected(exact: int, codes: tuple[int, int] | None) -> int:
    """The kernel's result for activations all A and one weight pair `codes` the kernel adds together (None: the
    two weights fall in different pairs): the saturated pair minus the +128 shift's compensation."""
    if codes is None or not PAIRS_SATURATE:
        return exact
    pair = (A + 128) * sum(codes)
    return min(pair, 32767) - 128 * sum(codes)


@pytest.mark.parametrize(("where", "pair"), [((0, 1), True), ((1, 2), False), ((0, 2), False), ((0, 4), False)])
@pytest.mark.parametrize("codes", [(127, 127), (65, 64), (64, 64)])
def test_matmul_adds_rows_2j_2j1_in_int16(where: tuple[int, int], pair: bool, codes: tuple[int, int]) -> None:
    w = np.zeros((8, 16), np.int64)
    w[list(where), 0] = codes
    x = np.full((1, 4, 8), A, np.float32)
    y, precisions = _run(_one_layer("MatMul", w, x.shape), x)
    assert precisions == ["i8"]
    exact = A * sum(codes)
    # (127, 127) on one pair: 255 instead of 32258; (65, 64): 16255 instead of 16383; |q0| + |q1| <= 128 is exact
    assert y[0, 0, 0] == _expected(exact, codes if pair and sum(codes) > 128 else None)


@pytest.mark.parametrize(("channels", "taps", "pair"), [
    (8, [(0, 0), (1, 0)], True),   # channels 0, 1 of one tap: one pair
    (8, [(1, 0), (2, 0)], False),
    (8, [(7, 0), (0, 1)], False),  # the last channel of tap 0 and the first of tap 1: NHWC neighbours, not a pair
    (3, [(0, 1), (1, 1)], True),   # 3 channels: padded to 4 per tap, channels 0, 1 of tap 1 are a pair ...
    (3, [(2, 0), (0, 1)], False),  # ... while NHWC order K = 3 * tap + c would pair K = 2, 3 here
])
def test_conv_adds_channels_2j_2j1_of_one_tap_in_int16(channels: int, taps: list[tuple[int, int]],
                                                       pair: bool) -> None:
    w = np.zeros((16, channels, 3, 3), np.int64)
    for c, tap in taps:
        w[0, c, tap // 3, tap % 3] = 127
    x = np.full((1, channels, 6, 6), A, np.float32)
    y, precisions = _run(_one_layer("Conv", w, x.shape), x)
    assert precisions == ["u8"]
    assert y[0, 0, 2, 2] == _expected(2 * A * 127, (127, 127) if pair else None)


# ---- the openvino_int8 weights these kernels need -----------------------------------------------

def _positive_net(seed: int = 0) -> onnx.ModelProto:
    """x[N,3,8,16] -> Conv 3x3 (3 channels) -> Relu -> Conv 1x1 -> Relu -> Conv 1x1: mostly positive weights, so
    full-range int8 codes fill same-sign pairs that saturate the int16 sums."""
    rng = np.random.default_rng(seed)

    def weight(*shape: int) -> np.ndarray:
        w = np.abs(rng.standard_normal(shape)) * np.where(rng.random(shape) < 0.9, 1.0, -1.0)
        return (w / np.sqrt(np.prod(shape[1:]))).astype(np.float32)

    inits = [numpy_helper.from_array(weight(16, 3, 3, 3), "w0"), numpy_helper.from_array(weight(32, 16, 1, 1), "w1"),
             numpy_helper.from_array(weight(32, 32, 1, 1), "w2")]
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"], name="conv0", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
             helper.make_node("Conv", ["r0", "w1"], ["c1"], name="conv1"),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2"], ["y"], name="conv2")]
    graph = helper.make_graph(nodes, "positive", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 32, 8, 16])], inits)
    return make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def _quantize(model: onnx.ModelProto, x: np.ndarray, **settings):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return netquant.quantize_onnx(model, {"x": x}, platform="openvino_int8", quiet=True, objective=None,
                                      **settings)


def _codes(qm, name: str) -> torch.Tensor:
    oc = qm.qgraph.op_configs[name]
    w_idx = oc.input_index(TensorRole.WEIGHT)
    return constant_codes(qm.graph.initializers[oc.op.inputs[w_idx]].float(), oc.inputs[w_idx]).to(torch.int32)


@pytest.fixture(scope="module")
def positive():
    x = np.random.default_rng(1).random((16, 3, 8, 16)).astype(np.float32)
    return _positive_net(), x


def test_pair_limited_weights_in_openvinos_order(positive) -> None:
    model, x = positive
    qm = _quantize(model, x)
    assert qm.platform.weight_scheme is WeightScheme.INT8_PAIR_LIMITED and qm.platform.bias_correction
    # 3 input channels, 3x3 kernel: OpenVINO's pairs are not NHWC's, so 7-bit codes (never saturate)
    assert int(_codes(qm, "conv0").abs().max()) <= 64
    for name in ("conv1", "conv2"):  # 1x1, even channels: codes beyond 7 bits, each same-sign pair (2j, 2j+1) <= 128
        q = _codes(qm, name).reshape(32, -1, 2)
        assert int(q.abs().max()) > 64
        same = (q[..., 0] * q[..., 1]) > 0
        assert int((q.abs().sum(-1) * same).max()) <= 128
    # a file for VNNI CPUs keeps full int8 codes on the first conv too
    assert int(_codes(_quantize(model, x, target="x86-vnni"), "conv0").abs().max()) == 127


def test_openvino_computes_the_fake_quant_model(positive, tmp_path: Path) -> None:
    """The pair-limited file agrees with netquant's fake-quant in OpenVINO on this CPU; full int8 weights (the
    x86-vnni file) do not where pairs saturate."""
    model, x = positive
    test = np.random.default_rng(2).random((4, 3, 8, 16)).astype(np.float32)

    def ov_vs_fake_quant(qm, path: Path, validate: bool) -> float:
        report = qm.export(path, validate=validate)
        assert sum(report.int8_layers.values()) == 3  # all three convs run int8
        got = ov.Core().compile_model(str(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})(test)[0]
        fq = qm.run({"x": test})["y"].numpy()
        return float(np.abs(got - fq).max() / np.abs(fq).max())

    err = ov_vs_fake_quant(_quantize(model, x), tmp_path / "pairs.xml", validate=True)
    assert err < 1e-4  # measured 2e-7: OpenVINO computes the fake-quant model
    full = ov_vs_fake_quant(_quantize(model, x, target="x86-vnni"), tmp_path / "int8.xml", validate=False)
    if PAIRS_SATURATE:
        assert full > 0.01  # measured 0.049 on the AVX2 EPYC: saturated pair sums
    else:
        assert full < 1e-4


def test_full_int8_weights_for_target_any_are_refused(positive, tmp_path: Path) -> None:
    """uint8 activations make the export's saturation check see OpenVINO's u8 x s8 sites (with the earlier signed
    activations it skipped them and such a file silently lost rec to 77.5% exact lines)."""
    model, x = positive
    with pytest.raises(ExportError, match=r"targets CPU 'any'.*Conv 'conv1'.*weight_scheme='int8-pairs'"):
        _quantize(model, x, weight_scheme="int8").export(tmp_path / "m.xml")
    assert list(tmp_path.iterdir()) == []
