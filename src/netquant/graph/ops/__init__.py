"""Torch implementations of ONNX ops; importing this package registers them all.

Modules: elementwise (unary/binary math, comparisons, logic), activation (activations, softmax family,
Clip), shape (reshape/indexing/scatter/pad/layout), reduce (ReduceX, ArgMax/Min), math (MatMul, Gemm,
Einsum, TopK, CumSum, windows, DFT/STFT, random), conv (Conv, ConvTranspose, ConvInteger, DeformConv),
pool (Max/Average/Lp/Global pooling, MaxUnpool, RoiAlign), norm (Batch/Instance/Layer/Group/RMS norms, LRN),
rnn (RNN, GRU, LSTM), resize (Resize, Upsample), cast (Cast, CastLike, BitCast incl. float8 / sub-byte),
quant (Q/DQ, QLinear*, integer matmul/conv, com.microsoft quantized ops), misc (Constant, Dropout,
Attention family, losses, GridSample, NMS, sequences, optimisers), contrib (com.microsoft fused float ops),
ml (ai.onnx.ml TreeEnsemble & co., TfIdfVectorizer), control (If / Loop / Scan).
String ops are out of scope (torch has no string dtype).
"""

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
