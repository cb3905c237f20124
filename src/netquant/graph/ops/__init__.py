"""Torch implementations of ONNX ops; importing this package registers them all."""

from . import (  # noqa: F401
    activation,
    cast,
    contrib,
    control,
    conv,
    elementwise,
    math,
    misc,
    ml,
    norm,
    pool,
    quant,
    reduce,
    resize,
    rnn,
    shape,
)
from .registry import OpContext, lookup_op, register_op, supported_op_types

__all__ = ["OpContext", "lookup_op", "register_op", "supported_op_types"]
