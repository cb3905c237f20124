"""Helpers shared by several test packages (small ONNX models, export decoders, the op harness).

Helpers used by one package and by a benchmark stay beside that package's tests, because
benchmarks/ loads them by path: tests/calib/trt_reference.py, tests/fuzz/fuzzgen.py, tests/nn/digits.py.
"""
