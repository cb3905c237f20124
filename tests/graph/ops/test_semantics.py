"""Opset-dependent semantics, dtype rules, error messages and autograd of the op implementations."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import netquant.graph.ops  # noqa: F401  (registers the ops)
from netquant.errors import UnsupportedOpError
from netquant.graph.ops.registry import OpContext, lookup_op, supported_op_types
from netquant.graph.ops.resize import resize_tensor


def run(op: str, inputs: list[Any], attrs: dict[str, Any] | None = None, opset: int = 17, n_out: int = 1,
        domain: str = "", name: str = "n0") -> list[torch.Tensor]:
    fn = lookup_op(op, domain, opset, name)
    return list(fn(inputs, attrs or {}, OpContext(op, name=name, domain=domain, opset=opset, num_outputs=n_out)))


def t64(*vals: int) -> torch.Tensor:
    return torch.tensor(vals, dtype=torch.int64)


# ---------------------------------------------------------------- opset-dependent signatures
def test_split_attr_before_13_input_after() -> None:
    x = torch.arange(10.0)
    old = run("Split", [x], {"split": [3, 7]}, opset=11, n_out=2)
    new = run("Split", [x, t64(3, 7)], {}, opset=13, n_out=2)
    for a, b in zip(old, new):
        torch.testing.assert_close(a, b)
    assert [len(p) for p in new] == [3, 7]
    # opset 18: num_outputs with an uneven last chunk (ceil split)
    parts = run("Split", [x], {"num_outputs": 3}, opset=18, n_out=3)
    assert [len(p) for p in parts] == [4, 4, 2]


def test_squeeze_unsqueeze_axes_attr_vs_input() -> None:
    x = torch.zeros(1, 3, 1, 2)
    assert run("Squeeze", [x], {"axes": [0, -2]}, opset=11)[0].shape == (3, 2)
    assert run("Squeeze", [x, t64(0, -2)], opset=13)[0].shape == (3, 2)
    assert run("Squeeze", [x], opset=13)[0].shape == (3, 2)
    y = torch.zeros(3, 2)
    assert run("Unsqueeze", [y], {"axes": [0, 3]}, opset=11)[0].shape == (1, 3, 2, 1)
    assert run("Unsqueeze", [y, t64(-1, 0)], opset=13)[0].shape == (1, 3, 2, 1)


@pytest.mark.parametrize(("op", "since"), [("ReduceSum", 13), ("ReduceMean", 18), ("ReduceMax", 18),
                                           ("ReduceL2", 18), ("ReduceLogSumExp", 18)])
def test_reduce_axes_attr_vs_input(op: str, since: int) -> None:
    x = torch.randn(2, 3, 4)
    old = run(op, [x], {"axes": [1, -1], "keepdims": 0}, opset=since - 1)[0]
    new = run(op, [x, t64(1, -1)], {"keepdims": 0}, opset=since)[0]
    torch.testing.assert_close(old, new)
    assert new.shape == (2,)
    ref = {"ReduceSum": x.sum((1, 2)), "ReduceMean": x.mean((1, 2)), "ReduceMax": x.amax((1, 2)),
           "ReduceL2": x.square().sum((1, 2)).sqrt(), "ReduceLogSumExp": x.logsumexp((1, 2))}[op]
    torch.testing.assert_close(new, ref)
    # empty axes: reduce all, or pass through with noop_with_empty_axes
    assert run(op, [x], {"keepdims": 1}, opset=since)[0].shape == (1, 1, 1)
    assert run(op, [x], {"noop_with_empty_axes": 1}, opset=since)[0] is x


def test_clip_attrs_vs_inputs_and_int_dtype() -> None:
    x = torch.tensor([-3.0, -0.5, 0.5, 3.0])
    old = run("Clip", [x], {"min": -1.0, "max": 1.0}, opset=6)[0]
    new = run("Clip", [x, torch.tensor(-1.0), torch.tensor(1.0)], opset=11)[0]
    torch.testing.assert_close(old, new)
    torch.testing.assert_close(new, torch.tensor([-1.0, -0.5, 0.5, 1.0]))
    xi = torch.tensor([-5, 0, 9], dtype=torch.int32)
    yi = run("Clip", [xi, None, torch.tensor(4, dtype=torch.int32)], opset=13)[0]
    assert yi.dtype == torch.int32 and yi.tolist() == [-5, 0, 4]


def test_pad_attr_vs_input_and_axes() -> None:
    x = torch.arange(6.0).reshape(2, 3)
    old = run("Pad", [x], {"pads": [0, 1, 1, 0], "value": 7.0}, opset=2)[0]
    new = run("Pad", [x, t64(0, 1, 1, 0), torch.tensor(7.0)], opset=11)[0]
    torch.testing.assert_close(old, new)
    assert new.shape == (3, 4) and new[2, 0] == 7.0 and new[0, 0] == 7.0
    axes = run("Pad", [x, t64(1, 1), None, t64(-1)], {"mode": "edge"}, opset=18)[0]
    torch.testing.assert_close(axes, F.pad(x[None], (1, 1), mode="replicate")[0])
    wrap = run("Pad", [x, t64(0, 2, 0, 1)], {"mode": "wrap"}, opset=19)[0]
    assert wrap[0].tolist() == [1.0, 2.0, 0.0, 1.0, 2.0, 0.0]
    crop = run("Pad", [x, t64(0, -1, 0, 0)], opset=11)[0]  # negative pads crop
    torch.testing.assert_close(crop, x[:, 1:])


def test_softmax_coerced_2d_before_13() -> None:
    x = torch.randn(2, 3, 4)
    old = run("Softmax", [x], {"axis": 1}, opset=11)[0]
    torch.testing.assert_close(old, torch.softmax(x.reshape(2, 12), 1).reshape(2, 3, 4))
    new = run("Softmax", [x], {"axis": 1}, opset=13)[0]
    torch.testing.assert_close(new, torch.softmax(x, 1))
    hard = run("Hardmax", [x], {}, opset=13)[0]
    assert hard.sum(-1).eq(1).all() and (hard.argmax(-1) == x.argmax(-1)).all()


def test_upsample_and_resize10_nearest_repeat() -> None:
    x = torch.arange(6.0).reshape(1, 1, 2, 3)
    scales = torch.tensor([1.0, 1.0, 2.0, 3.0])
    expect = x.repeat_interleave(2, 2).repeat_interleave(3, 3)
    torch.testing.assert_close(run("Upsample", [x, scales], {"mode": "nearest"}, opset=9)[0], expect)
    torch.testing.assert_close(run("Resize", [x, scales], {"mode": "nearest"}, opset=10)[0], expect)


def test_group_norm_scale_per_group_18_per_channel_21() -> None:
    x = torch.randn(2, 4, 3)
    g18 = run("GroupNormalization", [x, torch.tensor([2.0, 3.0]), torch.tensor([0.5, -1.0])],
              {"num_groups": 2}, opset=18)[0]
    g21 = run("GroupNormalization", [x, torch.tensor([2.0, 2.0, 3.0, 3.0]), torch.tensor([0.5, 0.5, -1.0, -1.0])],
              {"num_groups": 2}, opset=21)[0]
    torch.testing.assert_close(g18, g21)


# ---------------------------------------------------------------- dtype rules (no implicit promotion)
def test_integer_arithmetic_keeps_dtype_and_c_semantics() -> None:
    a = torch.tensor([-7, 7, -7], dtype=torch.int32)
    b = torch.tensor([2, -2, -2], dtype=torch.int32)
    div = run("Div", [a, b])[0]
    assert div.dtype == torch.int32 and div.tolist() == [-3, -3, 3]  # truncation toward zero
    assert run("Mod", [a, b])[0].tolist() == [1, -1, -1]  # sign of the divisor
    assert run("Mod", [a, b], {"fmod": 1})[0].tolist() == [-1, 1, -1]  # sign of the dividend
    u = torch.tensor([2**32 - 1, 5], dtype=torch.uint32)
    m = run("Max", [u, torch.tensor([3, 9], dtype=torch.uint32)])[0]
    assert m.dtype == torch.uint32 and m.tolist() == [2**32 - 1, 9]
    p = run("Pow", [torch.tensor([2, 3], dtype=torch.int64), torch.tensor([2.0, 0.5])])[0]
    assert p.dtype == torch.int64 and p.tolist() == [4, 1]


def test_cast_float8_saturation_and_rounding() -> None:
    x = torch.tensor([1000.0, -1000.0, float("inf"), 0.3, float("nan")])
    sat = run("Cast", [x], {"to": 17}, opset=19)[0]  # FLOAT8E4M3FN, saturate=1
    assert sat.dtype == torch.float8_e4m3fn
    assert sat.float()[:3].tolist() == [448.0, -448.0, 448.0] and math.isnan(sat.float()[4])
    raw = run("Cast", [x], {"to": 17, "saturate": 0}, opset=19)[0].float()
    assert math.isnan(raw[0]) and math.isnan(raw[2])
    i4 = run("Cast", [torch.tensor([-9.5, 7.9, 8.0])], {"to": 22}, opset=21)[0]  # INT4 wraps like numpy
    assert i4.dtype == torch.int8 and i4.tolist() == [7, 7, -8]


def test_quantize_linear_rounds_half_to_even_and_saturates() -> None:
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, 300.0, -300.0])
    q = run("QuantizeLinear", [x, torch.tensor(1.0), torch.tensor(0, dtype=torch.int8)])[0]
    assert q.dtype == torch.int8 and q.tolist() == [0, 2, 2, 0, 127, -128]
    dq = run("DequantizeLinear", [q, torch.tensor(0.5), torch.tensor(1, dtype=torch.int8)])[0]
    torch.testing.assert_close(dq, (q.float() - 1) * 0.5)


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize(("op", "inputs", "attrs", "what"), [
    ("Resize", [torch.zeros(1, 1, 2, 2), None, torch.tensor([1.0, 1.0, 2.0, 2.0])], {"mode": "area"}, "mode 'area'"),
    ("Resize", [torch.zeros(1, 1, 2, 2), None, torch.tensor([1.0, 1.0, 2.0, 2.0])],
     {"coordinate_transformation_mode": "bogus"}, "coordinate_transformation_mode 'bogus'"),
    ("Pad", [torch.zeros(2, 2), t64(1, 1, 1, 1)], {"mode": "mirror"}, "mode 'mirror'"),
    ("Conv", [torch.zeros(1, 1, 4, 4), torch.zeros(1, 1, 3, 3)], {"auto_pad": "BOTH"}, "auto_pad='BOTH'"),
    ("Gelu", [torch.zeros(2)], {"approximate": "erf"}, "approximate='erf'"),
    ("Cast", [torch.zeros(2)], {"to": 8}, "string tensors"),
    ("RNN", [torch.zeros(2, 1, 3), torch.zeros(1, 4, 3), torch.zeros(1, 4, 4)],
     {"hidden_size": 4, "activations": ["Gaussian"]}, "activation 'Gaussian'"),
    ("GridSample", [torch.zeros(1, 1, 2, 2), torch.zeros(1, 2, 2, 2)], {"mode": "area"}, "mode 'area'"),
])
def test_unsupported_attribute_names_op_node_and_opset(op: str, inputs: list, attrs: dict, what: str) -> None:
    with pytest.raises(UnsupportedOpError) as exc:
        run(op, inputs, attrs, opset=20, name="my_node")
    msg = str(exc.value)
    assert op in msg and "'my_node'" in msg and "opset 20" in msg and what in msg, msg


def test_unknown_op_type_error() -> None:
    with pytest.raises(UnsupportedOpError, match=r"'FancyOp'.*node 'n7'.*opset 13"):
        lookup_op("FancyOp", "", 13, "n7")


def test_coverage_counts() -> None:
    assert len(supported_op_types()) >= 170
    for d, op in [("com.microsoft", "QLinearAdd"), ("ai.onnx.ml", "Binarizer"),
                  ("ai.onnx.preview.training", "Adam"), ("ai.onnx.preview", "FlexAttention")]:
        assert op in supported_op_types(d)


# ---------------------------------------------------------------- resize fast path == separable path
@pytest.mark.parametrize("mode", ["linear", "cubic"])
@pytest.mark.parametrize("ctm", ["half_pixel", "pytorch_half_pixel", "align_corners", "half_pixel_symmetric"])
def test_resize_fused_path_matches_separable_path(mode: str, ctm: str) -> None:
    x = torch.randn(2, 3, 7, 9, dtype=torch.float64)
    for out, sc in (([2, 3, 14, 18], [1, 1, 2.0, 2.0]), ([2, 3, 5, 4], [1, 1, 5 / 7, 4 / 9])):
        kw = dict(mode=mode, ctm=ctm)
        fused = resize_tensor(x, out, sc, **kw)
        plain = resize_tensor(x, out, sc, fused=False, **kw)
        torch.testing.assert_close(fused, plain, rtol=1e-9, atol=1e-9)
    x3 = torch.randn(1, 2, 3, 4, 5, dtype=torch.float64)  # trilinear
    torch.testing.assert_close(resize_tensor(x3, [1, 2, 6, 8, 10], [1, 1, 2.0, 2.0, 2.0], mode="linear"),
                               resize_tensor(x3, [1, 2, 6, 8, 10], [1, 1, 2.0, 2.0, 2.0], mode="linear",
                                             fused=False))


# ---------------------------------------------------------------- autograd flows through the math
def _gradcheck(op: str, inputs: list[Any], attrs: dict[str, Any], opset: int = 17, n_out: int = 1) -> None:
    """Gradients w.r.t. every float64 input (float32 ones, e.g. Resize scales, stay constant)."""
    def is_leaf(i: Any) -> bool:
        return isinstance(i, torch.Tensor) and i.dtype == torch.float64

    leaves = [i for i in inputs if is_leaf(i)]
    for leaf in leaves:
        leaf.requires_grad_(True)

    def f(*args: torch.Tensor) -> torch.Tensor:
        it = iter(args)
        full = [next(it) if is_leaf(i) else i for i in inputs]
        return run(op, full, attrs, opset, n_out)[0]

    assert torch.autograd.gradcheck(f, tuple(leaves), eps=1e-6, atol=1e-5)


def d(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


@pytest.mark.parametrize(("op", "inputs", "attrs"), [
    ("Conv", [d(1, 2, 5, 5), d(3, 2, 3, 3), d(3)], {"pads": [0, 1, 2, 1], "strides": [2, 1]}),
    ("ConvTranspose", [d(1, 2, 3, 3), d(2, 3, 3, 3), d(3)], {"strides": [2, 2], "pads": [1, 0, 0, 1],
                                                           "output_padding": [1, 1]}),
    ("Gemm", [d(3, 4), d(5, 4), d(5)], {"transB": 1, "alpha": 0.5, "beta": 2.0}),
    ("AveragePool", [d(1, 2, 5, 6)], {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1,
                                      "pads": [1, 0, 0, 1]}),
    ("MaxPool", [d(1, 2, 5, 6)], {"kernel_shape": [2, 2], "pads": [1, 1, 0, 0]}),
    ("LayerNormalization", [d(2, 3, 4), d(4), d(4)], {}),
    ("Resize", [d(1, 1, 3, 4), None, torch.tensor([1.0, 1.0, 1.5, 2.0])], {"mode": "cubic"}),
    ("Resize", [d(1, 1, 3, 4), None, torch.tensor([1.0, 1.0, 2.0, 2.0])], {"mode": "linear"}),
    ("Softmax", [d(2, 5)], {}),
    ("Gelu", [d(6)], {"approximate": "tanh"}),
    ("HardSigmoid", [d(6)], {}),
    ("GRU", [d(3, 2, 4), d(1, 9, 4), d(1, 9, 3), d(1, 18)], {"hidden_size": 3, "linear_before_reset": 1}),
    ("LSTM", [d(3, 2, 4), d(1, 12, 4), d(1, 12, 3)], {"hidden_size": 3}),
    ("Attention", [d(1, 2, 3, 4), d(1, 2, 5, 4), d(1, 2, 5, 4)], {"is_causal": 1}),
    ("GridSample", [d(1, 1, 4, 4), torch.rand(1, 3, 3, 2, dtype=torch.float64) * 1.6 - 0.8],
     {"mode": "linear"}),
])
def test_gradients_flow(op: str, inputs: list, attrs: dict) -> None:
    _gradcheck(op, inputs, attrs, opset=23 if op == "Attention" else 20)


# ---------------------------------------------------------------- random ops (references drawn by numpy)
def test_bernoulli_deterministic_probabilities_and_seed() -> None:
    p = torch.tensor([0.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    assert run("Bernoulli", [p], {"dtype": 1}, opset=15)[0].tolist() == [0.0, 1.0, 0.0, 1.0]
    q = torch.full((1000,), 0.3)
    a = run("Bernoulli", [q], {"seed": 3.0}, opset=15)[0]
    b = run("Bernoulli", [q], {"seed": 3.0}, opset=15)[0]
    torch.testing.assert_close(a, b)  # seeded: reproducible
    assert a.dtype == torch.float32 and 0.24 < float(a.mean()) < 0.36


def test_training_dropout_scales_kept_units() -> None:
    x = torch.randn(4000)
    y, mask = run("Dropout", [x, torch.tensor(0.25), torch.tensor(True)], {"seed": 0}, opset=13, n_out=2)
    assert mask.dtype == torch.bool and 0.7 < float(mask.float().mean()) < 0.8
    torch.testing.assert_close(y, x * mask / 0.75)
    y0, mask0 = run("Dropout", [x, torch.tensor(0.25)], opset=13, n_out=2)  # inference: identity
    assert y0 is x and bool(mask0.all())


def test_dft_torch_path_matches_numpy_path_and_is_differentiable() -> None:
    x = torch.randn(2, 8, 2, dtype=torch.float64)
    axis = torch.tensor(1)
    for attrs in ({}, {"inverse": 1}, {"onesided": 1}):
        plain = run("DFT", [x, None, axis], attrs, opset=20)[0]  # numpy pocketfft (no autograd needed)
        xg = x.clone().requires_grad_(True)
        graded = run("DFT", [xg, None, axis], attrs, opset=20)[0]  # torch.fft
        torch.testing.assert_close(graded.detach(), plain)
    _gradcheck("DFT", [d(1, 6, 2), None, torch.tensor(1)], {}, opset=20)
