"""QuantLSTM: nn.LSTM whose input sequence and weight matrices are quantized.

Each weight_ih_l{k}[_reverse] / weight_hh_l{k}[_reverse] (and weight_hr for projections) has its
own quantizer (per gate row, axis 0); biases stay float.  The recurrence itself runs in float
on the quantized weights, as in dynamic int8 LSTM kernels.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.utils.rnn import PackedSequence

from netquant.nn.modules.base import QuantModule, make_quantizer, retarget_weight_spec
from netquant.nn.quantizer import QuantizerRole, TensorQuantizer
from netquant.nn.rules import LayerQuantConfig, QuantizerConfig


class QuantLSTM(nn.LSTM, QuantModule):
    """Drop-in nn.LSTM with an input quantizer and one weight quantizer per weight matrix."""

    float_type = nn.LSTM

    def __init__(self, *args: Any, quant_config: LayerQuantConfig | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.init_quantizers(quant_config)

    def _weight_names(self) -> list[str]:
        return [n for n in self._flat_weights_names if n.startswith("weight")]

    def _init_weight_quantizers(self, cfg: QuantizerConfig | None) -> None:
        quantizers = {}
        for name in self._weight_names():
            weight = getattr(self, name)
            spec = None if cfg is None else retarget_weight_spec(cfg.spec, 0, 1, tuple(weight.shape))
            quantizers[name] = make_quantizer(cfg, QuantizerRole.WEIGHT, spec_override=spec)
        self.weight_quantizers = nn.ModuleDict(quantizers)

    def weight_tensors(self) -> list[tuple[TensorQuantizer, nn.Parameter]]:
        return [(q, getattr(self, n)) for n, q in self.weight_quantizers.items()]  # type: ignore[misc]

    def _update_flat_weights(self) -> None:
        if "weight_quantizers" not in self._modules:  # during nn.LSTM.__init__
            super()._update_flat_weights()
            return
        flat = []
        for name in self._flat_weights_names:
            tensor = getattr(self, name) if hasattr(self, name) else None
            if tensor is not None and name in self.weight_quantizers:
                tensor = self.weight_quantizers[name](tensor)
            flat.append(tensor)
        self._flat_weights = flat

    def forward(self, input: Any, hx: Any = None) -> Any:
        if isinstance(input, PackedSequence):
            data = self.input_quantizer(input.data)
            input = PackedSequence(data, input.batch_sizes, input.sorted_indices, input.unsorted_indices)
        else:
            input = self.input_quantizer(input)
        try:
            return super().forward(input, hx)
        finally:
            # Leave float weights behind so flatten_parameters / state handling see the real ones.
            self._flat_weights = [getattr(self, n) if hasattr(self, n) else None for n in self._flat_weights_names]


__all__ = ["QuantLSTM"]
