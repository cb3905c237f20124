"""TensorQuantizer: one quantization site (a spec, an observer and its params) as an nn.Module.

Modes:
  PASS_THROUGH  y = x
  CALIBRATE     y = x, and the observer sees x
  QUANTIZE      y = fake_quantize(x, s, z) = (clamp(round(x / s) + z, qmin, qmax) - z) * s

Params come from the observers and range rules of ``netquant.calib`` (``calib.ranges``), the same as
graph PTQ's: static activation ranges are rounded outward to ``range_bits`` significant bits (default
8, as ``QuantSettings.range_bits``; None: the exact range); weights and dynamic activations use the
exact range.

Params live in buffers ``scale`` / ``zero_point`` (parameters when learnable, for LSQ) and a
``calibrated`` flag, so ``state_dict`` round-trips them.  Shapes follow ``QParams``: () per tensor,
(C,) per channel, x.shape with dim ``axis`` -> n_groups per group.
"""

from __future__ import annotations

import contextvars
import enum
from typing import Any

import torch
from torch import nn

from netquant.calib import make_observer
from netquant.calib.distributed import distributed_world
from netquant.calib.ranges import RANGE_MANTISSA_BITS, activation_params, check_range_bits
from netquant.core.ops import GradMode, default_lsq_grad_scale, fake_quantize
from netquant.core.qparams import QParams
from netquant.core.spec import QuantSpec
from netquant.errors import CalibrationError, ConfigError


class QuantMode(enum.Enum):
    """What a quantizer does in forward."""

    PASS_THROUGH = "pass_through"
    CALIBRATE = "calibrate"
    QUANTIZE = "quantize"


class QuantizerRole(enum.Enum):
    """Weights are calibrated from the weight tensor itself; activations from data."""

    WEIGHT = "weight"
    ACTIVATION = "activation"


_EPS = float(torch.finfo(torch.float32).eps)

# Set by netquant.nn.export while tracing: quantizers then emit the ONNX Q/DQ custom op.
EXPORTING: contextvars.ContextVar[bool] = contextvars.ContextVar("netquant_nn_exporting", default=False)


class TensorQuantizer(nn.Module):
    """Quantize one tensor per ``spec`` with params from a calibration ``observer``.

    ``spec=None`` makes a permanent pass-through.  ``learnable=True`` turns scale (and, for affine
    specs with ``learn_zero_point``) into parameters trained with LSQ gradients.  ``dynamic=True``
    recomputes params from every input (per-batch dynamic quantization).
    """

    scale: torch.Tensor
    zero_point: torch.Tensor
    calibrated: torch.Tensor
    range_bits: int | None = RANGE_MANTISSA_BITS  # class default: quantizers pickled before it existed

    def __init__(
        self,
        spec: QuantSpec | None = None,
        *,
        observer: str = "minmax",
        observer_opts: dict[str, Any] | None = None,
        role: QuantizerRole = QuantizerRole.ACTIVATION,
        grad_mode: GradMode = GradMode.STE_CLIP,
        learnable: bool = False,
        learn_zero_point: bool = False,
        dynamic: bool = False,
        range_bits: int | None = RANGE_MANTISSA_BITS,
        name: str = "",
    ) -> None:
        super().__init__()
        if spec is not None and not isinstance(spec, QuantSpec):
            raise ConfigError(f"TensorQuantizer '{name}': spec must be a QuantSpec or None, got {type(spec).__name__}")
        self.spec = spec
        self.observer_name = observer
        self.observer_opts = dict(observer_opts or {})
        self.role = role
        self.grad_mode = grad_mode
        self.dynamic = dynamic
        self.name = name
        self.range_bits = check_range_bits(range_bits, f"TensorQuantizer '{name}'")
        self.mode = QuantMode.QUANTIZE if spec is not None else QuantMode.PASS_THROUGH
        # QAT observer tracking (torch.ao style): in training mode, update params from every batch
        # until `freeze_after` tracked steps have run.
        self.track_in_training = False
        self.freeze_after: int | None = None
        self.register_buffer("scale", torch.ones(()))
        self.register_buffer("zero_point", torch.zeros((), dtype=torch.int32))
        self.register_buffer("calibrated", torch.tensor(False))
        self.register_buffer("tracked_steps", torch.zeros((), dtype=torch.int64))
        self._observer: Any = None
        self._observed_batches = 0
        self._export_plan: Any = None  # set by netquant.nn.export while exporting
        if spec is not None:
            self._check_observer_name(observer)
        if learnable:
            self.make_learnable(learn_zero_point=learn_zero_point)

    # ---- configuration --------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.spec is not None

    @property
    def is_learnable(self) -> bool:
        return isinstance(self.scale, nn.Parameter)

    @property
    def is_calibrated(self) -> bool:
        return bool(self.calibrated.item())

    @property
    def frozen(self) -> bool:
        return self.freeze_after is not None and int(self.tracked_steps.item()) >= self.freeze_after

    def _check_observer_name(self, observer: str) -> None:
        assert self.spec is not None
        try:
            make_observer(observer, self.spec, tensor_name=self.name or "tensor", **self.observer_opts)
        except ConfigError as exc:
            raise ConfigError(f"quantizer '{self.name}': {exc}") from exc

    def make_learnable(self, *, learn_zero_point: bool = False) -> None:
        """Turn scale (and the zero point for affine specs) into nn.Parameters for LSQ."""
        if self.spec is None:
            raise ConfigError(f"quantizer '{self.name}' has no spec; a pass-through cannot learn a scale")
        self.grad_mode = GradMode.LSQ
        if not self.is_learnable:
            scale = self.scale.detach().clone().float()
            del self._buffers["scale"]
            self.scale = nn.Parameter(scale)
        if learn_zero_point and not self.spec.symmetric and not isinstance(self.zero_point, nn.Parameter):
            zp = self.zero_point.detach().clone().float()
            del self._buffers["zero_point"]
            self.zero_point = nn.Parameter(zp)

    # ---- params ------------------------------------------------------------------------------
    @property
    def params(self) -> QParams:
        """Current params as QParams (zero point rounded to int32)."""
        if not self.is_calibrated:
            raise CalibrationError(f"quantizer '{self.name}' has no params yet; calibrate the model first")
        zp = self.zero_point.detach()
        if zp.is_floating_point():
            assert self.spec is not None
            zp = zp.round().clamp(self.spec.qmin, self.spec.qmax)
        return QParams(scale=self.scale.detach().float(), zero_point=zp.to(torch.int32))

    def set_params(self, params: QParams) -> None:
        """Install params (shapes may change: buffers and parameters are resized)."""
        self._assign("scale", params.scale.detach().to(torch.float32))
        self._assign("zero_point", params.zero_point.detach())
        self.calibrated.fill_(True)

    def _assign(self, key: str, value: torch.Tensor) -> None:
        current = getattr(self, key)
        with torch.no_grad():
            current.data = value.to(dtype=current.dtype, device=current.device).clone()

    def _new_observer(self) -> Any:
        assert self.spec is not None
        return make_observer(self.observer_name, self.spec, tensor_name=self.name or "tensor",
                             **self.observer_opts)

    # ---- calibration -------------------------------------------------------------------------
    def start_calibration(self, observer: str | None = None, **observer_opts: Any) -> None:
        """Switch to CALIBRATE with a fresh observer (optionally a different one)."""
        if self.spec is None:
            return
        if observer is not None:
            self.observer_name = observer
            self.observer_opts = dict(observer_opts)
            self._check_observer_name(observer)
        self._observer = self._new_observer()
        self._observed_batches = 0
        self.mode = QuantMode.CALIBRATE

    def observe(self, x: torch.Tensor) -> None:
        """Feed one tensor to the observer (starting one if needed)."""
        if self.spec is None:
            return
        if self._observer is None:
            self._observer = self._new_observer()
            self._observed_batches = 0
        self._observer.observe(x.detach())  # observer errors name the quantizer (tensor_name)
        self._observed_batches += 1

    @property
    def has_observations(self) -> bool:
        return self._observer is not None and self._observed_batches > 0

    def compute_params(self) -> QParams:
        """Params from what the observer saw; CalibrationError when it saw nothing."""
        if not self.has_observations:
            raise CalibrationError(f"quantizer '{self.name}' saw no data during calibration; "
                                   "run at least one batch through the model inside calibrate()")
        if self.role is QuantizerRole.ACTIVATION:  # calib.ranges: the rule graph PTQ applies as well
            params = activation_params(self._observer, self.range_bits)
        else:
            params = self._observer.compute_params()
        self.set_params(params)
        return params

    def finish_calibration(self) -> None:
        """Compute params and switch to QUANTIZE."""
        if self.spec is None:
            return
        self.compute_params()
        self._observer = None
        self.mode = QuantMode.QUANTIZE

    def calibrate_from(self, x: torch.Tensor) -> QParams:
        """Params from this one tensor (weights: calibrated from the weights themselves)."""
        self._observer = self._new_observer()
        self._observed_batches = 0
        self.observe(x)
        params = self.compute_params()
        self._observer = None
        return params

    # ---- forward -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec is None or self.mode is QuantMode.PASS_THROUGH:
            return x
        if EXPORTING.get():
            from netquant.nn._qdq_op import export_qdq

            return export_qdq(self, x)
        if self.mode is QuantMode.CALIBRATE:
            if self.role is QuantizerRole.ACTIVATION:
                self.observe(x)
            return x
        if self.dynamic:
            return self._dynamic_fake_quant(x)
        if self.training and not self.frozen:
            self._training_step(x)
        if self.is_learnable:  # as torch.ao's _LearnableFakeQuantize: keep a learned scale positive
            with torch.no_grad():
                self.scale.clamp_(min=_EPS)
        if not self.is_calibrated:
            raise CalibrationError(f"quantizer '{self.name}' is in QUANTIZE mode but has no params; "
                                   "calibrate the model (netquant.nn.calibrate) before running it")
        return fake_quantize(x, self.scale, self.zero_point, self.spec, grad_mode=self.grad_mode,
                             lsq_grad_scale=self._global_lsq_grad_scale(x))

    def _global_lsq_grad_scale(self, x: torch.Tensor) -> float | None:
        """Under torch.distributed (DDP), an activation's LSQ gradient scale is that of the global batch,
        1 / sqrt(numel(x) * world * qmax), so DDP's average of the ranks' gradients equals one process's on all
        their data (equal shares); None (the default, local numel) otherwise."""
        if not (self.is_learnable and self.training and self.role is QuantizerRole.ACTIVATION):
            return None
        world = distributed_world()
        return default_lsq_grad_scale(x, self.spec) / world ** 0.5 if world > 1 else None

    def _training_step(self, x: torch.Tensor) -> None:
        if self.is_learnable:
            if self.freeze_after is not None:
                self.tracked_steps += 1
                if self.frozen:
                    self.scale.requires_grad_(False)
                    if isinstance(self.zero_point, nn.Parameter):
                        self.zero_point.requires_grad_(False)
        elif self.track_in_training:
            self._track(x)

    def _track(self, x: torch.Tensor) -> None:
        if self.role is QuantizerRole.WEIGHT:
            self.calibrate_from(x)
        else:
            self.observe(x)
            self.compute_params()
        self.tracked_steps += 1

    def _dynamic_fake_quant(self, x: torch.Tensor) -> torch.Tensor:
        assert self.spec is not None
        observer = self._new_observer()
        observer.observe(x.detach())
        params = observer.compute_params()
        return fake_quantize(x, params.scale.to(x.device), params.zero_point.to(x.device), self.spec,
                             grad_mode=self.grad_mode)

    # ---- state_dict: params may have any shape ----------------------------------------------
    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any],
                              strict: bool, missing_keys: list[str], unexpected_keys: list[str],
                              error_msgs: list[str]) -> None:
        for key in ("scale", "zero_point"):
            incoming = state_dict.get(prefix + key)
            if isinstance(incoming, torch.Tensor):
                current = getattr(self, key)
                current.data = current.data.new_empty(incoming.shape)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        if self.spec is None:
            return "pass_through"
        parts = [self.spec.describe(), f"mode={self.mode.value}", f"observer={self.observer_name}"]
        if self.is_learnable:
            parts.append("learnable")
        if self.dynamic:
            parts.append("dynamic")
        parts.append("calibrated" if self.is_calibrated else "uncalibrated")
        return ", ".join(parts)
