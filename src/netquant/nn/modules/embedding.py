"""QuantEmbedding: rows of a weight-quantized table (per row, axis 0); indices are not quantized."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from netquant.nn.modules.base import QuantModule
from netquant.nn.rules import LayerQuantConfig


class QuantEmbedding(nn.Embedding, QuantModule):
    """Drop-in nn.Embedding whose table goes through a weight quantizer (and optional output one)."""

    float_type = nn.Embedding
    has_input = False

    def __init__(self, *args: Any, quant_config: LayerQuantConfig | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.init_quantizers(quant_config)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        y = F.embedding(input, self.weight_quantizer(self.weight), self.padding_idx, self.max_norm,
                        self.norm_type, self.scale_grad_by_freq, self.sparse)
        return self.output_quantizer(y)
