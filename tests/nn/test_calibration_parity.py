"""One calibration flow: the module API (nn.calibrate) and graph PTQ (passes.calibration) of the same model on the
same data give identical scales (same observers, same range rules in netquant.calib.ranges)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

import netquant
import netquant.nn as nqnn
from netquant.nn.export import torch_to_onnx


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 5)).eval()


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(8, 12, generator=gen) * 2 for _ in range(4)]


def _graph_scales(model: nn.Module, batches: list[torch.Tensor], observer: str, **settings) -> list[torch.Tensor]:
    """[input scale, weight scales] of each Gemm/MatMul in order, from quantize_onnx on the exported model."""
    proto = torch_to_onnx(model, (batches[0],), input_names=["x"], dynamic_axes={"x": {0: "N"}})
    qm = netquant.quantize_onnx(proto, [b.numpy() for b in batches], "tensorrt_int8", quiet=True,
                                activation_observer=observer, **settings)
    out = []
    for oc in qm.qgraph.op_configs.values():
        if oc.op.op_type in ("Gemm", "MatMul"):
            out += [oc.inputs[0].effective_params.scale, oc.weight_config().params.scale]
    return out


def _module_scales(model: nn.Module, batches: list[torch.Tensor], observer: str, **layer) -> list[torch.Tensor]:
    cfg = nqnn.ModelQuantConfig.int8_tensorrt(activation_observer=observer)
    if layer:  # e.g. range_bits=None on the activation quantizers
        rule = cfg.rules[0]
        cfg = replace(cfg, rules=(replace(rule, layer=replace(rule.layer, input=replace(rule.layer.input, **layer))),))
    q = nqnn.quantize_model(model, cfg)
    with nqnn.calibrate(q):
        for b in batches:
            q(b)
    return [t for i in (0, 2) for t in (q[i].input_quantizer.scale.detach(), q[i].weight_quantizer.scale.detach())]


@pytest.mark.parametrize("observer", ["minmax", "percentile", "kl"])
def test_module_and_graph_calibration_give_identical_scales(observer):
    model, batches = _mlp(), _batches()
    graph = _graph_scales(model, batches, observer)
    module = _module_scales(model, batches, observer)
    assert len(graph) == len(module) == 4
    for g, m in zip(graph, module):
        assert torch.equal(g.reshape(-1), m.reshape(-1)), (observer, g, m)


def test_exact_ranges_agree_too_and_differ_from_rounded():
    model, batches = _mlp(), _batches()
    graph = _graph_scales(model, batches, "minmax", range_bits=None)
    module = _module_scales(model, batches, "minmax", range_bits=None)
    for g, m in zip(graph, module):
        assert torch.equal(g.reshape(-1), m.reshape(-1))
    amax = max(float(b.abs().max()) for b in batches)
    assert float(module[0]) == pytest.approx(amax / 127, rel=1e-7)  # the exact range: s = amax / 127
    rounded = _module_scales(model, batches, "minmax")
    assert float(rounded[0]) > float(module[0])  # 8-bit outward rounding widened it
