"""Depthwise-heavy CNNs for the float-result checks: an ONNX stack big enough for placement to measure, and a small
MobileNetV2 (torchvision's architecture, built here: torchvision is not installed) with random weights."""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from tests.helpers.ir import make_model


def depthwise_stack(seed: int = 0, width: int = 128, size: int = 16) -> onnx.ModelProto:
    """x[N,16,size,size] -> (1x1 16->width, Relu, depthwise 3x3, Relu) x2 with a 1x1 width->width between -> 1x1
    width->8: 5 regions (2 depthwise), > analysis.placement.MIN_WEIGHTS weights."""
    rng = np.random.default_rng(seed)
    inits, nodes = [], []
    prev, cin = "x", 16
    layers = [(width, 1, 1), (width, 3, width), (width, 1, 1), (width, 3, width), (8, 1, 1)]
    for i, (cout, k, group) in enumerate(layers):
        w = (rng.standard_normal((cout, cin // group, k, k)) / np.sqrt(cin // group * k * k)).astype(np.float32)
        b = (0.1 * rng.standard_normal(cout)).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        nodes.append(helper.make_node("Conv", [prev, f"w{i}", f"b{i}"], [f"c{i}"], name=f"conv{i}", group=group,
                                      pads=[k // 2] * 4))
        prev = f"c{i}"
        if i < len(layers) - 1:
            nodes.append(helper.make_node("Relu", [prev], [f"r{i}"], name=f"relu{i}"))
            prev = f"r{i}"
        cin = cout
    graph = helper.make_graph(nodes, "depthwise_stack",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16, size, size])],
                              [helper.make_tensor_value_info(prev, TensorProto.FLOAT, ["N", 8, size, size])], inits)
    return make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def depthwise_batches(n: int = 2, batch: int = 4, seed: int = 1, size: int = 16) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((batch, 16, size, size)).astype(np.float32) for _ in range(n)]


class _InvertedResidual(torch.nn.Module):
    """MobileNetV2's block: 1x1 expand (ReLU6), depthwise 3x3 (ReLU6), 1x1 project; residual when shapes allow."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        layers: list[torch.nn.Module] = []
        if expand != 1:
            layers += [torch.nn.Conv2d(cin, hidden, 1, bias=False), torch.nn.BatchNorm2d(hidden), torch.nn.ReLU6()]
        layers += [torch.nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),
                   torch.nn.BatchNorm2d(hidden), torch.nn.ReLU6(),
                   torch.nn.Conv2d(hidden, cout, 1, bias=False), torch.nn.BatchNorm2d(cout)]
        self.conv = torch.nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return x + y if self.residual else y


class MobileNetV2(torch.nn.Module):
    """torchvision's MobileNetV2 layout (t, c, n, s settings), channels x `width`, `classes` outputs."""

    SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
                (6, 320, 1, 1))

    def __init__(self, width: float = 0.25, classes: int = 10) -> None:
        super().__init__()

        def ch(c: int) -> int:
            return max(8, int(c * width + 4) // 8 * 8)

        cin = ch(32)
        layers: list[torch.nn.Module] = [torch.nn.Conv2d(3, cin, 3, 2, 1, bias=False), torch.nn.BatchNorm2d(cin),
                                         torch.nn.ReLU6()]
        for t, c, n, s in self.SETTINGS:
            for i in range(n):
                layers.append(_InvertedResidual(cin, ch(c), s if i == 0 else 1, t))
                cin = ch(c)
        last = ch(1280)
        layers += [torch.nn.Conv2d(cin, last, 1, bias=False), torch.nn.BatchNorm2d(last), torch.nn.ReLU6()]
        self.features = torch.nn.Sequential(*layers)
        self.classifier = torch.nn.Linear(last, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).mean((2, 3)))


def mobilenet_v2(width: float = 0.25, classes: int = 10, seed: int = 0) -> MobileNetV2:
    """Random-init MobileNetV2 (BatchNorm statistics randomized so the folded weights are not trivial), eval mode."""
    torch.manual_seed(seed)
    model = MobileNetV2(width, classes)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)
    return model.eval()
