"""Value floors: a lower bound F of a tensor that both FP32 engines (onnxruntime, the executor) respect by the ops'
definition alone, so a range end onnxruntime reports at F is the executor's too (passes.calib_ort).

    Relu, Sigmoid, Softmax, ...                   -> 0
    Clip(min)                                     -> max(min, input floor)
    MaxPool, Reshape, Concat, ... (data movement) -> the inputs' floor; averaging -> min(floor, 0)
    hard-swish x * HardSigmoid(x) / HardSwish     -> its minimum as both engines compute it (`stationary_floor`)
    t * c, t / c (constant c > 0), t + c, t - c   -> min over c of the float32 result at t's floor (float rounding
                                                     is monotonic, so values >= F give results >= it)
    t * s, s a gate in [0, 1] (HardSigmoid)       -> min(t's floor, 0) (squeeze-excite after hard-swish)

Hard-swish's minimum (-0.375 for alpha 1/6, beta 0.5) sits where its derivative is zero, so the conv noise of its
input does not move it: both engines return it exactly on every batch that reaches it, and it lies on a rounding
boundary. Its floor is measured, not assumed: both engines evaluate the op on every float32 within 2^-8 of the
parabola's vertex (outside that window the computed values exceed the minimum by far more than their rounding).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

NON_NEGATIVE_OPS = frozenset({"Relu", "Sigmoid", "Softmax", "Abs", "Exp", "HardSigmoid", "Softplus"})
FLOOR_KEEPING_OPS = frozenset({"MaxPool", "GlobalMaxPool", "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze",
                               "Concat", "Slice", "Identity", "Split"})  # outputs are some of the inputs' values
AVERAGING_OPS = frozenset({"AveragePool", "GlobalAveragePool"})  # means of the inputs' values (and padding zeros)
AFFINE_OPS = frozenset({"Mul", "Div", "Add", "Sub"})  # with one constant operand (tensor first for Div / Sub)
WINDOW = 2.0 ** -8  # hard-swish: relative half-width around the vertex evaluated exactly
EDGE_ULPS = 64  # ... whose edges must exceed the minimum by this many float32 ulps (else: no floor)


def _hard_swish_model(alpha: float | None, beta: float) -> bytes:
    """x -> x * HardSigmoid(x; alpha, beta), or the HardSwish op (alpha None), as ONNX bytes."""
    from onnx import TensorProto, helper

    if alpha is None:
        nodes = [helper.make_node("HardSwish", ["x"], ["y"])]
    else:
        nodes = [helper.make_node("HardSigmoid", ["x"], ["g"], alpha=alpha, beta=beta),
                 helper.make_node("Mul", ["x", "g"], ["y"])]
    graph = helper.make_graph(nodes, "hard_swish", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None])])
    # IR 8, as the other probes: onnx 1.23's make_model writes IR 14, which onnxruntime before 1.31 cannot load
    # (the probe would fail and the floor be lost)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], ir_version=8).SerializeToString()


@functools.lru_cache(maxsize=32)
def stationary_floor(alpha: float | None, beta: float = 0.5) -> float | None:
    """The smallest value onnxruntime and the executor give x * HardSigmoid(x; alpha, beta) (alpha None: the HardSwish
    op, alpha 1/6, beta 0.5) over all float32 x; None when it cannot be established (alpha <= 0, beta outside
    (0, 1], an engine fails, or the window's edges are not clearly above the minimum).

    For alpha > 0 and 0 < beta <= 1 the op is x * (alpha x + beta) between x = -beta / alpha and (1 - beta) / alpha,
    0 below and x >= 0 above: its minimum -beta^2 / (4 alpha) is at the vertex -beta / (2 alpha)."""
    import onnxruntime as ort

    from netquant.graph import Executor, load_onnx

    a = 1.0 / 6.0 if alpha is None else float(alpha)
    if not (a > 0.0 and 0.0 < beta <= 1.0 and math.isfinite(a)):
        return None
    vertex = -beta / (2.0 * a)
    ends = np.array([vertex * (1.0 + WINDOW), vertex * (1.0 - WINDOW)], dtype=np.float32).view(np.int32)
    xs = np.arange(ends[1], ends[0] + 1, dtype=np.int32).view(np.float32)  # negative floats: int order reversed
    try:
        model = _hard_swish_model(alpha, beta)
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.intra_op_num_threads = 1
        session = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
        by_ort = np.asarray(session.run(["y"], {"x": xs})[0], dtype=np.float32)
        by_ex = Executor(load_onnx(model)).run({"x": torch.from_numpy(xs.copy())})["y"].numpy()
    except Exception:  # noqa: BLE001 - an engine that cannot evaluate it: no floor (the executor settles the end)
        return None
    both = np.minimum(by_ort, by_ex)
    low = float(both.min())
    edge = float(min(both[0], both[-1]))
    if not (math.isfinite(low) and edge - low > EDGE_ULPS * float(np.spacing(np.float32(abs(low))))):
        return None
    return low


def _affine_floor(op: str, floor: float, const: torch.Tensor) -> float | None:
    """Floor of `t op c` for t >= floor (float32 rounding is monotonic in t); None unless it is monotonic
    increasing in t (Mul / Div need every c > 0)."""
    c = const.detach().float().reshape(-1)
    if c.numel() == 0 or not bool(torch.isfinite(c).all()):
        return None
    f = torch.tensor(floor, dtype=torch.float32)
    if op in ("Mul", "Div") and not bool((c > 0).all()):
        return None
    out = {"Mul": f * c, "Div": f / c, "Add": f + c, "Sub": f - c}[op]
    low = float(out.min())
    return low if math.isfinite(low) else None


def value_floors(graph: Any, clip_min: Callable[[Any], float],
                 constant: Callable[[str], torch.Tensor | None] | None = None,
                 clip_max: Callable[[Any], float] | None = None) -> dict[str, float]:
    """{tensor: F} where every engine computes values >= F by the ops' definition alone (module docstring), so
    onnxruntime and the executor cannot differ below it: a ReLU's lower range end 0 is then decided without an
    executor run. clip_min(node) / clip_max(node): a Clip node's constant lower / upper bound (-inf / inf when none;
    clip_max None: no Clip counts as a gate); constant(name): a tensor's constant value (None when not constant;
    default: the graph's initializers)."""
    constant = constant or graph.initializers.get

    def clip_bounds_of(n: Any) -> tuple[float, float]:
        return float(clip_min(n)), (float(clip_max(n)) if clip_max is not None else math.inf)

    floors: dict[str, float] = {}
    producer = {o: n for n in graph.nodes for o in n.outputs if o}
    for node in graph.nodes:
        op = node.op_type
        ins = [floors.get(i, -math.inf) for i in node.inputs if i]
        f: float | None = None
        if op in NON_NEGATIVE_OPS:
            f = 0.0
        elif op == "Clip":
            f = max(float(clip_min(node)), ins[0] if ins else -math.inf)
        elif op in FLOOR_KEEPING_OPS and ins:
            f = ins[0] if op != "Concat" else min(ins)
        elif op in AVERAGING_OPS and ins:
            f = min(ins[0], 0.0)
        elif op == "LRN" and ins and ins[0] >= 0.0:  # x / (bias + alpha / size * sum x^2) ^ beta, bias > 0
            f = 0.0
        elif op == "HardSwish":
            f = stationary_floor(None)
        elif op == "Mul" and _hard_sigmoid_of(node, producer) is not None:
            hs = _hard_sigmoid_of(node, producer)
            assert hs is not None
            f = stationary_floor(float(hs.attrs.get("alpha", 0.2)), float(hs.attrs.get("beta", 0.5)))
        elif op == "Mul" and _gated(node, floors, producer, clip_bounds_of) is not None:
            f = _gated(node, floors, producer, clip_bounds_of)
        elif op in AFFINE_OPS and len(node.inputs) == 2:
            f = _affine(node, floors, constant)
        if f is not None and f > -math.inf:
            for o in node.outputs:
                if o:
                    floors[o] = f
    return floors


def _hard_sigmoid_of(node: Any, producer: dict[str, Any]) -> Any:
    """The HardSigmoid node g when `node` is Mul(x, g) or Mul(g, x) with g = HardSigmoid(x), else None."""
    if len(node.inputs) != 2:
        return None
    for x, g in (node.inputs, node.inputs[::-1]):
        p = producer.get(g)
        if p is not None and p.op_type == "HardSigmoid" and p.inputs and p.inputs[0] == x:
            return p
    return None


def _gated(node: Any, floors: dict[str, float], producer: dict[str, Any],
           clip_bounds_of: Callable[[Any], tuple[float, float]]) -> float | None:
    """Floor of t * s with t floored at F and s a gate in [0, 1] (HardSigmoid, Clip to [>= 0, <= 1]: squeeze-excite
    after hard-swish): min(F, 0), since |t * s| <= |t| rounds to no value below t."""
    if len(node.inputs) != 2:
        return None
    for t, s in (node.inputs, node.inputs[::-1]):
        p = producer.get(s)
        if t not in floors or p is None:
            continue
        if p.op_type == "HardSigmoid":
            return min(floors[t], 0.0)
        if p.op_type == "Clip":
            lo, hi = clip_bounds_of(p)
            if lo >= 0.0 and hi <= 1.0:
                return min(floors[t], 0.0)
    return None


def _affine(node: Any, floors: dict[str, float], constant: Callable[[str], torch.Tensor | None]) -> float | None:
    """Floor of Mul / Div / Add / Sub with one constant operand and a floored tensor (module docstring)."""
    a, b = node.inputs
    orders = [(a, b)] if node.op_type in ("Div", "Sub") else [(a, b), (b, a)]
    for t, c in orders:
        value = constant(c) if c else None
        if t in floors and value is not None and value.is_floating_point():
            return _affine_floor(node.op_type, floors[t], value)
    return None
