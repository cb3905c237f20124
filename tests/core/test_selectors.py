"""core.selectors: one name-pattern language for graph op selectors (OpSelector) and module rules (QuantRule)."""

from __future__ import annotations

import pytest
from onnx import TensorProto, helper
from torch import nn

from netquant.core.selectors import NamePattern, PatternKind
from netquant.errors import ConfigError
from netquant.graph import load_onnx
from netquant.nn import QuantRule
from netquant.passes import OpSelector
from tests.helpers.ir import make_model

NAMES = ["head", "head.fc", "body.0", "body.1", "body.10", "neck", "neckline"]


def _graph():
    """A chain of Relu nodes carrying NAMES as node names."""
    nodes, prev = [], "x"
    for i, name in enumerate(NAMES):
        nodes.append(helper.make_node("Relu", [prev], [f"t{i}"], name=name))
        prev = f"t{i}"
    g = helper.make_graph(nodes, "names", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                          [helper.make_tensor_value_info(prev, TensorProto.FLOAT, [1, 4])])
    return load_onnx(make_model(g, opset_imports=[helper.make_opsetid("", 13)]))


def _modules() -> dict[str, nn.Module]:
    """Modules named like NAMES (qualified names of a model)."""
    model = nn.Module()
    model.head = nn.Sequential()
    model.head.fc = nn.Linear(2, 2)
    model.body = nn.Sequential(*[nn.ReLU() for _ in range(11)])
    model.neck = nn.ReLU()
    model.neckline = nn.ReLU()
    named = dict(model.named_modules())
    return {n: named[n] for n in NAMES}


# (pattern, names it selects), hand-checked against the rules in core/selectors.py
CASES = [
    ("head.*", {"head", "head.fc"}),  # a scope and all inside it
    ("body.?", {"body.0", "body.1"}),
    ("body.*", {"body.0", "body.1", "body.10"}),
    ("glob:neck*", {"neck", "neckline"}),
    ("name:neck", {"neck"}),
    ("re:^body\\.1", {"body.1", "body.10"}),  # re.search, anchored only where written
    ("re:fc$", {"head.fc"}),
    ("re:e", {"head", "head.fc", "neck", "neckline"}),
    ("*", set(NAMES)),
]


@pytest.mark.parametrize("pattern,expected", CASES, ids=[c[0] for c in CASES])
def test_same_pattern_selects_the_same_names_in_both_apis(pattern, expected):
    graph = _graph()
    selector = OpSelector.parse(pattern, graph)
    on_graph = {n.name for n in graph.nodes if selector.matches(n)}
    rule = QuantRule(pattern=pattern)
    on_modules = {n for n, m in _modules().items() if rule.matches(n, m)}
    assert on_graph == on_modules == expected


def test_types_stay_native_to_each_side():
    graph = _graph()
    assert {n.name for n in graph.nodes if OpSelector.parse("type:Relu", graph).matches(n)} == set(NAMES)
    modules = _modules()
    rule = QuantRule(pattern="head.*", types=(nn.Linear,))
    assert {n for n, m in modules.items() if rule.matches(n, m)} == {"head.fc"}


def test_parse_and_bad_patterns():
    assert NamePattern.parse("re:^a") == NamePattern(PatternKind.REGEX, "^a")
    assert NamePattern.parse("a.b") == NamePattern(PatternKind.GLOB, "a.b") and not NamePattern.parse("a.b").is_wildcard
    assert str(NamePattern.parse("name:x")) == "name:x"
    with pytest.raises(ConfigError, match="invalid regex"):
        QuantRule(pattern="re:(")
    with pytest.raises(ConfigError, match="invalid regex"):
        OpSelector(pattern="re:[")
