"""quantize_model: swap supported modules for their quantized counterparts by ordered rules."""

from __future__ import annotations

import copy
from collections.abc import Iterator

from torch import nn

from netquant.errors import ConfigError, ModelError
from netquant.nn.modules import FLOAT_TO_QUANT, FUNCTIONAL_SITES, QuantModule
from netquant.nn.quantizer import TensorQuantizer
from netquant.nn.rules import ModelQuantConfig, dynamic_config


def quantize_model(model: nn.Module, config: ModelQuantConfig | None = None, *,
                   inplace: bool = False) -> nn.Module:
    """Replace every supported module whose first matching rule gives a LayerQuantConfig.

    Supported: Linear, Conv1d/2d/3d, ConvTranspose1d/2d/3d, AvgPool1d/2d/3d, AdaptiveAvgPool1d/2d/3d,
    LSTM, Embedding, and the functional sites QuantAdd / QuantMatmul / QuantCat already in the model.
    Weight quantizers are calibrated from the weights at once; activation quantizers need
    ``calibrate``.  ``config`` defaults to ``ModelQuantConfig.int8_tensorrt()``.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"quantize_model expects a torch.nn.Module, got {type(model).__name__}")
    meta = next((n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta), None)
    if meta is not None:
        raise ModelError(f"quantize_model: {type(model).__name__} has tensor '{meta}' on the 'meta' device (a shape "
                         "without values, e.g. built under torch.device('meta')), so its weights cannot be calibrated; "
                         "load them first, e.g. model.to_empty(device='cpu') then model.load_state_dict(...)")
    config = config or ModelQuantConfig.int8_tensorrt()
    if not isinstance(config, ModelQuantConfig):
        raise ConfigError(f"quantize_model: config must be a ModelQuantConfig, got {type(config).__name__}")
    if not inplace:
        model = copy.deepcopy(model)
    supported = [(name, mod) for name, mod in model.named_modules()
                 if type(mod) in FLOAT_TO_QUANT or isinstance(mod, FUNCTIONAL_SITES)]
    if not supported and any(isinstance(m, QuantModule) for m in model.modules()):
        raise ConfigError(f"quantize_model: {type(model).__name__} is already quantized (it holds netquant "
                          "quantized modules); quantize the float model instead")
    if not supported:
        kinds = sorted({t.__name__ for t in FLOAT_TO_QUANT} | {t.__name__ for t in FUNCTIONAL_SITES})
        raise ConfigError(f"quantize_model: {type(model).__name__} has no supported module to quantize; "
                          f"supported types are {', '.join(kinds)}")
    replaced = 0
    converted: list[str] = []
    for name, module in supported:
        if any(name.startswith(prefix + ".") for prefix in converted):
            continue  # inside a module already converted (e.g. the conv of a ConvBn2d)
        layer = config.resolve(name, module)
        if layer is None:
            continue
        converted.append(name)
        if isinstance(module, FUNCTIONAL_SITES):
            module.init_quantizers(layer)
        else:
            FLOAT_TO_QUANT[type(module)].from_float(module, layer)
        replaced += 1
    if replaced == 0:
        raise ConfigError(f"quantize_model: the rules of config '{config.name}' keep all {len(supported)} "
                          f"supported modules of {type(model).__name__} in float; nothing was quantized")
    name_quantizers(model)
    for module in quant_modules(model):
        module.calibrate_weights()
    return model


def quantize_dynamic(model: nn.Module, config: ModelQuantConfig | None = None, *,
                     inplace: bool = False) -> nn.Module:
    """Dynamic quantization of Linear and LSTM: int8 weights, activations quantized per batch."""
    return quantize_model(model, config or dynamic_config(), inplace=inplace)


def name_quantizers(model: nn.Module) -> None:
    """Give every quantizer its qualified name (for error messages)."""
    for name, module in model.named_modules():
        if isinstance(module, TensorQuantizer):
            module.name = name


def quantizers(model: nn.Module, *, enabled_only: bool = True) -> Iterator[tuple[str, TensorQuantizer]]:
    """(qualified name, quantizer) for every TensorQuantizer in ``model``."""
    for name, module in model.named_modules():
        if isinstance(module, TensorQuantizer) and (module.enabled or not enabled_only):
            yield name, module


def quant_modules(model: nn.Module) -> Iterator[QuantModule]:
    for module in model.modules():
        if isinstance(module, QuantModule):
            yield module


def set_quant_mode(model: nn.Module, mode: str) -> None:
    """'quantize' or 'pass_through' for every enabled quantizer (e.g. to compare with FP32)."""
    from netquant.nn.quantizer import QuantMode

    try:
        target = QuantMode(mode)
    except ValueError as exc:
        raise ConfigError(f"set_quant_mode: mode must be 'quantize' or 'pass_through', got {mode!r}") from exc
    if target is QuantMode.CALIBRATE:
        raise ConfigError("set_quant_mode: use `with netquant.nn.calibrate(model):` to calibrate")
    for _, quantizer in quantizers(model):
        quantizer.mode = target
