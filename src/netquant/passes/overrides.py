"""User overrides: force ops to FP32 or change their specs, selected by name, op type or pattern."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from netquant.core.selectors import NamePattern, PatternKind, has_glob_chars
from netquant.core.spec import QuantSpec
from netquant.errors import ConfigError
from netquant.graph import Graph, Node


@dataclass(frozen=True)
class OpSelector:
    """Selects ops by exact node name, op type, or a name pattern.

    Names use netquant's one pattern language (netquant.core.selectors, shared with the module API's
    QuantRule): `pattern` is a glob (`*`, `?`, `[..]`, fnmatch; 'a.*' also matches 'a') or a regex
    written `re:<regex>` (re.search).  Strings parse as: 'name:<n>', 'type:<T>', 're:<regex>',
    'glob:<g>'; a bare string is an op type if one exists in the graph, else a node name, else a glob
    if it has wildcards, else an op type if it looks like one (`Conv`), else a node name.
    """

    name: str | None = None
    op_type: str | None = None
    pattern: str | None = None

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.name, self.op_type, self.pattern)) != 1:
            raise ConfigError("an OpSelector takes exactly one of name=, op_type=, pattern=")
        self.name_pattern()  # ConfigError for a bad regex, at construction

    def name_pattern(self) -> NamePattern | None:
        """The NamePattern this selector matches node names with (None for an op-type selector)."""
        if self.name is not None:
            return NamePattern(PatternKind.EXACT, self.name)
        if self.pattern is not None:
            return NamePattern.parse(self.pattern)
        return None

    @classmethod
    def parse(cls, text: str | OpSelector, graph: Graph | None = None) -> OpSelector:
        if isinstance(text, OpSelector):
            return text
        if not isinstance(text, str) or not text:
            raise ConfigError(f"op selector must be a non-empty string or an OpSelector, got {text!r}")
        if text.startswith("type:"):
            return cls(op_type=text[len("type:"):])
        if text.startswith("name:"):
            return cls(name=text[len("name:"):])
        if text.startswith("glob:"):
            return cls(pattern=text[len("glob:"):])
        if text.startswith("re:"):
            return cls(pattern=text)
        if graph is not None:
            if any(n.op_type == text for n in graph.nodes):
                return cls(op_type=text)
            if any(n.name == text for n in graph.nodes):
                return cls(name=text)
        if has_glob_chars(text):
            return cls(pattern=text)
        if text[:1].isupper() and text.isalnum():
            return cls(op_type=text)
        return cls(name=text)

    def matches(self, node: Node) -> bool:
        if self.op_type is not None:
            return node.op_type == self.op_type
        pattern = self.name_pattern()
        assert pattern is not None
        return pattern.matches(node.name)

    def describe(self) -> str:
        if self.name is not None:
            return f"name '{self.name}'"
        if self.op_type is not None:
            return f"op type '{self.op_type}'"
        return f"pattern '{self.pattern}'"


@dataclass(frozen=True)
class Override:
    """Changes for the ops `select` matches.

    fp32: leave the op in float.  activation / weight: replace the spec of its activation
    inputs and outputs / its weight (a per-channel weight spec gets the op's channel axis).
    observer: activation observer name for its tensors.
    """

    select: OpSelector
    fp32: bool = False
    activation: QuantSpec | None = None
    weight: QuantSpec | None = None
    observer: str | None = None

    @classmethod
    def force_fp32(cls, selector: str | OpSelector, graph: Graph | None = None) -> Override:
        return cls(OpSelector.parse(selector, graph), fp32=True)


def resolve_overrides(graph: Graph, force_fp32: Iterable[str | OpSelector] = (),
                      overrides: Sequence[Override] = ()) -> list[Override]:
    """Overrides in application order; ConfigError for a selector that matches no op."""
    out = [Override.force_fp32(s, graph) for s in force_fp32]
    for o in overrides:
        if not isinstance(o, Override):
            raise ConfigError(f"overrides must be netquant.passes.Override objects, got {type(o).__name__}")
        out.append(o)
    for o in out:
        if not any(o.select.matches(n) for n in graph.nodes):
            if o.select.op_type is not None:
                types = sorted({n.op_type for n in graph.nodes})
                present = f"op types present: {', '.join(types)}"
            else:
                names = [n.name for n in graph.nodes]
                present = f"node names present: {', '.join(names[:20])}" + (
                    f", ... ({len(names)} in all)" if len(names) > 20 else "")
            raise ConfigError(f"override selector {o.select.describe()} matches no op in graph "
                              f"'{graph.name}'; {present}")
    return out


def matching(overrides: Sequence[Override], node: Node) -> list[Override]:
    return [o for o in overrides if o.select.matches(node)]
