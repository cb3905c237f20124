"""Shared plumbing of the quantized modules: creating quantizers from a LayerQuantConfig."""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from netquant.core.spec import Granularity, QuantSpec
from netquant.nn.quantizer import QuantizerRole, TensorQuantizer
from netquant.nn.rules import LayerQuantConfig, QuantizerConfig


def make_quantizer(cfg: QuantizerConfig | None, role: QuantizerRole, name: str = "",
                   spec_override: QuantSpec | None = None) -> TensorQuantizer:
    """A TensorQuantizer for ``cfg`` (pass-through when ``cfg`` is None)."""
    if cfg is None:
        return TensorQuantizer(None, role=role, name=name)
    return TensorQuantizer(spec_override or cfg.spec, observer=cfg.observer, observer_opts=cfg.observer_opts,
                           role=role, grad_mode=cfg.grad_mode, learnable=cfg.learnable, dynamic=cfg.dynamic,
                           range_bits=cfg.range_bits, name=name)


def retarget_weight_spec(spec: QuantSpec, out_axis: int, in_axis: int, shape: tuple[int, ...]) -> QuantSpec:
    """Per-channel specs follow the layer's output-channel axis, per-group specs its input axis.

    A per-group spec whose group size does not divide the input axis falls back to per-channel.
    """
    if spec.granularity is Granularity.PER_CHANNEL:
        return spec.with_(axis=out_axis)
    if spec.granularity is Granularity.PER_GROUP:
        axis = in_axis if len(shape) > 1 else 0
        if spec.group_size and shape[axis] % spec.group_size == 0:
            return spec.with_(axis=axis)
        return spec.with_(granularity=Granularity.PER_CHANNEL, axis=out_axis, group_size=None)
    return spec


class QuantModule:
    """Mixin for quantized modules: ``input_quantizer``, ``output_quantizer`` and weight quantizers."""

    float_type: ClassVar[type[nn.Module]]
    weight_out_axis: ClassVar[int] = 0
    weight_in_axis: ClassVar[int] = 1
    has_weight: ClassVar[bool] = True
    has_input: ClassVar[bool] = True

    def init_quantizers(self, layer: LayerQuantConfig | None) -> None:
        layer = layer or LayerQuantConfig()
        module: nn.Module = self  # type: ignore[assignment]
        module.input_quantizer = make_quantizer(layer.input if self.has_input else None,
                                                QuantizerRole.ACTIVATION)
        module.output_quantizer = make_quantizer(layer.output, QuantizerRole.ACTIVATION)
        if self.has_weight:
            self._init_weight_quantizers(layer.weight)

    def _init_weight_quantizers(self, cfg: QuantizerConfig | None) -> None:
        module: nn.Module = self  # type: ignore[assignment]
        weight = module.weight  # type: ignore[attr-defined]
        spec = None if cfg is None else retarget_weight_spec(cfg.spec, self.weight_out_axis, self.weight_in_axis,
                                                              tuple(weight.shape))
        module.weight_quantizer = make_quantizer(cfg, QuantizerRole.WEIGHT, spec_override=spec)

    def weight_tensors(self) -> list[tuple[TensorQuantizer, nn.Parameter]]:
        """(weight quantizer, weight) pairs, for calibrating weights from themselves."""
        if not self.has_weight:
            return []
        return [(self.weight_quantizer, self.weight)]  # type: ignore[attr-defined]

    def calibrate_weights(self) -> None:
        """Params of every enabled weight quantizer from its weight (per channel / group)."""
        for quantizer, weight in self.weight_tensors():
            if quantizer.enabled and not quantizer.dynamic:
                quantizer.calibrate_from(weight.detach())

    @classmethod
    def from_float(cls, module: nn.Module, layer: LayerQuantConfig | None) -> nn.Module:
        """Turn ``module`` (exactly of ``float_type``) into this class in place, sharing its tensors."""
        if type(module) is not cls.float_type:
            raise TypeError(f"{cls.__name__}.from_float expects {cls.float_type.__name__}, "
                            f"got {type(module).__name__}")
        module.__class__ = cls
        quant: QuantModule = module  # type: ignore[assignment]
        quant.init_quantizers(layer)
        return module
