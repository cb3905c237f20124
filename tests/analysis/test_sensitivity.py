"""analysis.sensitivity: fake-quant loss of a placement, per-region sensitivities, local output NSR."""

from __future__ import annotations

import pytest
import torch

from netquant.analysis.regions import find_regions
from netquant.analysis.sensitivity import LossMeter, region_output_nsr, region_sensitivity
from netquant.api import quantize_onnx
from tests.helpers.ir import make_model
from tests.helpers.placement_models import conv_stack, stack_batches

X = {"x": torch.from_numpy(stack_batches(1, seed=7)[0])}


@pytest.fixture(scope="module")
def qm():
    return quantize_onnx(conv_stack(), stack_batches(), quiet=True, objective=None)


def _cos_loss(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.reshape(-1).double(), b.reshape(-1).double()
    return 1.0 - float(a @ b / (a.norm() * b.norm()))


def test_loss_matches_the_fake_quant_run(qm):
    meter = LossMeter(qm.qgraph, [X])
    ref, test = qm.run(X, fake_quant=False)["c2"], qm.run(X)["c2"]
    assert meter.loss() == pytest.approx(_cos_loss(ref, test), rel=1e-6)
    regions = find_regions(qm.qgraph)
    assert meter.loss(regions) == 0.0  # everything float: the FP32 graph exactly
    full, sens = region_sensitivity(meter, regions)
    assert full == pytest.approx(meter.loss())
    for r in regions:
        s = sens[r.anchor]
        assert s.all_but == pytest.approx(meter.loss([r])) and s.gain == pytest.approx(full - s.all_but)
        assert s.only == pytest.approx(meter.loss([x for x in regions if x is not r]))
        assert s.only >= 0.0


def test_region_output_nsr_by_hand(qm):
    meter = LossMeter(qm.qgraph, [X])
    nsr = region_output_nsr(meter, find_regions(qm.qgraph))
    for anchor, tensor in (("conv0", "r0"), ("conv1", "r1"), ("conv2", "c2")):
        ref = qm.qgraph.run(X, fake_quant=False, outputs=[tensor])[tensor].double()
        test = qm.qgraph.run(X, outputs=[tensor])[tensor].double()
        assert nsr[anchor] == pytest.approx(float(((ref - test) ** 2).sum() / (ref ** 2).sum()), rel=1e-6)



def _flat_cos_loss(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    return 0.5 * float(((a / a.norm() - b / b.norm()) ** 2).sum())


def test_default_loss_compares_the_logits_of_a_softmax_output():
    """A graph output made by Softmax is compared at its input, the logits: the cosine of the probabilities depends
    on how confident the model is (near one-hot rows hide a logit error, rows near a tie magnify it)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    from netquant.analysis.sensitivity import compared_tensors

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((16, 4)) * 3).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["logits"], name="fc"),
         helper.make_node("Softmax", ["logits"], ["p"], name="softmax", axis=-1)],
        "clf", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("p", TensorProto.FLOAT, ["N", 4])],
        [onnx.numpy_helper.from_array(w, "w")])
    model = make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = (rng.standard_normal((32, 16)) * 4).astype(np.float32)
    qm = quantize_onnx(model, [{"x": x}], quiet=True, objective=None)
    assert compared_tensors(qm.qgraph) == ["logits"]
    batch = {"x": torch.from_numpy(x[:8])}
    ref = qm.qgraph.executor(fake_quant=False).run(batch, outputs=["logits", "p"])
    got = qm.qgraph.executor(fake_quant=True).run(batch, outputs=["logits", "p"])
    loss = LossMeter(qm.qgraph, [batch]).loss([])
    assert loss == pytest.approx(_flat_cos_loss(ref["logits"], got["logits"]), rel=1e-6)
    assert loss > 0 and loss != pytest.approx(_flat_cos_loss(ref["p"], got["p"]), rel=0.1)
