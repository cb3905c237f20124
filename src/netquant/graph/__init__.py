"""netquant.graph: ONNX models as an editable IR, and a torch executor for them.

    graph = load_onnx("model.onnx")          # Graph of Nodes / Values, initializers as torch tensors
    out = Executor(graph).run({"x": x})      # {output name: tensor}; hooks, intermediates, autograd
    save_onnx(graph, "edited.onnx")          # lossless, onnx.checker-validated, atomic
"""

from netquant.graph.executor import Executor, Handle
from netquant.graph.ir import Graph, ModelInfo, Node, Value
from netquant.graph.load import load_onnx
from netquant.graph.save import save_onnx, to_onnx


def supported_ops(domain: str = "") -> list[str]:
    """Op types the executor implements for a domain ('' = ai.onnx)."""
    # importing netquant.graph.ops (the package of .registry) registers every op
    from netquant.graph.ops.registry import supported_op_types

    return supported_op_types(domain)


__all__ = ["Executor", "Graph", "Handle", "ModelInfo", "Node", "Value", "load_onnx", "save_onnx",
           "supported_ops", "to_onnx"]
