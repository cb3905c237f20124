"""Seeded generator of malformed and unusual ONNX models and calibration data, and the driver that runs them.

Every case goes through one of four front doors (the loader, the executor, quantize_onnx + export, the
`netquant quantize` command) and ends in an Outcome.  Good outcomes: a result (which onnxruntime agrees
with, where onnxruntime runs the model) or a NetquantError subclass.  Bad ones: any other exception, a
hang, a disagreement with onnxruntime, or a file left behind.
"""

from __future__ import annotations

import contextlib
import enum
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from netquant.errors import NetquantError


class Category(enum.StrEnum):
    """What a case does to the model or the data."""

    VALID = "valid model, valid data"
    TRUNCATED = "truncated bytes"
    BIT_FLIP = "bit flips"
    MISSING_FIELD = "missing fields"
    WRONG_TYPE = "wrong types"
    CYCLE = "cycles"
    DANGLING = "dangling inputs"
    HUGE_DIM = "huge dims"
    ZERO_SIZE = "zero-size tensors"
    ODD_DTYPE = "odd dtypes"
    UNKNOWN_OP = "unknown ops and domains"
    SUBGRAPH = "nested subgraphs"
    DATA_NAN_INF = "data: NaN / Inf"
    DATA_DENORMAL = "data: denormals"
    DATA_CONSTANT = "data: constant"
    DATA_EMPTY = "data: empty"
    DATA_WRONG_RANK = "data: wrong rank"
    DATA_WRONG_DTYPE = "data: wrong dtype"
    PLACEMENT_FILE = "placement files"
    COMPANION = "companion files, outputs over inputs"
    TINY = "tiny magnitudes"
    INIT_INPUT = "initializers as graph inputs"


class Door(enum.StrEnum):
    """Where the case enters netquant."""

    LOADER = "loader"
    EXECUTOR = "executor"
    QUANTIZE = "quantize_onnx + export"
    CLI = "netquant quantize"


class Outcome(enum.StrEnum):
    OK = "result (ORT agrees)"
    OK_ORT_REFUSES = "result (ORT refuses the model)"
    NETQUANT_ERROR = "NetquantError"
    OTHER_EXCEPTION = "other exception"
    HANG = "hang"
    DISAGREES = "disagrees with ORT"
    LEFTOVER = "leftover file"
    CLOBBERED = "input or unnamed file overwritten"
    ACCEPTED_INVALID = "invalid file accepted"
    REFUSED_VALID = "model ORT runs refused"

    @property
    def good(self) -> bool:
        return self in (Outcome.OK, Outcome.OK_ORT_REFUSES, Outcome.NETQUANT_ERROR)


@dataclass
class Case:
    """One fuzz case: model bytes, optional calibration data, the door it goes through."""

    seed: int
    category: Category
    door: Door
    what: str
    model: bytes
    data: dict[str, Any] | None = None
    setup: str = ""  # placement / companion families: the scenario run_case builds in the case's folder


@dataclass
class Result:
    case: Case
    outcome: Outcome
    detail: str = ""
    seconds: float = 0.0


# ---- base models ----------------------------------------------------------------------------------

def _f32(rng: np.random.Generator, *shape: int, scale: float = 0.3) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto],
           inits: list[onnx.TensorProto], opset: int = 13) -> onnx.ModelProto:
    model = helper.make_model(helper.make_graph(nodes, "fuzz", inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def conv_model(rng: np.random.Generator) -> onnx.ModelProto:
    c = int(rng.integers(2, 5))
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2"], ["y"], name="conv2", pads=[1, 1, 1, 1])]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 6])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, c, 6, 6])],
                  [numpy_helper.from_array(_f32(rng, c, 3, 3, 3), "w1"), numpy_helper.from_array(_f32(rng, c), "b1"),
                   numpy_helper.from_array(_f32(rng, c, c, 3, 3), "w2")])


def gemm_model(rng: np.random.Generator) -> onnx.ModelProto:
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["h"], name="fc", transB=1),
             helper.make_node("Sigmoid", ["h"], ["s"], name="sig"),
             helper.make_node("Mul", ["h", "s"], ["y"], name="swish")]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 6])],
                  [numpy_helper.from_array(_f32(rng, 6, 8), "w"), numpy_helper.from_array(_f32(rng, 6), "b")])


def if_model(rng: np.random.Generator) -> onnx.ModelProto:
    """Relu or Neg of x, chosen by ReduceSum(x) > 0: two nested subgraphs."""
    then = helper.make_graph([helper.make_node("Relu", ["x"], ["t"], name="then_relu")], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, [1, 4])])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["e"], name="else_neg")], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, [1, 4])])
    nodes = [helper.make_node("ReduceSum", ["x"], ["s"], name="sum", keepdims=0),
             helper.make_node("Greater", ["s", "zero"], ["cond"], name="gt"),
             helper.make_node("If", ["cond"], ["y"], name="branch", then_branch=then, else_branch=other)]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
                  [numpy_helper.from_array(np.zeros((), np.float32), "zero")])


BASES: dict[str, Callable[[np.random.Generator], onnx.ModelProto]] = {
    "conv": conv_model, "gemm": gemm_model, "if": if_model}


def feeds_for(model: onnx.ModelProto, rng: np.random.Generator, batch: int = 1) -> dict[str, np.ndarray]:
    """Random inputs for a model's declared inputs (dynamic dims = batch for dim 0, else 4; a declared dim
    above 64 gets 4 too: what a user could feed a model that claims a huge dim)."""
    inits = {t.name for t in model.graph.initializer}
    out = {}
    for v in model.graph.input:
        if v.name in inits:
            continue
        tt = v.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") and d.dim_value <= 64 else (batch if i == 0 else 4)
                for i, d in enumerate(tt.shape.dim)]
        try:
            dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type) if tt.elem_type else np.float32
        except KeyError:  # an elem_type onnx does not know: a user would feed float32
            dtype = np.float32
        arr = rng.standard_normal(dims) if np.issubdtype(dtype, np.floating) else rng.integers(0, 3, dims)
        out[v.name] = np.asarray(arr).astype(dtype)
    return out


# ---- mutations ------------------------------------------------------------------------------------

def _truncate(m: onnx.ModelProto, rng: np.random.Generator) -> tuple[str, bytes]:
    raw = m.SerializeToString()
    cut = int(rng.integers(0, len(raw)))
    return f"first {cut} of {len(raw)} bytes", raw[:cut]


def _bit_flip(m: onnx.ModelProto, rng: np.random.Generator) -> tuple[str, bytes]:
    raw = bytearray(m.SerializeToString())
    k = int(rng.integers(1, 4))
    for _ in range(k):
        i = int(rng.integers(0, len(raw)))
        raw[i] ^= 1 << int(rng.integers(0, 8))
    return f"{k} bit(s) flipped", bytes(raw)


def _missing_field(m: onnx.ModelProto, rng: np.random.Generator) -> tuple[str, onnx.ModelProto]:
    choice = int(rng.integers(0, 7))
    g = m.graph
    if choice == 0:
        m.ClearField("graph")
        return "no graph", m
    if choice == 1:
        g.node[int(rng.integers(0, len(g.node)))].ClearField("op_type")
        return "node without op_type", m
    if choice == 2:
        del g.output[:]
        return "graph without outputs", m
    if choice == 3:
        g.initializer[0].ClearField("name") if g.initializer else g.input[0].ClearField("name")
        return "initializer / input without name", m
    if choice == 4:
        del m.opset_import[:]
        return "no opset_import", m
    if choice == 5:
        g.input[0].type.tensor_type.ClearField("elem_type")
        return "input without elem_type", m
    g.input[0].ClearField("type")
    return "input without type", m


def _wrong_type(m: onnx.ModelProto, rng: np.random.Generator) -> tuple[str, onnx.ModelProto]:
    g = m.graph
    choice = int(rng.integers(0, 4))
    if choice == 0 and g.initializer:
        t = g.initializer[0]
        arr = numpy_helper.to_array(t)
        t.CopyFrom(numpy_helper.from_array(arr.astype(np.int32), t.name))
        return f"initializer '{t.name}' as int32", m
    if choice == 1:
        g.input[0].type.tensor_type.elem_type = TensorProto.STRING
        return "input typed string", m
    if choice == 2:
        n = g.node[int(rng.integers(0, len(g.node)))]
        n.attribute.append(helper.make_attribute("alpha", "not a float"))
        return f"node '{n.name}' with a string attribute 'alpha'", m
    g.output[0].type.tensor_type.elem_type = TensorProto.INT64
    return "output declared int64", m


def _cycle(m: onnx.ModelProto, rng: np.random.Generator) -> tuple[str, onnx.ModelProto]:
    g = m.graph
    if len(g.node) >= 2 and rng.integers(0, 2):
        first, last = g.node[0], g.node[len(g.node) - 1]
        first.input[0] = last.output[0]
        return f"'{first.name}' reads the output of '{last.name}'", m
    n = g.node[0]
    n.input[0] = n.output[0]
    return f"'{n.name}' reads its own output", m


def _dangling(m: onnx.ModelProto, rng: np.random.Generator) -> tuple[str, onnx.ModelProto]:
    g = m.graph
    n = g.node[int(rng.integers(0, len(g.node)))]
    if rng.integers(0, 2):
        n.input[int(rng.integers(0, len(n.input)))] = "nowhere"
        return f"'{n.name}' reads an undefined value", m
    g.output[0].name = "not_produced"
    return "graph output nobody produces", m


def _huge_dim(m: onnx.ModelProto, rng: np.random.Generator) -> tuple[str, onnx.ModelProto]:
    g = m.graph
    shaped = [t for t in g.initializer if t.dims]
    if rng.integers(0, 2) and shaped:
        t = shaped[0]
        t.dims[0] = 2**40
        return f"initializer '{t.name}' claims dim 2**40 (data is small)", m
    dims = g.input[0].type.tensor_type.shape.dim
    dims[len(dims) - 1].dim_value = 2**31 + int(rng.integers(0, 9))
    return "input with a > 2**31 dim", m


def _zero_size(m: onnx.ModelProto, rng: np.random.Generator) -> tuple[str, onnx.ModelProto]:
    g = m.graph
    shaped = [t for t in g.initializer if t.dims]
    if rng.integers(0, 2) and shaped:
        t = shaped[0]
        shape = list(numpy_helper.to_array(t).shape)
        shape[0] = 0
        t.CopyFrom(numpy_helper.from_array(np.zeros(shape, np.float32), t.name))
        return f"initializer '{t.name}' with a 0 dim", m
    g.input[0].type.tensor_type.shape.dim[0].dim_value = 0
    return "input with batch dim 0", m


ODD_TYPES = [TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE, TensorProto.INT8, TensorProto.UINT64,
             TensorProto.BOOL, TensorProto.COMPLEX64, TensorProto.FLOAT8E4M3FN, TensorProto.INT4, 999]


def _odd_dtype(m: onnx.ModelProto, rng: np.random.Generator) -> tuple[str, onnx.ModelProto]:
    t = ODD_TYPES[int(rng.integers(0, len(ODD_TYPES)))]
    g = m.graph
    g.input[0].type.tensor_type.elem_type = t
    if rng.integers(0, 2):
        g.output[0].type.tensor_type.elem_type = t
    return f"input typed {helper.tensor_dtype_to_string(t) if t != 999 else 'elem_type 999'}", m


def _unknown_op(m: onnx.ModelProto, rng: np.random.Generator) -> tuple[str, onnx.ModelProto]:
    g = m.graph
    n = g.node[int(rng.integers(0, len(g.node)))]
    if rng.integers(0, 2):
        n.op_type = "NoSuchOp"
        return f"'{n.name}' is 'NoSuchOp'", m
    n.domain = "com.example.custom"
    m.opset_import.append(helper.make_opsetid("com.example.custom", 1))
    return f"'{n.name}' in domain com.example.custom", m


def _subgraph(m: onnx.ModelProto, rng: np.random.Generator) -> tuple[str, onnx.ModelProto]:
    """Wrap the whole graph in an If (both branches) or break a branch of the If model."""
    if any(n.op_type == "If" for n in m.graph.node):
        n = next(n for n in m.graph.node if n.op_type == "If")
        branch = n.attribute[int(rng.integers(0, len(n.attribute)))].g
        choice = int(rng.integers(0, 3))
        if choice == 0:
            branch.node[0].input[0] = "undefined_outer"
            return "If branch reads an undefined outer value", m
        if choice == 1:
            del branch.output[:]
            return "If branch without outputs", m
        branch.node[0].op_type = "NoSuchOp"
        return "If branch with an unknown op", m
    g = m.graph
    inner = helper.make_graph(list(g.node), "inner", [], list(g.output))
    inner2 = helper.make_graph([helper.make_node("Identity", [g.output[0].name], ["alt"], name="alt")]
                               if rng.integers(0, 2) else list(g.node), "inner2", [],
                               [helper.make_tensor_value_info("alt", TensorProto.FLOAT, None)]
                               if rng.integers(0, 2) else list(g.output))
    cond = numpy_helper.from_array(np.array(bool(rng.integers(0, 2))), "cond")
    out = onnx.ValueInfoProto()
    out.CopyFrom(g.output[0])
    out.name = "wrapped"
    del g.node[:]
    g.node.append(helper.make_node("If", ["cond"], ["wrapped"], name="wrap", then_branch=inner, else_branch=inner2))
    g.initializer.append(cond)
    del g.output[:]
    g.output.append(out)
    return "graph nested inside an If", m


MUTATIONS: dict[Category, Callable[[onnx.ModelProto, np.random.Generator], tuple[str, Any]]] = {
    Category.TRUNCATED: _truncate, Category.BIT_FLIP: _bit_flip, Category.MISSING_FIELD: _missing_field,
    Category.WRONG_TYPE: _wrong_type, Category.CYCLE: _cycle, Category.DANGLING: _dangling,
    Category.HUGE_DIM: _huge_dim, Category.ZERO_SIZE: _zero_size, Category.ODD_DTYPE: _odd_dtype,
    Category.UNKNOWN_OP: _unknown_op, Category.SUBGRAPH: _subgraph,
}

DATA_CATEGORIES = (Category.DATA_NAN_INF, Category.DATA_DENORMAL, Category.DATA_CONSTANT, Category.DATA_EMPTY,
                   Category.DATA_WRONG_RANK, Category.DATA_WRONG_DTYPE)


def _bad_data(category: Category, feeds: dict[str, np.ndarray], rng: np.random.Generator) -> tuple[str, Any]:
    name, x = next(iter(feeds.items()))
    x = np.stack([x[0]] * 4) if x.ndim else x
    if category is Category.DATA_NAN_INF:
        x = x.copy()
        x.flat[int(rng.integers(0, x.size))] = [np.nan, np.inf, -np.inf][int(rng.integers(0, 3))]
        return "one NaN/Inf value", {name: x}
    if category is Category.DATA_DENORMAL:
        return "denormal floats", {name: (np.sign(x) * 1e-42).astype(np.float32)}
    if category is Category.DATA_CONSTANT:
        return "constant input", {name: np.full_like(x, float(rng.choice([0.0, 1.0, 3e38])))}
    if category is Category.DATA_EMPTY:
        return "zero samples", {name: x[:0]} if rng.integers(0, 2) else []
    if category is Category.DATA_WRONG_RANK:
        return "input of the wrong rank", {name: x.reshape(x.shape[0], -1)[..., None, None, None]}
    kind = int(rng.integers(0, 3))
    bad = [x.astype(np.int64), x.astype(str), np.array([{"a": 1}] * 4, dtype=object)][kind]
    return f"input of dtype {bad.dtype}", {name: bad}


def make_case(seed: int) -> Case:
    """The case for `seed` (deterministic): a category, a door, a model and maybe data."""
    rng = np.random.default_rng(seed)
    base_name = list(BASES)[int(rng.integers(0, len(BASES)))]
    base = BASES[base_name](rng)
    categories = [Category.VALID, *MUTATIONS, *DATA_CATEGORIES, *FAMILIES]
    category = categories[int(rng.integers(0, len(categories)))]
    doors = [Door.LOADER, Door.EXECUTOR, Door.QUANTIZE, Door.CLI]
    door = doors[int(rng.choice(4, p=[0.4, 0.3, 0.2, 0.1]))]
    data = None
    what = base_name
    if category in FAMILIES:
        return FAMILIES[category](seed, base_name, base, door, rng)
    if category in MUTATIONS:
        desc, mutated = MUTATIONS[category](base, rng)
        raw = mutated if isinstance(mutated, bytes) else mutated.SerializeToString()
        what = f"{base_name}: {desc}"
    else:
        raw = base.SerializeToString()
        if category in DATA_CATEGORIES:
            desc, data = _bad_data(category, feeds_for(base, rng), rng)
            what = f"{base_name}: {desc}"
            door = Door.QUANTIZE if door in (Door.LOADER, Door.QUANTIZE) else door
    return Case(seed, category, door, what, raw, data)


# ---- families of issue 19: placement files, companion files, tiny magnitudes, initializer inputs ------------

PLACEMENT_EDITS = ("truncated JSON", "not JSON", "a list, not an object", "no 'regions'", "'regions' a string",
                   "a region without 'decision'", "'anchor' a list", "decision 'FLOAT'", "decision 'bogus'",
                   "'model_sha256' a number", "'format' of a future version", "'max_loss' NaN", "empty file",
                   "'target' x86-vnni (the run targets any)", "the file as saved")
VALID_PLACEMENT = "the file as saved"


def _placement_case(seed: int, base_name: str, base: onnx.ModelProto, door: Door, rng: np.random.Generator) -> Case:
    """A placement file saved for the gemm model (the base with a quantized region), edited, re-applied."""
    model = gemm_model(rng)
    edit = PLACEMENT_EDITS[int(rng.integers(0, len(PLACEMENT_EDITS)))]
    door = Door.CLI if door is Door.CLI else Door.QUANTIZE
    return Case(seed, Category.PLACEMENT_FILE, door, f"gemm: placement file, {edit}", model.SerializeToString(),
                setup=edit)


def edit_placement(text: str, edit: str, rng: np.random.Generator) -> str:
    """The saved placement file `text` with `edit` (one of PLACEMENT_EDITS) applied."""
    import json

    data = json.loads(text)
    region = data["regions"][0] if data.get("regions") else {}
    if edit == "truncated JSON":
        return text[: int(rng.integers(1, len(text) - 1))]
    if edit == "not JSON":
        return "placement: int8 everywhere\n"
    if edit == "a list, not an object":
        return json.dumps([data])
    if edit == "no 'regions'":
        del data["regions"]
    elif edit == "'regions' a string":
        data["regions"] = "fc"
    elif edit == "a region without 'decision'":
        region.pop("decision", None)
    elif edit == "'anchor' a list":
        region["anchor"] = [region.get("anchor", "fc")]
    elif edit == "decision 'FLOAT'":
        region["decision"] = "FLOAT"
    elif edit == "decision 'bogus'":
        region["decision"] = "bogus"
    elif edit == "'model_sha256' a number":
        data["model_sha256"] = 12345
    elif edit == "'format' of a future version":
        data["format"] = "netquant.placement/99"
    elif edit == "'max_loss' NaN":
        data["max_loss"] = float("nan")
    elif edit == "empty file":
        return ""
    elif edit.startswith("'target'"):
        data["target"] = "x86-vnni"
    return json.dumps(data, indent=1)


COMPANION_SCENARIOS = ("stale m.bin, -o m.xml", "read-only stale m.bin, -o m.xml", "stale m.bin, -o m.param",
                       "stale m.table, -o m.param", "stale m.bin, -o m.xml --overwrite", "-o m.bin", "-o m",
                       "-o -", "-o m.json", "--json over the calibration file", "--report over a calibration image",
                       "-o over the model", "python export m.xml, stale m.bin",
                       "python export m.xml, stale m.bin, overwrite=True", "python export over the calibration file")


def _companion_case(seed: int, base_name: str, base: onnx.ModelProto, door: Door, rng: np.random.Generator
                    ) -> Case:
    scenario = COMPANION_SCENARIOS[int(rng.integers(0, len(COMPANION_SCENARIOS)))]
    door = Door.QUANTIZE if scenario.startswith("python") else Door.CLI
    data = {base.graph.input[0].name: np.stack([feeds_for(base, rng)[base.graph.input[0].name][0]] * 4)}
    return Case(seed, Category.COMPANION, door, f"{base_name}: {scenario}", base.SerializeToString(), data,
                setup=scenario)


X_SCALES, W_SCALES = (1.0, 1e-4, 1e-6, 1e-8, 1e-10, 1e-12), (1.0, 1e-3, 1e-6, 1e-8, 1e-10)


def _tiny_case(seed: int, base_name: str, base: onnx.ModelProto, door: Door, rng: np.random.Generator) -> Case:
    """Weights and / or calibration data scaled far below 1 (never both 1)."""
    xs, ws = 1.0, 1.0
    while xs == 1.0 and ws == 1.0:
        xs = float(rng.choice(X_SCALES))
        ws = float(rng.choice(W_SCALES))
    for t in base.graph.initializer:
        arr = numpy_helper.to_array(t)
        if arr.dtype == np.float32 and arr.ndim:
            t.CopyFrom(numpy_helper.from_array((arr * np.float32(ws)).astype(np.float32), t.name))
    name = base.graph.input[0].name
    x = np.stack([feeds_for(base, rng)[name][0] for _ in range(4)]) * np.float32(xs)
    door = door if door in (Door.QUANTIZE, Door.CLI) else Door.QUANTIZE
    return Case(seed, Category.TINY, door, f"{base_name}: data x{xs:g}, weights x{ws:g}", base.SerializeToString(),
                {name: x.astype(np.float32)})


def _init_input_case(seed: int, base_name: str, base: onnx.ModelProto, door: Door, rng: np.random.Generator
                     ) -> Case:
    """Every initializer also listed among the graph inputs (IR >= 4 allows it: keep_initializers_as_inputs)."""
    for t in base.graph.initializer:
        base.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    base.ir_version = int(rng.integers(4, 9))
    return Case(seed, Category.INIT_INPUT, door, f"{base_name}: initializers as inputs, IR {base.ir_version}",
                base.SerializeToString())


FAMILIES: dict[Category, Callable[[int, str, onnx.ModelProto, Door, np.random.Generator], Case]] = {
    Category.PLACEMENT_FILE: _placement_case, Category.COMPANION: _companion_case, Category.TINY: _tiny_case,
    Category.INIT_INPUT: _init_input_case,
}
RUNS_IN_ORT = (Category.VALID, Category.TINY, Category.INIT_INPUT)  # a NetquantError here refuses a sound model


# ---- running ----------------------------------------------------------------------------------------

class Hang(Exception):
    """A case ran past its time limit."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def on_alarm(signum: int, frame: object) -> None:
        raise Hang(f"ran past {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _ort_session(raw: bytes) -> Any:
    """An onnxruntime session for a model onnx's full checker accepts (malformed bytes can crash ORT), else None."""
    import onnxruntime as ort

    try:
        model = onnx.load_from_string(raw)
        onnx.checker.check_model(model, full_check=True)
        so = ort.SessionOptions()
        so.log_severity_level = 4
        return ort.InferenceSession(raw, so, providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001 - any refusal means: no reference
        return None


def _agree(ours: dict[str, Any], sess: Any, feeds: dict[str, np.ndarray]) -> bool:
    overflow = any(np.issubdtype(v.dtype, np.floating) and v.size and np.nanmax(np.abs(v)) > 1e37
                   for v in feeds.values() if isinstance(v, np.ndarray))
    try:
        theirs = sess.run(None, feeds)
    except Exception:  # noqa: BLE001 - ORT refuses these inputs; nothing to compare
        return True
    for meta, ref in zip(sess.get_outputs(), theirs):
        got = ours[meta.name].detach().cpu().numpy() if meta.name in ours else None
        if got is None or got.shape != ref.shape:
            return False
        a, b = got.astype(np.float64), ref.astype(np.float64)
        # inputs at the edge of float32 (|x| ~ 3e38): whether a sum overflows to Inf (and Inf * 0 to NaN later)
        # depends on summation order, so only outputs finite in both are compared
        edge = (~np.isfinite(a) | ~np.isfinite(b)) if overflow else np.zeros(a.shape, bool)
        if not np.allclose(a[~edge], b[~edge], rtol=1e-4, atol=1e-5, equal_nan=True):
            return False
    return True


def _calib_for(raw: bytes, data: Any, rng: np.random.Generator) -> Any:
    if data is not None:
        return data
    try:
        return [feeds_for(onnx.load_from_string(raw), rng, batch=1) for _ in range(2)]
    except Exception:  # noqa: BLE001 - the loader will say what is wrong with the model
        return [np.zeros((1, 3, 6, 6), np.float32)]


def run_case(case: Case, workdir: Path, limit_s: float = 20.0) -> Result:
    """Run `case` through its door inside a fresh folder under `workdir`; classify what happened."""
    from netquant import quantize_onnx
    from netquant.graph import Executor, load_onnx

    folder = Path(tempfile.mkdtemp(prefix=f"case{case.seed}_", dir=workdir))
    rng = np.random.default_rng(case.seed + 1)
    start = time.perf_counter()
    outcome, detail = Outcome.OK, ""
    written: set[str] = set()
    protected: dict[str, bytes | None] = {}  # files made before the run: unchanged after it (None: may be replaced)
    try:
        with time_limit(limit_s):
            if case.category is Category.PLACEMENT_FILE:
                outcome, detail, names = _run_placement(case, folder, rng, protected)
                written |= names
            elif case.category is Category.COMPANION:
                outcome, detail, names = _run_companion(case, folder, protected)
                written |= names
            elif case.door is Door.LOADER:
                load_onnx(case.model)
            elif case.door is Door.EXECUTOR:
                graph = load_onnx(case.model)
                feeds = feeds_for(onnx.load_from_string(case.model), rng) if case.data is None else (
                    case.data if isinstance(case.data, dict) else {})
                ours = Executor(graph).run(feeds)
                sess = _ort_session(case.model)
                if sess is None:
                    outcome = Outcome.OK_ORT_REFUSES
                elif not _agree(ours, sess, feeds):
                    outcome, detail = Outcome.DISAGREES, "executor output differs from onnxruntime's"
            elif case.door is Door.QUANTIZE:
                calib = _calib_for(case.model, case.data, rng)
                if case.category is Category.TINY:  # one sample per batch: fits a static batch dim of 1
                    calib = [{k: v[i:i + 1] for k, v in calib.items()} for i in range(4)]
                qm = quantize_onnx(case.model, calib, quiet=True)
                qm.export(folder / "q.onnx", allow_float=True)  # validated against onnxruntime on a batch before it is written
                written.add("q.onnx")
            else:
                outcome, detail = _run_cli(case, folder, rng)
                written |= {"q.onnx", "p.json"} if outcome is Outcome.OK else set()
            if case.category is Category.TINY and outcome is Outcome.OK:
                outcome, detail = _int8_vs_fp32(case, folder / "q.onnx")
    except NetquantError as exc:
        outcome, detail = Outcome.NETQUANT_ERROR, f"{type(exc).__name__}: {str(exc)[:200]}"
    except Hang as exc:
        outcome, detail = Outcome.HANG, str(exc)
    except Exception as exc:  # noqa: BLE001 - exactly what the fuzz tier hunts for
        outcome, detail = Outcome.OTHER_EXCEPTION, f"{type(exc).__name__}: {str(exc)[:300]}"
    if (outcome is Outcome.NETQUANT_ERROR and case.category in RUNS_IN_ORT and case.door is not Door.LOADER
            and _ort_session(case.model) is not None):
        outcome = Outcome.REFUSED_VALID
    changed = sorted(n for n, b in protected.items()
                     if b is not None and (not (folder / n).is_file() or (folder / n).read_bytes() != b))
    if changed:
        outcome, detail = Outcome.CLOBBERED, ", ".join(changed)
    inputs = {"m.onnx", "calib.npz", *protected}
    left = sorted(p.name for p in folder.iterdir() if p.name not in written | inputs)
    if left and outcome.good:
        outcome, detail = Outcome.LEFTOVER, ", ".join(left)
    for p in folder.iterdir():
        p.chmod(0o600)
        p.unlink()
    folder.rmdir()
    return Result(case, outcome, detail, time.perf_counter() - start)


def _int8_vs_fp32(case: Case, path: Path) -> tuple[Outcome, str]:
    """A written file of the tiny-magnitudes family keeps the signal: cosine vs the FP32 model in onnxruntime
    >= 0.9 on the calibration data, unless FP32's own output is below float32's normal range."""
    sess, ref_sess = _ort_session(path.read_bytes()), _ort_session(case.model)
    if sess is None or ref_sess is None:
        return Outcome.OK_ORT_REFUSES, ""
    feeds = {k: v[:1] for k, v in (case.data or {}).items()}
    y, ref = sess.run(None, feeds)[0].astype(np.float64), ref_sess.run(None, feeds)[0].astype(np.float64)
    if np.abs(ref).max(initial=0) < np.finfo(np.float32).tiny:
        return Outcome.OK, ""
    cos = float(y.ravel() @ ref.ravel() / max(np.linalg.norm(y) * np.linalg.norm(ref), 1e-300))
    if cos < 0.9:
        return Outcome.DISAGREES, f"int8 vs FP32 cosine {cos:.4f} (max |int8| {np.abs(y).max():.3g})"
    return Outcome.OK, ""


def _invoke(args: list[str]) -> tuple[Outcome, str]:
    """`netquant quantize ARGS` in-process: OK (exit 0), a NetquantError (exit 1/2, no traceback) or another
    exception."""
    from click.testing import CliRunner

    from netquant.cli.main import cli

    # (--allow-float: many fuzz models have nothing onnxruntime runs in INT8; the float policy has its own tests)
    result = CliRunner().invoke(cli, ["quantize", *args, "--allow-float"])
    if result.exit_code == 0:
        return Outcome.OK, ""
    exc = result.exception
    if result.exit_code in (1, 2) and (exc is None or isinstance(exc, SystemExit)):
        message = result.output.strip().splitlines()[-1][:200] if result.output.strip() else ""
        return Outcome.NETQUANT_ERROR, ("exit 1: " if result.exit_code == 1 else "usage error: ") + message
    if isinstance(exc, NetquantError):
        return Outcome.NETQUANT_ERROR, type(exc).__name__
    return Outcome.OTHER_EXCEPTION, f"{type(exc).__name__}: {str(exc)[:300]}" if exc else f"exit {result.exit_code}"


def _run_placement(case: Case, folder: Path, rng: np.random.Generator, protected: dict[str, bytes | None]
                   ) -> tuple[Outcome, str, set[str]]:
    """Save the model's placement file, edit it (case.setup), re-apply it through the case's door."""
    from netquant import quantize_onnx

    calib = [feeds_for(onnx.load_from_string(case.model), rng, batch=2) for _ in range(2)]
    placement = folder / "p.json"
    quantize_onnx(case.model, calib, quiet=True).save_placement(placement)
    placement.write_text(edit_placement(placement.read_text(), case.setup, rng))
    protected["p.json"] = placement.read_bytes()
    if case.door is Door.QUANTIZE:
        quantize_onnx(case.model, calib, quiet=True, placement_from=placement).export(folder / "q.onnx", allow_float=True)
        outcome, detail = Outcome.OK, ""
    else:
        (folder / "m.onnx").write_bytes(case.model)
        np.savez(folder / "calib.npz", x=np.concatenate([c["x"] for c in calib]))
        outcome, detail = _invoke([str(folder / "m.onnx"), "--calib", str(folder / "calib.npz"), "-o",
                                   str(folder / "q.onnx"), "--placement-from", str(placement), "-q"])
    if outcome is Outcome.OK and case.setup != VALID_PLACEMENT:
        return Outcome.ACCEPTED_INVALID, f"placement file with {case.setup} applied", {"q.onnx"}
    return outcome, detail, {"q.onnx"} if outcome is Outcome.OK else set()


def _run_companion(case: Case, folder: Path, protected: dict[str, bytes | None]) -> tuple[Outcome, str, set[str]]:
    """One COMPANION_SCENARIOS entry: stale companions, output names without a format, outputs over inputs."""
    from netquant import quantize_onnx

    scenario = case.setup
    model, calib = folder / "m.onnx", folder / "calib.npz"
    model.write_bytes(case.model)
    assert case.data is not None
    np.savez(calib, **case.data)
    for name in ("m.bin", "m.table"):
        if f"stale {name}" in scenario:
            (folder / name).write_bytes(b"another model's " + name.encode())
    if "read-only" in scenario:
        (folder / "m.bin").chmod(0o400)
    if "image" in scenario:
        (folder / "c0.png").write_bytes(b"\x89PNG\r\n\x1a\n not really an image")
    allowed = "overwrite" in scenario.lower()
    protected.update({p.name: None if allowed and p.suffix == ".bin" else p.read_bytes() for p in folder.iterdir()})
    main = {"-o m.xml": "m.xml", "-o m.param": "m.param"}
    samples = [{k: v[i:i + 1] for k, v in case.data.items()} for i in range(4)]  # static batch dims of 1 fit
    if scenario.startswith("python"):
        if "over the calibration file" in scenario:  # the source model read through a relative path, then chdir
            here = os.getcwd()
            os.chdir(folder)
            try:
                qm = quantize_onnx("m.onnx", samples, quiet=True)
            finally:
                os.chdir(here)
            qm.export(model.resolve(), format="json")
            return Outcome.ACCEPTED_INVALID, "wrote over the source model", set()
        quantize_onnx(case.model, samples, quiet=True).export(folder / "m.xml", overwrite=allowed, allow_float=True)
        outcome, detail, out = Outcome.OK, "", {"m.xml", "m.bin"}
    else:
        args = [str(model), "--calib", str(calib if "image" not in scenario else folder), "-q"]
        if "--json over" in scenario:
            args += ["-o", str(folder / "q.onnx"), "--json", str(calib)]
        elif "--report over" in scenario:
            args += ["-o", str(folder / "q.onnx"), "--report", str(folder / "c0.png")]
        elif "-o over the model" in scenario:
            args += ["-o", str(model)]
        else:
            flag = next(k for k in ("-o m.xml", "-o m.param", "-o m.bin", "-o m.json", "-o m", "-o -")
                        if scenario.endswith(k) or f"{k} " in f"{scenario.split(', ')[-1]} ")
            name = flag.split(" ")[1]
            args += ["-o", name if name == "-" else str(folder / name)] + (["--overwrite"] if allowed else [])
        here = os.getcwd()
        os.chdir(folder)  # '-o -' would name a file in the current folder
        try:
            outcome, detail = _invoke(args)
        finally:
            os.chdir(here)
        out = {"m.xml": {"m.xml", "m.bin"}, "m.param": {"m.param", "m.bin", "m.table"}}.get(
            next((v for k, v in main.items() if k in scenario), ""), set())
    if outcome is Outcome.OK and not allowed:
        return Outcome.ACCEPTED_INVALID, f"{scenario}: written", out
    return outcome, detail, out if outcome is Outcome.OK else set()


def _run_cli(case: Case, folder: Path, rng: np.random.Generator) -> tuple[Outcome, str]:
    (folder / "m.onnx").write_bytes(case.model)
    calib = "random"
    if case.data:
        np.savez(folder / "calib.npz", **case.data)
        calib = str(folder / "calib.npz")
    return _invoke([str(folder / "m.onnx"), "--calib", calib, "-o", str(folder / "q.onnx"), "--json",
                    str(folder / "p.json"), "-q"])


@dataclass
class Tally:
    """Outcome counts per category."""

    counts: dict[Category, dict[Outcome, int]] = field(default_factory=dict)
    bad: list[Result] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, r: Result) -> None:
        row = self.counts.setdefault(r.case.category, {})
        row[r.outcome] = row.get(r.outcome, 0) + 1
        self.seconds += r.seconds
        if not r.outcome.good:
            self.bad.append(r)

    @property
    def total(self) -> int:
        return sum(sum(row.values()) for row in self.counts.values())

    def markdown(self) -> str:
        cols = list(Outcome)
        lines = ["| category | cases | " + " | ".join(c.value for c in cols) + " |",
                 "|---|---:|" + "---:|" * len(cols)]
        for cat in Category:
            row = self.counts.get(cat, {})
            if row:
                lines.append(f"| {cat.value} | {sum(row.values())} | "
                             + " | ".join(str(row.get(c, 0)) for c in cols) + " |")
        totals = {c: sum(r.get(c, 0) for r in self.counts.values()) for c in cols}
        lines.append(f"| **all** | **{self.total}** | " + " | ".join(f"**{totals[c]}**" for c in cols) + " |")
        return "\n".join(lines)


def run_cases(seeds: range, workdir: str | os.PathLike[str], limit_s: float = 20.0) -> Tally:
    tally = Tally()
    for seed in seeds:
        tally.add(run_case(make_case(seed), Path(workdir), limit_s))
    return tally
