"""Torch implementations of ONNX ops; importing this package registers them all.

Modules: elementwise (unary/binary math, comparisons, logic), activation (activations, softmax family,
Clip), shape (reshape/indexing/scatter/pad/layout, Constant), reduce (ReduceX, ArgMax/Min, TopK, CumSum),
linalg (MatMul, Gemm, Einsum, Det), spectral (windows, DFT/STFT, MelWeightMatrix), stochastic (Dropout,
random ops), conv (Conv, ConvTranspose, ConvInteger, DeformConv), pool (Max/Average/Lp/Global pooling,
MaxUnpool, RoiAlign), norm (Batch/Instance/Layer/Group/RMS norms, LRN), rnn (RNN, GRU, LSTM), attention
(Attention family, RotaryEmbedding, SwiGLU, LinearAttention), resize (Resize, Upsample), cast (Cast, CastLike,
BitCast incl. float8 / sub-byte), quant (Q/DQ, QLinear*, integer matmul/conv, com.microsoft quantized ops),
vision (GridSample, AffineGrid, NonMaxSuppression, ImageDecoder), sequence (sequences and optionals),
losses, training (optimisers), contrib (com.microsoft fused float ops), ml (ai.onnx.ml TreeEnsemble & co.,
TfIdfVectorizer), control (If / Loop / Scan).
String ops are out of scope (torch has no string dtype).
"""

from . import (  # noqa: F401
    activation,
    attention,
    cast,
    contrib,
    contrib_attention,
    control,
    conv,
    elementwise,
    linalg,
    losses,
    ml,
    norm,
    pool,
    quant,
    reduce,
    resize,
    rnn,
    sequence,
    shape,
    spectral,
    stochastic,
    training,
    vision,
)
from .registry import OpContext, lookup_op, register_op, supported_op_types

__all__ = ["OpContext", "lookup_op", "register_op", "supported_op_types"]
