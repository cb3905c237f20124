"""Python's cyclic garbage collector around netquant's own work."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def long_lived_frozen() -> Iterator[None]:
    """gc.freeze() for the block, gc.unfreeze() after: the objects alive at its start (the model, torch's and onnx's
    modules) leave the cyclic collector's traversals, which otherwise walk them at every full collection (shufflenet
    on a 2-core AMD EPYC: 139 collections, 0.11 s of a 1.7 s quantization; 0.02 s frozen). Garbage made inside the
    block is collected as usual. A caller's own freeze, or a disabled collector, is left as it is."""
    if gc.get_freeze_count() or not gc.isenabled():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
