"""ncnn's int8 calibration table (what tools/quantize/ncnn2table writes and ncnn2int8 reads).

One line per int8 layer `<layer>_param_0 <weight scale>...` (per output channel; per group for
ConvolutionDepthWise), then one line per int8 layer `<layer> <bottom blob scale>`. Scales are ncnn's multipliers
127 / amax = 1 / (netquant's scale), written as the shortest text that reads back to the same float32.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from netquant.export.ncnn.int8 import Int8Layer


def _f32(value: float | np.floating) -> str:
    return str(np.float32(value))


def table_text(layers: Sequence[Int8Layer]) -> str:
    lines = [f"{la.layer}_param_0 " + " ".join(_f32(s) for s in la.weight_scales) for la in layers]
    lines += [f"{la.layer} {_f32(la.bottom_scale)}" for la in layers]
    return "\n".join(lines) + "\n"


def parse_table(text: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(weight scales by layer, bottom blob scales by layer) as ncnn2int8 reads them (float32)."""
    weights: dict[str, np.ndarray] = {}
    blobs: dict[str, np.ndarray] = {}
    for line in text.splitlines():
        parts = line.split()
        if not parts:
            continue
        values = np.array([float(v) for v in parts[1:]], dtype=np.float32)
        if "_param_" in parts[0]:
            weights[parts[0].rsplit("_param_", 1)[0]] = values
        else:
            blobs[parts[0]] = values
    return weights, blobs
