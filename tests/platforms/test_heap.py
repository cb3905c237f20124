"""platforms.heap: the collector's freeze around netquant's work is undone after, and a caller's own is kept."""

from __future__ import annotations

import gc

import numpy as np

from netquant.api import quantize_onnx
from netquant.platforms.heap import long_lived_frozen
from tests.helpers.onnx_models import calib_batches, conv_relu_gemm


def test_freeze_is_undone_and_garbage_inside_is_collected() -> None:
    assert gc.get_freeze_count() == 0
    with long_lived_frozen():
        assert gc.get_freeze_count() > 0
        cycle: list = []
        cycle.append(cycle)
        del cycle
        assert gc.collect() >= 1  # made inside the block: collected as usual
    assert gc.get_freeze_count() == 0
    quantize_onnx(conv_relu_gemm(), calib_batches((1, 3, 8, 8), n=2), objective=None, quiet=True)
    assert gc.get_freeze_count() == 0


def test_a_callers_freeze_and_a_disabled_collector_are_left_alone() -> None:
    keep = np.zeros(3)  # noqa: F841 - something alive to freeze
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with long_lived_frozen():
            pass
        # neither unfrozen (0) nor frozen again (more); a frozen object that dies meanwhile (another thread's, left
        # by an earlier test in this process) leaves the count: seen 2 fewer of 834419 in a full run
        assert frozen - 1000 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()
    gc.disable()
    try:
        with long_lived_frozen():
            assert gc.get_freeze_count() == 0
    finally:
        gc.enable()
