"""Run a Graph with torch: CPU or CUDA, hooks around every op, autograd through it.

Construction resolves every op implementation and every argument slot once, so a run is a tight loop
over pre-built steps.  Values live in a flat list indexed by slot and are dropped right after their
last reader unless the caller asked to keep them.  Constant sub-expressions (nodes whose inputs are all
initializers, e.g. ConstantOfShape weights) are evaluated once at construction.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from netquant.core.int_kernels import Accumulation
from netquant.errors import ConfigError, DataError, ModelError, NetquantError
from netquant.graph.dtypes import numpy_to_torch
from netquant.graph.fastpath import INPLACE, InplaceFn, storage_is_private
from netquant.graph.ir import Graph, Node
from netquant.graph.ops.registry import OpContext, OpFn, lookup_op

PreHook = Callable[[Node, list[Any]], "list[Any] | None"]
PostHook = Callable[[Node, list[Any]], "list[Any] | None"]
Inputs = Mapping[str, Any] | Sequence[Any]

# ops whose output changes between runs even with constant inputs: never folded
NONDETERMINISTIC = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
                    "Bernoulli", "Dropout"}


def _private_refcount() -> int:
    """sys.getrefcount of a tensor held only by an args list and a local variable, measured in the same
    shape as the in-place check (the exact count differs between Python versions)."""
    args = [torch.empty(1)]
    target = args[0]
    return sys.getrefcount(target)


_PRIVATE_REFS = _private_refcount()


def _inline_local_functions(graph: Graph) -> Graph:
    """A graph calling model-local functions (ModelProto.functions) is run with them inlined."""
    if not graph.model_info.functions:
        return graph
    import onnx
    import onnx.inliner

    from netquant.graph.load import load_onnx
    from netquant.graph.save import to_onnx

    local = set()
    for raw in graph.model_info.functions:
        f = onnx.FunctionProto()
        f.ParseFromString(raw)
        local.add((f.domain, f.name))
    if not any((n.domain, n.op_type) in local for g in graph.iter_graphs() for n in g.nodes):
        return graph
    return load_onnx(onnx.inliner.inline_local_functions(to_onnx(graph, check=False)), infer_shapes=False)


class Handle:
    """Returned by add_*_hook; remove() detaches the hook. It holds the executor and a hook that is a bound method
    weakly: an object keeping the handles of its own methods' hooks forms no reference cycle, so what it holds (a
    quantized graph and its weights) is freed when its last user drops it, not at the next garbage collection."""

    def __init__(self, executor: Executor, post: bool, fn: Any) -> None:
        self._executor = weakref.ref(executor)
        self._post = post
        self._fn: Callable[[], Any] = weakref.WeakMethod(fn) if inspect.ismethod(fn) else lambda: fn

    def remove(self) -> None:
        executor, fn = self._executor(), self._fn()
        if executor is None or fn is None:
            return
        with contextlib.suppress(ValueError):
            (executor._post_hooks if self._post else executor._pre_hooks).remove(fn)


@dataclass
class _Step:
    node: Node
    fn: OpFn
    ctx: OpContext
    in_slots: list[int]
    out_slots: list[int]
    outer: list[tuple[str, int]] = field(default_factory=list)  # subgraph free values
    has_subgraphs: bool = False


@dataclass
class _Plan:
    steps: list[tuple[_Step, list[int], InplaceFn | None, list[int]]]
    # (step, slots to free after it, in-place variant, input indices it may overwrite)
    out_slots: list[tuple[str, int]]


def _to_tensor(x: Any) -> Any:
    if isinstance(x, np.ndarray | np.generic):
        if x.dtype == object:
            return x
        return numpy_to_torch(np.asarray(x))
    return x


class Executor:
    """Executes a Graph; see the module docstring.

    run(inputs) -> {output name: tensor}; inputs as {name: tensor} or a list in graph-input order
    (numpy arrays accepted).  `outputs` may name any intermediate value; `keep=True` (or a list of
    names) keeps those values alive and returns them too.
    """

    def __init__(self, graph: Graph, device: str | torch.device = "cpu", *, fold_constants: bool = True,
                 check_inputs: bool = True, inplace: bool = True, channels_last: bool | None = False,
                 accumulation: Accumulation = Accumulation.EXACT,
                 _outer_names: Sequence[str] = (),
                 _hooks: tuple[list[PreHook], list[PostHook]] | None = None) -> None:
        """fold_constants: evaluate constant sub-expressions once here.
        inplace: overwrite dying activations in cheap elementwise ops when nothing else references them
        (hooks get their own list copies, so a tensor a hook keeps is never overwritten) and no gradient
        flows through.
        channels_last: keep 4-D activations of conv nets in NHWC memory order; None = on for CPU graphs
        with 2-D convolutions.  Off by default: measured on PP-OCRv4 rec / ResNet-50 it helps at batch 1
        (-30% latency) but not at batch 16, where torch's NHWC BatchNorm is slower.  Same values.
        accumulation: how integer ops (QLinearConv, MatMulInteger, QGemm, ...) sum u8 x s8 products: EXACT
        (the ONNX semantics; VNNI / ARM kernels) or PAIRWISE_INT16 (onnxruntime on x86 without VNNI)."""
        graph = _inline_local_functions(graph)
        self.graph = graph
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"Executor device '{device}': CUDA is not available in this torch build / machine; "
                              f"use device='cpu'")
        self.check_inputs = check_inputs
        self.accumulation = accumulation
        self.inplace = inplace
        self._pre_hooks, self._post_hooks = _hooks if _hooks is not None else ([], [])
        self._sub_executors: dict[int, Executor] = {}
        self._plans: dict[tuple[Any, ...], _Plan] = {}

        self._slot: dict[str, int] = {}
        self.initializers: dict[str, torch.Tensor] = {
            name: t.to(self.device) for name, t in graph.initializers.items()}
        for name in graph.opaque_initializers:
            from onnx import TensorProto, numpy_helper

            proto = TensorProto()
            proto.ParseFromString(graph.opaque_initializers[name])
            self.initializers[name] = numpy_helper.to_array(proto)  # type: ignore[assignment]
        for name in self.initializers:
            self._slot_of(name)
        self._elem_types = self._known_elem_types()
        # ir_version >= 4 inputs naming an initializer are defaults callers may feed (never folded)
        self._overridable = ({v.name for v in graph.initializer_inputs}
                             if graph.model_info.ir_version >= 4 else set())
        self._input_slots = [self._slot_of(v.name) for v in graph.inputs]
        self._outer_slots = [(n, self._slot_of(n)) for n in _outer_names]
        self._steps = [self._build_step(node) for node in graph.nodes]
        self.folded: dict[str, Any] = {}
        if fold_constants:
            self._fold_constant_steps()
        self.channels_last = self._use_channels_last(channels_last)

    # ------------------------------------------------------------------ construction
    def _use_channels_last(self, wanted: bool | None) -> bool:
        """Store 4-D conv weights (initializers or folded constants) channels-last; auto: CPU conv nets."""
        weights: list[tuple[dict[str, Any], str]] = []
        for step in self._steps:
            node = step.node
            if node.op_type in ("Conv", "ConvTranspose") and step.ctx.domain == "" and len(node.inputs) > 1:
                for table in (self.initializers, self.folded):
                    w = table.get(node.inputs[1])
                    if isinstance(w, torch.Tensor) and w.dim() == 4 and w.is_floating_point():
                        weights.append((table, node.inputs[1]))
        use = (self.device.type == "cpu" and bool(weights)) if wanted is None else wanted
        if use:
            for table, name in weights:
                table[name] = table[name].contiguous(memory_format=torch.channels_last)
        return use

    def _slot_of(self, name: str) -> int:
        slot = self._slot.get(name)
        if slot is None:
            slot = self._slot[name] = len(self._slot)
        return slot

    def _known_elem_types(self) -> dict[str, int]:
        """ONNX element types known for values (declared, inferred, initializers): ops computing in a
        stand-in dtype (INT4 held as int8, ...) read them from ctx.extras."""
        from netquant.graph.dtypes import TORCH_TO_ONNX

        g = self.graph
        types: dict[str, int] = {n: TORCH_TO_ONNX[t.dtype] for n, t in g.initializers.items()
                                 if t.dtype in TORCH_TO_ONNX}
        types.update(g.initializer_types)
        for v in (*g.value_info.values(), *g.inputs, *g.outputs):
            if v.elem_type:
                types[v.name] = v.elem_type
        return types

    def _build_step(self, node: Node) -> _Step:
        domain = "" if node.domain in ("", "ai.onnx") else node.domain
        opset = self.graph.opset_imports.get(domain, self.graph.opset if domain == "" else 1)
        fn = lookup_op(node.op_type, domain, opset, node.name)
        ctx = OpContext(op_type=node.op_type, name=node.name, domain=domain, opset=opset,
                        num_outputs=len(node.outputs))
        # ONNX element types of inputs / outputs where known (None otherwise)
        ctx.extras["input_elem_types"] = [self._elem_types.get(i) if i else None for i in node.inputs]
        ctx.extras["output_elem_types"] = [self._elem_types.get(o) if o else None for o in node.outputs]
        ctx.extras["accumulation"] = self.accumulation
        outer: list[tuple[str, int]] = []
        subs = list(node.subgraphs())
        if subs:
            names = sorted(set().union(*(g.free_values() for g in subs)))
            outer = [(n, self._slot_of(n)) for n in names]
        return _Step(node, fn, ctx, [self._slot_of(i) if i else -1 for i in node.inputs],
                     [self._slot_of(o) if o else -1 for o in node.outputs], outer, bool(subs))

    def _fold_constant_steps(self) -> None:
        """Evaluate steps whose inputs are all constants once; their outputs become constants."""
        const = {self._slot[n] for n in self.initializers if n not in self._overridable}
        graph_outs = {v.name for v in self.graph.outputs}
        kept: list[_Step] = []
        values: dict[int, Any] = {self._slot[n]: t for n, t in self.initializers.items()}
        for step in self._steps:
            node = step.node
            foldable = (node.op_type not in NONDETERMINISTIC and not step.has_subgraphs
                        and all(s in const for s in step.in_slots if s >= 0)
                        and not graph_outs.intersection(node.outputs)
                        and node.op_type not in ("If", "Loop", "Scan"))
            if not foldable:
                kept.append(step)
                continue
            args = [values[s] if s >= 0 else None for s in step.in_slots]
            with torch.inference_mode():
                outs = self._call(step, args)
            for slot, name, out in zip(step.out_slots, node.outputs, outs):
                if slot >= 0:
                    values[slot] = out
                    const.add(slot)
                    self.folded[name] = out
        self._steps = kept

    # ------------------------------------------------------------------ hooks
    def add_pre_hook(self, fn: PreHook) -> Handle:
        """fn(node, inputs) before each op; return replacement inputs or None.  Initializers consumed
        by the op are among its inputs."""
        self._pre_hooks.append(fn)
        return Handle(self, False, fn)

    def add_post_hook(self, fn: PostHook) -> Handle:
        """fn(node, outputs) after each op; return replacement outputs or None."""
        self._post_hooks.append(fn)
        return Handle(self, True, fn)

    # ------------------------------------------------------------------ planning
    def _plan(self, outputs: tuple[str, ...], keep: tuple[str, ...] | bool) -> _Plan:
        key = (outputs, keep)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        for name in outputs:
            if name not in self._slot:
                raise DataError(f"requested output '{name}' is no value of graph '{self.graph.name}'")
        wanted = {self._slot[n] for n in outputs}
        keep_slots = set(self._slot.values()) if keep is True else {self._slot[n] for n in keep or ()
                                                                     if n in self._slot}
        needed = wanted | keep_slots
        steps: list[_Step] = []
        for step in reversed(self._steps):
            if needed.intersection(step.out_slots) or keep is True:
                steps.append(step)
                needed.update(s for s in step.in_slots if s >= 0)
                needed.update(s for _, s in step.outer)
        steps.reverse()
        protected = wanted | keep_slots | {self._slot[n] for n in self.initializers} | \
            {self._slot[n] for n in self.folded}
        last_use: dict[int, int] = {}
        for i, step in enumerate(steps):
            for s in (*step.in_slots, *(s for _, s in step.outer)):
                if s >= 0:
                    last_use[s] = i
            for s in step.out_slots:  # outputs nobody reads die right away
                if s >= 0:
                    last_use.setdefault(s, i)
        frees: list[list[int]] = [[] for _ in steps]
        for s, i in last_use.items():
            if s not in protected:
                frees[i].append(s)
        out_slots = [(n, self._slot[n]) for n in outputs]
        if keep is True:
            out_slots += [(n, s) for n, s in self._slot.items() if n not in outputs]
        elif keep:
            out_slots += [(n, self._slot[n]) for n in keep if n in self._slot and n not in outputs]
        input_slots = set(self._input_slots) | {s for _, s in self._outer_slots}
        entries = []
        for step, free in zip(steps, frees):
            fn = INPLACE.get(step.node.op_type) if step.ctx.domain == "" and not step.has_subgraphs else None
            targets = [i for i, s in enumerate(step.in_slots)
                       if s >= 0 and s in free and s not in input_slots and step.in_slots.count(s) == 1]
            entries.append((step, free, fn if targets else None, targets))
        plan = _Plan(entries, out_slots)
        self._plans[key] = plan
        return plan

    # ------------------------------------------------------------------ running
    def _bind(self, inputs: Inputs) -> list[tuple[int, Any]]:
        graph_inputs = self.graph.inputs
        if isinstance(inputs, Mapping):
            unknown = [k for k in inputs if k not in self._slot or
                       (k not in {v.name for v in graph_inputs} and k not in self._overridable)]
            if unknown:
                raise DataError(f"unknown input name(s) {unknown} for graph '{self.graph.name}'; "
                                f"inputs are {[v.name for v in graph_inputs]}")
            missing = [v.name for v in graph_inputs if v.name not in inputs]
            if missing:
                raise DataError(f"missing input(s) {missing} for graph '{self.graph.name}'")
            pairs = [(k, inputs[k]) for k in inputs]
        else:
            items = list(inputs)
            if len(items) != len(graph_inputs):
                raise DataError(f"graph '{self.graph.name}' takes {len(graph_inputs)} input(s) "
                                f"{[v.name for v in graph_inputs]}, got {len(items)}")
            pairs = [(v.name, x) for v, x in zip(graph_inputs, items)]
        bound = []
        by_name = {v.name: v for v in graph_inputs}
        for name, x in pairs:
            t = _to_tensor(x)
            if isinstance(t, torch.Tensor):
                if self.check_inputs and name in by_name:
                    self._check_input(name, t, by_name[name])
                if t.device != self.device:
                    t = t.to(self.device)
                if self.channels_last and t.dim() == 4 and t.is_floating_point():
                    t = t.contiguous(memory_format=torch.channels_last)
            bound.append((self._slot[name], t))
        return bound

    def _check_input(self, name: str, t: torch.Tensor, spec: Any) -> None:
        if spec.dtype is not None and t.dtype != spec.dtype:
            raise DataError(f"input '{name}' of graph '{self.graph.name}' must be {spec.dtype}, got {t.dtype}; "
                            f"cast it (e.g. x.to({spec.dtype}))")
        if spec.shape is not None:
            if t.dim() != len(spec.shape):
                raise DataError(f"input '{name}' of graph '{self.graph.name}' must have rank {len(spec.shape)} "
                                f"(shape {list(spec.shape)}), got shape {list(t.shape)}")
            for i, (want, got) in enumerate(zip(spec.shape, t.shape)):
                if isinstance(want, int) and want > 0 and want != got:
                    raise DataError(f"input '{name}' of graph '{self.graph.name}' must have shape "
                                    f"{list(spec.shape)}, got {list(t.shape)} (dim {i}: {got} != {want})")

    def _call(self, step: _Step, args: list[Any]) -> list[Any]:
        try:
            outs = step.fn(args, step.node.attrs, step.ctx)
        except NetquantError:
            raise
        except Exception as exc:
            shapes = [tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__ for a in args]
            raise DataError(f"{step.node.op_type} node '{step.node.name}' failed on inputs "
                            f"{dict(zip(step.node.inputs, shapes))}: {type(exc).__name__}: {exc}") from exc
        if not isinstance(outs, list | tuple):
            outs = [outs]
        return list(outs)

    def _grad_needed(self, bound: list[tuple[int, Any]]) -> bool:
        if not torch.is_grad_enabled():
            return False
        if self._pre_hooks or self._post_hooks:
            return True
        if any(isinstance(t, torch.Tensor) and t.requires_grad for _, t in bound):
            return True
        return any(isinstance(t, torch.Tensor) and t.requires_grad for t in self.initializers.values())

    def run(self, inputs: Inputs, *, outputs: Sequence[str] | None = None,
            keep: Sequence[str] | bool = False) -> dict[str, Any]:
        """Run the graph; returns the graph outputs (or `outputs`) plus the kept values."""
        bound = self._bind(inputs)
        outs = tuple(outputs) if outputs is not None else tuple(v.name for v in self.graph.outputs)
        keep_key: tuple[str, ...] | bool = keep if isinstance(keep, bool) else tuple(keep)
        plan = self._plan(outs, keep_key)
        grad = self._grad_needed(bound)
        mode = contextlib.nullcontext() if grad else torch.inference_mode()
        with mode:
            result = self._execute(plan, bound, {}, inplace=self.inplace)
        if self.channels_last:
            for name in outs:
                t = result[name]
                if isinstance(t, torch.Tensor) and t.dim() == 4 and not t.is_contiguous():
                    result[name] = t.contiguous()
        return result

    def _execute(self, plan: _Plan, bound: list[tuple[int, Any]], outer: Mapping[str, Any],
                 inplace: bool = False) -> dict[str, Any]:
        env: list[Any] = [None] * len(self._slot)
        for name, t in self.initializers.items():
            env[self._slot[name]] = t
        for name, t in self.folded.items():
            env[self._slot[name]] = t
        for name, slot in self._outer_slots:
            env[slot] = outer[name]
        for slot, t in bound:
            env[slot] = t
        pre, post = self._pre_hooks, self._post_hooks
        recording = torch.is_grad_enabled()  # False under inference_mode / no_grad
        for step, frees, inplace_fn, targets in plan.steps:
            args = [env[s] if s >= 0 else None for s in step.in_slots]
            if pre:
                for hook in pre:
                    new = hook(step.node, list(args))  # a copy: a hook keeping it pins the tensors
                    if new is not None:
                        args = list(new)
                new = None
            if step.has_subgraphs:
                step.ctx.run_subgraph = self._subgraph_runner({n: env[s] for n, s in step.outer})
                results = self._call(step, args)
                step.ctx.run_subgraph = None  # release the outer-scope values
            else:
                result = None
                if inplace and inplace_fn is not None and not (
                        recording and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)):
                    results = value = None  # drop loop variables that may still hold the target
                    for i in targets:
                        target = args[i]
                        if not isinstance(target, torch.Tensor):
                            continue
                        slot = step.in_slots[i]
                        # a pre hook may have replaced the input: remember the original to restore it
                        original = None if env[slot] is target else env[slot]
                        env[slot] = None  # now only args + target may reference the tensor
                        if sys.getrefcount(target) <= _PRIVATE_REFS and storage_is_private(target):
                            result = inplace_fn(args, step.node.attrs, step.ctx.opset, i)
                            if result is not None:
                                break
                        env[slot] = target if original is None else original
                    target = original = None
                if result is not None:
                    results = [result]
                    result = None
                else:
                    results = self._call(step, args)
            if post:
                for hook in post:
                    new = hook(step.node, list(results))
                    if new is not None:
                        results = list(new)
                new = None
            for slot, value in zip(step.out_slots, results):
                if slot >= 0:
                    env[slot] = value
            for s in frees:
                env[s] = None
        return {name: env[slot] for name, slot in plan.out_slots}

    # ------------------------------------------------------------------ subgraphs
    def _subgraph_runner(self, scope: dict[str, Any]) -> Callable[..., list[Any]]:
        def run_subgraph(graph: Graph, inputs: list[Any], extra: Mapping[str, Any] | None = None) -> list[Any]:
            sub = self._sub_executors.get(id(graph))
            if sub is None:
                sub = Executor(graph, self.device, fold_constants=False, check_inputs=False,
                               accumulation=self.accumulation,
                               _outer_names=sorted(graph.free_values()),
                               _hooks=(self._pre_hooks, self._post_hooks))
                self._sub_executors[id(graph)] = sub
            env_outer = dict(scope)
            if extra:
                env_outer.update(extra)
            if len(inputs) > len(graph.inputs):
                raise ModelError(f"subgraph '{graph.name}' takes {len(graph.inputs)} inputs, got {len(inputs)}")
            bound = [(sub._slot[v.name], x) for v, x in zip(graph.inputs, inputs)]
            plan = sub._plan(tuple(v.name for v in graph.outputs), False)
            result = sub._execute(plan, bound, env_outer)
            return [result[v.name] for v in graph.outputs]

        return run_subgraph

