"""Test models at the lowest ONNX IR version their opsets need.

onnx.helper.make_model writes the installed onnx's newest IR version (14 with onnx 1.23), which onnxruntime before
1.31 refuses ("Unsupported model IR version: 14, max supported IR version: 13") although pyproject allows
onnxruntime >= 1.20. The tests' models are written as exporters write theirs: at the IR version their opsets need.
"""

from __future__ import annotations

from typing import Any

import onnx
from onnx import helper


def make_model(graph: onnx.GraphProto, **kwargs: Any) -> onnx.ModelProto:
    """onnx.helper.make_model(graph, **kwargs) with ir_version, unless given, the lowest its opset imports need
    (onnx.helper.find_min_ir_version_for; IR 8 at least: the IR onnx 1.10 writes)."""
    if "ir_version" not in kwargs:
        opsets = list(kwargs.get("opset_imports") or [helper.make_opsetid("", onnx.defs.onnx_opset_version())])
        kwargs["ir_version"] = max(8, helper.find_min_ir_version_for(opsets, ignore_unknown=True))
    return helper.make_model(graph, **kwargs)
