"""Every calibrated tensor's (scale, zero point) of a quantized model, keyed by (op, 'in' / 'out', index): what tests
compare bit for bit between two calibration paths."""

from __future__ import annotations

from typing import Any

import torch

Params = dict[tuple[str, str, int], tuple[torch.Tensor, torch.Tensor]]


def tensor_params(qm: Any) -> Params:
    """(scale, zero point) of every op input / output config of `qm` that has params (copies)."""
    out: Params = {}
    for oc in qm.qgraph.op_configs.values():
        for kind, cfgs in (("in", oc.inputs), ("out", oc.outputs)):
            for i, c in enumerate(cfgs):
                if c is not None and c.params is not None:
                    out[(oc.op.name, kind, i)] = (c.params.scale.clone(), c.params.zero_point.clone())
    return out
