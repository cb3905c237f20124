"""quantize_model on a module without weight values (issue 19: a NotImplementedError traceback from the observer)."""

from __future__ import annotations

import pytest
import torch

from netquant.errors import ModelError
from netquant.nn import quantize_model


def test_a_meta_module_is_refused_naming_the_tensor() -> None:
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Linear(4, 2)).to("meta")
    with pytest.raises(ModelError, match=r"quantize_model: Sequential has tensor '0.weight' on the 'meta' device.*"
                                         r"to_empty\(device='cpu'\)"):
        quantize_model(net)


def test_the_same_module_with_weights_quantizes() -> None:
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Linear(4, 2)).to("meta")
    net = net.to_empty(device="cpu")
    torch.manual_seed(0)
    for p in net.parameters():
        torch.nn.init.normal_(p)
    q = quantize_model(net)
    w = q[0].weight_quantizer(q[0].weight)  # fake-quantized weight: within half a step of the float one
    step = q[0].weight.detach().abs().amax(dim=(1, 2, 3)) / 127
    assert bool(((w - q[0].weight).abs().amax(dim=(1, 2, 3)) <= step / 2 + 1e-6).all())
