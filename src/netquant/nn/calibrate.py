"""The calibration workflow.

    with calibrate(model, observer="percentile"):
        for batch in batches:
            model(batch)

Inside, every enabled activation quantizer observes what flows through it and returns it
unchanged (the model computes in FP32, in eval mode; its training flag is restored on exit).  On exit, weight quantizers take params from the weights
themselves (per channel / group) and activation quantizers from their observers; quantizers that
saw no data raise a CalibrationError naming them.  On an exception the previous state is restored.

This is the flow of graph PTQ (netquant.passes.calibration) on modules: the same observers
(netquant.calib registry, same names and options) and the same range rules (netquant.calib.ranges:
activation ranges rounded outward to each quantizer's ``range_bits``, default 8 as
QuantSettings.range_bits; weights exact; zero ranges s = eps; NaN/Inf a DataError naming the
quantizer), so a module and its ONNX export calibrated on the same data get the same scales.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from netquant.errors import CalibrationError, ConfigError
from netquant.nn.convert import name_quantizers, quant_modules, quantizers
from netquant.nn.quantizer import QuantizerRole, QuantMode


@contextmanager
def calibrate(model: nn.Module, observer: str | None = None, *, distributed: bool = False,
              **observer_opts: Any) -> Iterator[nn.Module]:
    """Calibrate every activation quantizer of ``model`` with ``observer`` (default: each one's own).
    distributed=True (a torch.distributed group initialised, e.g. under torchrun / DDP): each rank feeds its own
    share of the data; on exit the observers of all ranks are merged exactly (calib.distributed: order-invariant
    observers only) and every rank gets the same params, those one process would get on all the data."""
    name_quantizers(model)
    active = [(n, q) for n, q in quantizers(model) if not q.dynamic]
    if not active:
        raise ConfigError(f"calibrate: {type(model).__name__} has no enabled quantizer; "
                          "run netquant.nn.quantize_model on it first")
    saved = {n: (q.mode, q.observer_name, dict(q.observer_opts)) for n, q in active}
    for _, quantizer in active:
        if quantizer.role is QuantizerRole.ACTIVATION:
            quantizer.start_calibration(observer, **observer_opts)
        else:
            quantizer.mode = QuantMode.CALIBRATE
    was_training = model.training
    model.eval()  # inference behaviour while observing: no BN statistic updates, no dropout
    try:
        with torch.no_grad():
            yield model
    except BaseException:
        for name, quantizer in active:
            quantizer.mode, quantizer.observer_name, quantizer.observer_opts = saved[name]
            quantizer._observer = None
        raise
    finally:
        model.train(was_training)
    finish_calibration(model, distributed=distributed)


def _merge_ranks(calibrating: list[tuple[str, Any]]) -> None:
    """Every rank's activation observers merged (calib.distributed); observed counts summed."""
    import torch.distributed as dist

    from netquant.calib.distributed import check_mergeable, merge_across_ranks

    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("calibrate(distributed=True) needs an initialised torch.distributed process group "
                          "(torchrun, or torch.distributed.init_process_group before calibrating)")
    check_mergeable([q._observer for _, q in calibrating])
    merged = merge_across_ranks([q._observer if q.has_observations else None for _, q in calibrating])
    counts = torch.tensor([q._observed_batches if q.has_observations else 0 for _, q in calibrating],
                          dtype=torch.int64)
    dist.all_reduce(counts)
    for (_, quantizer), obs, n in zip(calibrating, merged, counts.tolist()):
        if obs is not None:
            quantizer._observer, quantizer._observed_batches = obs, int(n)


def finish_calibration(model: nn.Module, *, distributed: bool = False) -> None:
    """Compute params for every quantizer in CALIBRATE mode (weights from the weights); distributed: activation
    observers merged across the torch.distributed ranks first."""
    with torch.no_grad():
        for module in quant_modules(model):
            for quantizer, _ in module.weight_tensors():
                if quantizer.mode is QuantMode.CALIBRATE:
                    quantizer.mode = QuantMode.QUANTIZE
            module.calibrate_weights()
        calibrating = [(n, q) for n, q in quantizers(model) if q.mode is QuantMode.CALIBRATE]
        if distributed:
            _merge_ranks(calibrating)
        empty = [n for n, q in calibrating if not q.has_observations]
        if empty:
            for _, quantizer in calibrating:
                quantizer.mode = QuantMode.QUANTIZE
                quantizer._observer = None
            shown = ", ".join(empty[:10]) + (f" and {len(empty) - 10} more" if len(empty) > 10 else "")
            raise CalibrationError(f"calibration saw no data for {len(empty)} quantizer(s): {shown}; "
                                   "run batches through the model inside `with calibrate(model):` and make "
                                   "sure these modules are reached by forward()")
        for _, quantizer in calibrating:
            quantizer.finish_calibration()
