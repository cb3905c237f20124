"""ONNX's own backend node test cases (onnx.backend.test.case.node.collect_testcases) through
netquant.graph.backend: every op type we implement passes all of its cases.

Skipped, by documented reason only (netquant.graph.backend_cases.SKIP_REASONS): cases needing string
tensors (torch has no string dtype) and cases whose reference output was drawn from numpy's random
generator (Bernoulli, training-mode Dropout).  Cases using op types we do not implement are not claimed.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh

from netquant.graph import supported_ops
from netquant.graph.backend import NetquantBackend, run_node_testcase
from netquant.graph.backend_cases import SKIP_REASONS, STRING_REASON, Status, run_all_cases
from tests.helpers.ir import make_model


@pytest.fixture(scope="module")
def results():
    return run_all_cases()


def test_case_count_and_coverage(results) -> None:
    assert len(results) >= 1800
    claimed_ops = {r.op_type for r in results if r.status is not Status.SKIPPED}
    assert len(claimed_ops) >= 150
    passed = sum(r.status is Status.PASSED for r in results)
    assert passed >= 1600


def test_every_supported_op_type_passes_all_its_cases(results) -> None:
    failures = [f"{r.name} [{r.op_type}]: {r.message[:200]}" for r in results if r.status is Status.FAILED]
    assert not failures, f"{len(failures)} claimed case(s) fail:\n" + "\n".join(failures)


def test_skips_are_only_for_documented_reasons(results) -> None:
    allowed = set(SKIP_REASONS.values()) | {STRING_REASON}
    for r in results:
        if r.status is Status.SKIPPED:
            assert r.message in allowed or r.message.startswith("op type(s) not implemented"), r


def test_issue_listed_ops_are_supported() -> None:
    ops = set(supported_ops())
    wanted = {"Conv", "ConvTranspose", "Gemm", "MatMul", "BatchNormalization", "LayerNormalization", "MaxPool",
              "AveragePool", "GlobalAveragePool", "Resize", "Relu", "Sigmoid", "Softmax", "Erf", "Gelu", "LSTM",
              "GRU", "Reshape", "Transpose", "Slice", "Gather", "Concat", "Split", "Squeeze", "Unsqueeze", "Expand",
              "Shape", "ConstantOfShape", "Range", "Where", "ReduceMean", "ReduceSum", "QuantizeLinear",
              "DequantizeLinear", "QLinearConv", "QLinearMatMul", "If", "Loop", "Scan"}
    assert wanted <= ops, sorted(wanted - ops)
    assert len(ops) >= 150


def test_backend_api_run_node_and_run_model() -> None:
    assert NetquantBackend.supports_device("CPU")
    node = oh.make_node("Add", ["a", "b"], ["c"])
    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(3, np.float32)
    (c,) = NetquantBackend.run_node(node, [a, b])
    np.testing.assert_array_equal(c, a + b)
    graph = oh.make_graph([node], "g", [oh.make_tensor_value_info("a", TP.FLOAT, [2, 3]),
                                        oh.make_tensor_value_info("b", TP.FLOAT, [3])],
                          [oh.make_tensor_value_info("c", TP.FLOAT, [2, 3])])
    model = make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    rep = NetquantBackend.prepare(model, "CPU")
    np.testing.assert_array_equal(rep.run([a, b])[0], a + b)
    np.testing.assert_array_equal(NetquantBackend.run_model(model, {"a": a, "b": b})[0], a + b)


def test_run_node_testcase_reports_failures() -> None:
    """A wrong reference is reported as a failure with a message, not raised."""
    from onnx.backend.test.case.node import collect_testcases

    case = next(c for c in collect_testcases() if c.name == "test_relu")
    ok, msg = run_node_testcase(case)
    assert ok and msg == "ok"
    inputs, outputs = case.data_sets[0]
    broken = type(case)(**{**case.__dict__, "data_sets": [(inputs, [outputs[0] + 1])]})
    ok, msg = run_node_testcase(broken)
    assert not ok and "AssertionError" in msg


def test_onnx_backend_test_runner_accepts_the_backend() -> None:
    """The backend plugs into onnx.backend.test.BackendTest (the unittest generator ONNX ships)."""
    import onnx.backend.test

    suite = onnx.backend.test.BackendTest(NetquantBackend, __name__)
    suite.include(r"^test_(relu|conv_with_strides_padding|gemm_default_scalar_bias)_cpu$")
    cases = suite.test_cases
    assert "OnnxBackendNodeModelTest" in cases
    import unittest

    result = unittest.TextTestRunner(verbosity=0, stream=open("/dev/null", "w")).run(  # noqa: SIM115
        unittest.defaultTestLoader.loadTestsFromTestCase(cases["OnnxBackendNodeModelTest"]))
    assert result.testsRun - len(result.skipped) == 3 and result.wasSuccessful(), result.failures + result.errors
    assert onnx.defs.onnx_opset_version() >= 7
