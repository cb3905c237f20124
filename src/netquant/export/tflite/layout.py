"""NCHW (ONNX) <-> NHWC (TFLite) layout of 4-D activations.

A 4-D tensor stored channels-last holds onnx_tensor.transpose(TO_NHWC); ONNX axis a lives at stored axis
NHWC_AXIS[a]. Tensors of other ranks are stored as ONNX has them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

TO_NHWC = (0, 2, 3, 1)  # stored = onnx.transpose(TO_NHWC)
TO_NCHW = (0, 3, 1, 2)  # onnx = stored.transpose(TO_NCHW)
NHWC_AXIS = (0, 3, 1, 2)  # onnx axis -> stored axis


def stored_shape(shape: Sequence[int], channels_last: bool) -> tuple[int, ...]:
    """The shape a tensor of ONNX `shape` has in the file."""
    return tuple(shape[p] for p in TO_NHWC) if channels_last else tuple(shape)


def stored_axis(axis: int, rank: int, channels_last: bool) -> int:
    """The stored axis of ONNX `axis` (negative allowed)."""
    a = axis % rank
    return NHWC_AXIS[a] if channels_last else a


def to_stored(x: np.ndarray, channels_last: bool) -> np.ndarray:
    return np.ascontiguousarray(x.transpose(TO_NHWC)) if channels_last else x


def compose(perm: Sequence[int], in_cl: bool, out_cl: bool) -> list[int]:
    """The TRANSPOSE perm on stored tensors that computes ONNX Transpose(perm) from a stored input
    (channels-last or not) to a stored output (channels-last or not)."""
    # onnx_in axis for each onnx_out axis: perm; stored_in axis of onnx_in axis a: NHWC_AXIS[a] if in_cl
    out_axes = [perm[p] for p in TO_NHWC] if out_cl else list(perm)
    return [NHWC_AXIS[a] if in_cl else a for a in out_axes]


def broadcast_rank(shape: Sequence[int], rank: int) -> tuple[int, ...]:
    """numpy broadcasting: leading 1s up to `rank`."""
    return (1,) * (rank - len(shape)) + tuple(shape)
