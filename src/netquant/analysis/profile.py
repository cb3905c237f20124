"""onnxruntime's per-node times of a model, and their attribution to netquant's ops and regions.

`profile_onnx` runs a model at batch 1 on the CPU provider (one intra-op thread by default) with
SessionOptions.enable_profiling and keeps, per node of the graph onnxruntime really runs (after its
fusions, saved with optimized_model_filepath), the median time over the timed runs.

onnxruntime renames what it fuses, so `NodeMap.resolve` maps an optimized node back to our graph by evidence,
first match wins:
1. its name, less onnxruntime's '_token_<n>' / '/duplicated' suffixes, is one of our nodes (QLinearConv 'Conv@3_token_9');
2. an initializer it reads is one of ours ('w_quantized', 'w_quantized_scale' -> 'w') or is named after one of
   our nodes ('Conv@4_bias_folded'): the op that owns that weight;
3. '<tensor>_nchwc' (NCHWc convs, pools): the producer of <tensor>;
4. '<tensor>_QuantizeLinear' / '<tensor>_DequantizeLinear': Q/DQ glue on <tensor>: a Quantize is charged to the
   int8 consumers of <tensor> (they need it), a Dequantize to its int8 producer, else the other side;
5. anything else (Transpose for NHWC kernels, ReorderInput/Output, Reshape): layout glue, charged to the nearest
   resolved nodes before and after it in the optimized graph (int8 ones first, split evenly).
"""

from __future__ import annotations

import functools
import json
import os
import re
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from netquant.analysis.timing import interleaved_ms
from netquant.errors import ExportError
from netquant.export.ort_kernels import save_optimized_graph
from netquant.graph import Graph
from netquant.graph.light import ort_session

_SUFFIX = re.compile(r"(_token_\d+|/duplicated)+$")
_INIT_SUFFIXES = ("_quantized_zero_point", "_quantized_scale", "_quantized", "_zero_point", "_scale")


@dataclass
class OrtProfile:
    """Median per-run times (ms) of each node onnxruntime ran, the optimized graph, and the run latency."""

    node_ms: dict[str, float]
    op_types: dict[str, str]
    inputs: dict[str, list[str]]
    outputs: dict[str, list[str]]
    initializers: set[str]
    total_ms: float
    runs: int
    # profile_onnx(keep_session=True): the profiled session, profiling ended (its outputs are a plain session's:
    # profiling changes no kernel), for callers that need the model's outputs too
    session: Any = field(default=None, compare=False, repr=False)

    @property
    def node_total_ms(self) -> float:
        return sum(self.node_ms.values())


def profile_onnx(model: onnx.ModelProto | str | os.PathLike[str], feeds: Mapping[str, np.ndarray], *,
                 runs: int = 20, warmup: int = 3, threads: int = 1, keep_session: bool = False) -> OrtProfile:
    """Profile `model` in onnxruntime (CPU provider, all graph optimizations, `threads` intra-op threads):
    `warmup` untimed runs then `runs` timed ones; medians per node and of the whole run. keep_session: the session
    is returned in OrtProfile.session (its profiling ended) instead of being dropped."""
    import onnxruntime as ort

    with tempfile.TemporaryDirectory(prefix="netquant_profile_") as tmp:
        path = Path(tmp) / "model.onnx"
        if isinstance(model, onnx.ModelProto):
            onnx.save(model, str(path))
        else:
            path = Path(model)
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        save_optimized_graph(so, Path(tmp) / "optimized.onnx")  # only its graph is read back, not its weights
        so.enable_profiling = True
        so.profile_file_prefix = str(Path(tmp) / "profile")
        try:
            sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        except Exception as exc:
            raise ExportError(f"onnxruntime cannot load the model to profile it: {exc}") from exc
        optimized = onnx.load(str(Path(tmp) / "optimized.onnx"), load_external_data=False)
        feed = {k: np.ascontiguousarray(v) for k, v in feeds.items()}
        for _ in range(warmup + runs):
            sess.run(None, feed)
        trace = Path(sess.end_profiling())
        events = json.loads(trace.read_text())
    per_node: dict[str, list[float]] = defaultdict(list)
    totals: list[float] = []
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            per_node[e["name"][:-len("_kernel_time")]].append(e["dur"] / 1000.0)
        elif e.get("cat") == "Session" and e["name"] == "SequentialExecutor::Execute":
            totals.append(e["dur"] / 1000.0)
    node_ms = {k: statistics.median(v[warmup:] or v) for k, v in per_node.items()}
    g = optimized.graph
    return OrtProfile(node_ms=node_ms, op_types={n.name: n.op_type for n in g.node},
                      inputs={n.name: list(n.input) for n in g.node}, outputs={n.name: list(n.output) for n in g.node},
                      initializers={t.name for t in g.initializer}, total_ms=statistics.median(totals[warmup:] or totals),
                      runs=runs, session=sess if keep_session else None)


def cpu_session(model: onnx.ModelProto, threads: int = 1) -> Any:
    """An onnxruntime CPU session of `model` (all optimizations, `threads` intra-op threads, one inter-op thread), as
    wall_clock_ms builds them; ExportError when onnxruntime cannot load it."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    try:
        return ort_session(model, so)
    except Exception as exc:
        raise ExportError(f"onnxruntime cannot load the model to time it: {exc}") from exc


def wall_clock_ms(models: Sequence[onnx.ModelProto], feeds: Mapping[str, np.ndarray], *, rounds: int = 5,
                  runs: int = 8, threads: int = 1, budget_s: float | None = None, min_rounds: int = 3,
                  settled: Callable[[list[float]], bool] | None = None,
                  sessions: Sequence[Any | None] | None = None,
                  first_outputs: list[list[Any]] | None = None) -> list[float]:
    """Median wall-clock ms of one run of each model in onnxruntime (CPU, all optimizations, no profiler), the models
    interleaved round by round so that machine load hits them alike (analysis.timing.interleaved_ms).
    budget_s: fewer runs per round (down to 1), then fewer rounds (down to min_rounds), where `rounds` x `runs` of
    every model would take longer, going by the warm-up runs (a large model's single runs vary less).
    settled: stop after `min_rounds` once settled(the medians so far) holds (interleaved_ms).
    sessions: per model, a session built already (cpu_session with the same `threads`) or None (built here).
    first_outputs: filled with each model's outputs of its warm-up run (one list per model)."""
    given = list(sessions) if sessions is not None else [None] * len(models)
    built = [g if g is not None else cpu_session(m, threads) for m, g in zip(models, given, strict=True)]
    feed = {k: np.ascontiguousarray(v) for k, v in feeds.items()}
    calls = [functools.partial(sess.run, None, feed) for sess in built]
    start = time.perf_counter()
    warm = [call() for call in calls]  # the warm-up runs, timed together
    one_round_s = time.perf_counter() - start
    if first_outputs is not None:
        first_outputs.extend(list(w) for w in warm)
    if budget_s is not None:
        runs = max(1, min(runs, int(budget_s / max(rounds * one_round_s, 1e-9))))
        rounds = max(min(rounds, min_rounds), min(rounds, int(budget_s / max(one_round_s, 1e-9))))
    return interleaved_ms(calls, per_round=runs, rounds=rounds, warmup=0, settled=settled, min_rounds=min_rounds)


@dataclass
class NodeMap:
    """Our graph's names, to map onnxruntime's optimized nodes back to our ops (see module docstring)."""

    graph: Graph
    producer: dict[str, str] = field(default_factory=dict)
    consumers: dict[str, list[str]] = field(default_factory=dict)
    init_owner: dict[str, str] = field(default_factory=dict)
    names: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        inits = set(self.graph.initializers)
        for n in self.graph.nodes:
            self.names.add(n.name)
            for o in n.outputs:
                if o:
                    self.producer[o] = n.name
            for i in n.inputs:
                if i:
                    self.consumers.setdefault(i, []).append(n.name)
                    if i in inits:
                        self.init_owner.setdefault(i, n.name)
        self._by_len = sorted(self.names, key=len, reverse=True)

    def resolve(self, prof: OrtProfile, node: str) -> tuple[str, Any] | None:
        """('op', name) / ('q', tensor) / ('dq', tensor) for rules 1-4 of the module docstring, else None."""
        base = _SUFFIX.sub("", node)
        if base in self.names:
            return "op", base
        for i in prof.inputs.get(node, []):
            if i in prof.initializers:
                stem = _strip_init(i)
                if stem in self.init_owner:
                    return "op", self.init_owner[stem]
        for i in prof.inputs.get(node, []):
            if i in prof.initializers:
                owner = next((n for n in self._by_len if i.startswith(n + "_")), None)
                if owner is not None:
                    return "op", owner
        if base.endswith("_nchwc") and base[:-6] in self.producer:
            return "op", self.producer[base[:-6]]
        for suffix, kind in (("_QuantizeLinear", "q"), ("_DequantizeLinear", "dq")):
            if base.endswith(suffix):
                tensor = base[:-len(suffix)]
                if tensor in self.init_owner:
                    return "op", self.init_owner[tensor]
                if tensor in self.producer or tensor in self.consumers:
                    return kind, tensor
        return None


def _strip_init(name: str) -> str:
    for s in _INIT_SUFFIXES:
        if name.endswith(s):
            return name[:-len(s)]
    return name


OTHER = ""  # the key of time charged to no region (float ops outside every region)


def region_times(prof: OrtProfile, nmap: NodeMap, region_of: Mapping[str, str], int8: set[str]) -> dict[str, float]:
    """Milliseconds per region (key: anchor; OTHER for the rest) of profile `prof`, where `int8` are the regions
    run in int8 in the profiled model (they decide which side Q/DQ and layout glue is charged to)."""
    out: dict[str, float] = defaultdict(float)
    resolved = {n: nmap.resolve(prof, n) for n in prof.op_types}

    def regions_of_ref(ref: tuple[str, Any]) -> list[str]:
        kind, what = ref
        if kind == "op":
            r = region_of.get(what)
            return [r] if r else []
        prod = region_of.get(nmap.producer.get(what, ""), "")
        cons = sorted({region_of[c] for c in nmap.consumers.get(what, []) if c in region_of})
        first, second = ([c for c in cons if c in int8], [prod] if prod in int8 else []) if kind == "q" else \
            ([prod] if prod in int8 else [], [c for c in cons if c in int8])
        return first or second or ([prod] if prod else cons)

    producers = {o: n for n, outs in prof.outputs.items() for o in outs}
    consumers: dict[str, list[str]] = defaultdict(list)
    for n, ins in prof.inputs.items():
        for i in ins:
            consumers[i].append(n)

    def nearest(node: str) -> list[str]:
        found: list[str] = []
        for direction in ("up", "down"):
            frontier, seen, hits = [node], {node}, []
            for _ in range(4):
                nxt: list[str] = []
                for f in frontier:
                    if direction == "up":
                        near = [producers[i] for i in prof.inputs.get(f, []) if i in producers]
                    else:
                        near = [c for o in prof.outputs.get(f, []) for c in consumers.get(o, [])]
                    for m in near:
                        if m in seen:
                            continue
                        seen.add(m)
                        ref = resolved.get(m)
                        if ref is None:
                            nxt.append(m)
                        else:
                            hits.extend(regions_of_ref(ref) or [OTHER])
                if hits or not nxt:
                    break
                frontier = nxt
            found.extend(h for h in hits if h != OTHER)
        regions = sorted(set(found))
        pick = [r for r in regions if r in int8]
        return pick or regions

    for node, ms in prof.node_ms.items():
        ref = resolved.get(node)
        regions = regions_of_ref(ref) if ref is not None else nearest(node)
        if not regions:
            out[OTHER] += ms
        else:
            for r in regions:
                out[r] += ms / len(regions)
    return dict(out)


_WEIGHT_OPS = ("Conv", "ConvTranspose", "Gemm")


def ort_requantizes(model: onnx.ModelProto, names: set[str]) -> set[str]:
    """The nodes among `names` (float Conv / ConvTranspose / Gemm) that onnxruntime's WeightBiasQuantization will run
    in INT8 anyway: input 0 from a per-tensor DequantizeLinear, a float weight initializer, and one unbranched path
    (through Relu / Clip) to a QuantizeLinear. It then quantizes the weight itself, symmetric per-tensor full-range
    int8 (onnxruntime/core/optimizer/qdq_transformer/weight_bias_quantization.cc), which saturates the int16 pair sums
    of x86 CPUs without VNNI."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for n in g.node:
        for i in n.input:
            consumers[i].append(n)

    def scalar(name: str) -> bool:
        t = inits.get(name)
        return t is not None and int(np.prod(t.dims)) == 1

    def path_to_q(node: onnx.NodeProto) -> bool:
        current = node
        for _ in range(8):
            if len(current.output) != 1 or len(consumers.get(current.output[0], [])) != 1:
                return False
            nxt = consumers[current.output[0]][0]
            if nxt.op_type == "QuantizeLinear":
                return True
            if nxt.op_type not in ("Relu", "Clip"):
                return False
            current = nxt
        return False

    out = set()
    for n in g.node:
        if n.name not in names or n.op_type not in _WEIGHT_OPS or len(n.input) < 2:
            continue
        dq = producer.get(n.input[0])
        if dq is None or dq.op_type != "DequantizeLinear" or len(dq.input) < 2 or not scalar(dq.input[1]):
            continue
        w = inits.get(n.input[1])
        if w is None or w.data_type != onnx.TensorProto.FLOAT:
            continue
        if path_to_q(n):
            out.add(n.name)
    return out
