"""Torch implementations of ONNX ops; importing this package registers them all."""
