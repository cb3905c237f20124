"""Calibrated activation ranges rounded outward to `range_bits` significant bits (thread-count independence)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import netquant
from netquant.calib.ranges import round_range_outward
from netquant.errors import ConfigError
from tests.helpers.onnx_models import calib_batches, conv_relu_gemm

ORT = "onnxruntime_int8"


def _activation_scales(qm) -> list[float]:
    return [float(s) for cfg in qm.qgraph.op_configs.values() for c in cfg.inputs + cfg.outputs
            if c is not None and c.params is not None and c.params.scale.numel() == 1
            for s in [c.params.scale]]


@pytest.mark.parametrize("observer", ["minmax", "mse"])
def test_summation_order_noise_does_not_reach_the_scales(observer):
    # inputs perturbed by 1e-6 relative, the size of a change of torch's thread count in a conv's sums
    batches = calib_batches((2, 3, 8, 8), 3, seed=4)
    rng = np.random.default_rng(1)
    noisy = [(b * (1 + 1e-6 * rng.standard_normal(b.shape))).astype(np.float32) for b in batches]
    kw = {"platform": ORT, "quiet": True, "activation_observer": observer}
    a = _activation_scales(netquant.quantize_onnx(conv_relu_gemm(), batches, **kw))
    b = _activation_scales(netquant.quantize_onnx(conv_relu_gemm(), noisy, **kw))
    assert a == b
    raw_a = _activation_scales(netquant.quantize_onnx(conv_relu_gemm(), batches, range_bits=None, **kw))
    raw_b = _activation_scales(netquant.quantize_onnx(conv_relu_gemm(), noisy, range_bits=None, **kw))
    assert raw_a != raw_b  # without rounding the noise shows


def test_default_params_are_torch_minmax_of_the_rounded_range():
    batches = calib_batches((2, 3, 8, 8), 3)
    qm = netquant.quantize_onnx(conv_relu_gemm(), batches, platform=ORT, quiet=True, activation_observer="minmax")
    obs = torch.ao.quantization.MinMaxObserver(dtype=torch.quint8, qscheme=torch.per_tensor_affine)
    for b in batches:
        obs(torch.from_numpy(b))
    lo, hi = round_range_outward(obs.min_val.reshape(1), obs.max_val.reshape(1))
    obs.min_val, obs.max_val = lo[0], hi[0]
    scale, zp = obs.calculate_qparams()
    p = qm.qgraph.op_configs["conv"].inputs[0].params
    torch.testing.assert_close(p.scale.reshape(1), scale.float(), rtol=1e-6, atol=0)
    assert int(p.zero_point) == int(zp)


@pytest.mark.parametrize("bad", [0, 1, 53, 2.5, "8"])
def test_bad_range_bits_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="range_bits"):
        netquant.quantize_onnx(conv_relu_gemm(), calib_batches((2, 3, 8, 8), 1), platform=ORT, quiet=True,
                               range_bits=bad)
