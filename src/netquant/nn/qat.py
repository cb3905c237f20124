"""Quantization-aware training helpers: BatchNorm folding, STE / LSQ preparation, observer freezing.

Folding Conv + BN (eval statistics):  W' = W * g / sqrt(v + eps)  (per output channel),
                                      b' = (b - m) * g / sqrt(v + eps) + beta.
LSQ (Esser et al. 2020): scale (and zero point) become parameters; fake_quantize(grad_mode=LSQ)
gives them gradients scaled by 1 / sqrt(numel * qmax).  STE: params track the data (weights: from
the current weights, activations: from their observer) in training mode until ``freeze_after``
tracked steps, then stay fixed.
"""

from __future__ import annotations

import copy

import torch
from torch import fx, nn

from netquant.core.ops import GradMode
from netquant.errors import CalibrationError, ConfigError
from netquant.nn.convert import name_quantizers, quantizers
from netquant.nn.modules.conv_bn import CONV_BN_TYPES
from netquant.nn.quantizer import QuantizerRole

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_BNS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def _fold_into(conv: nn.Module, bn: nn.Module) -> None:
    """Fold ``bn``'s eval statistics into ``conv`` (Conv*d or Linear) in place."""
    assert isinstance(bn, _BNS)
    if bn.running_mean is None or bn.running_var is None:
        raise ConfigError(f"fold_batchnorm: {bn} tracks no running statistics; cannot fold it")
    weight: torch.Tensor = conv.weight  # type: ignore[assignment]
    if bn.num_features != weight.shape[0]:
        raise ConfigError(f"fold_batchnorm: {bn} has {bn.num_features} features but the layer before it "
                          f"has {weight.shape[0]} output channels")
    with torch.no_grad():
        gamma = bn.weight if bn.weight is not None else torch.ones_like(bn.running_var)
        beta = bn.bias if bn.bias is not None else torch.zeros_like(bn.running_var)
        factor = gamma / torch.sqrt(bn.running_var + bn.eps)
        bias = conv.bias if conv.bias is not None else torch.zeros_like(bn.running_mean)
        new_weight = weight * factor.reshape(-1, *([1] * (weight.dim() - 1)))
        new_bias = (bias - bn.running_mean) * factor + beta
        conv.weight.copy_(new_weight)
        if conv.bias is None:
            conv.bias = nn.Parameter(new_bias.to(weight.dtype))
        else:
            conv.bias.copy_(new_bias)


def _conv_bn_pairs_fx(model: nn.Module) -> list[tuple[str, str]]:
    graph = fx.symbolic_trace(model).graph
    modules = dict(model.named_modules())
    pairs = []
    for node in graph.nodes:
        if node.op != "call_module" or not isinstance(modules.get(node.target), _BNS):
            continue
        src = node.args[0]
        if (isinstance(src, fx.Node) and src.op == "call_module" and len(src.users) == 1
                and isinstance(modules.get(src.target), _CONVS + (nn.Linear,))):
            pairs.append((str(src.target), str(node.target)))
    return pairs


def _conv_bn_pairs_sequential(model: nn.Module) -> list[tuple[str, str]]:
    pairs = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Sequential):
            continue
        children = list(module.named_children())
        for (a_name, a), (b_name, b) in zip(children, children[1:]):
            if isinstance(a, _CONVS + (nn.Linear,)) and isinstance(b, _BNS):
                prefix = f"{name}." if name else ""
                pairs.append((prefix + a_name, prefix + b_name))
    return pairs


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def _conv_bn_pairs(model: nn.Module) -> list[tuple[str, str]]:
    """(conv, bn) submodule names where the BN directly follows the conv: torch.fx tracing, or
    adjacency inside nn.Sequential when the model cannot be traced."""
    try:
        return _conv_bn_pairs_fx(model)
    except Exception:  # untraceable control flow: fall back to Sequential adjacency
        return _conv_bn_pairs_sequential(model)


def fold_batchnorm(model: nn.Module, *, inplace: bool = False) -> nn.Module:
    """Fold every BatchNorm that directly follows a Conv*d / Linear (found by torch.fx tracing, or
    by adjacency inside nn.Sequential when the model cannot be traced); the BN becomes Identity.
    Do this before quantize_model / QAT.  Uses the BN's running statistics (eval behaviour)."""
    if not inplace:
        model = copy.deepcopy(model)
    pairs = _conv_bn_pairs(model)
    for conv_name, bn_name in pairs:
        _fold_into(model.get_submodule(conv_name), model.get_submodule(bn_name))
        _set_submodule(model, bn_name, nn.Identity())
    return model


def fuse_conv_bn(model: nn.Module, *, inplace: bool = False) -> nn.Module:
    """Pair every Conv*d directly followed by its BatchNorm into ConvBn*d (BN becomes Identity), so that
    quantize_model makes QuantConvBn*d: QAT with BN statistics, BN folded into the quantized weight."""
    if not inplace:
        model = copy.deepcopy(model)
    pairs = _conv_bn_pairs(model)
    for conv_name, bn_name in pairs:
        conv, bn = model.get_submodule(conv_name), model.get_submodule(bn_name)
        if type(conv) not in CONV_BN_TYPES:
            continue
        pair = CONV_BN_TYPES[type(conv)](conv, bn)
        _set_submodule(model, bn_name, nn.Identity())
        _set_submodule(model, conv_name, pair)
    return model


def prepare_qat(model: nn.Module, *, grad_mode: GradMode = GradMode.LSQ, freeze_after: int | None = None,
                learn_zero_point: bool = False) -> nn.Module:
    """Prepare a quantized (and calibrated) model for QAT in place and return it.

    LSQ: every enabled quantizer's scale becomes a learnable parameter initialised from its
    calibrated params (build the optimizer after this call).  STE / STE_CLIP: params keep tracking
    the data in training mode until ``freeze_after`` training steps (None: never frozen).
    """
    name_quantizers(model)
    active = [(n, q) for n, q in quantizers(model) if not q.dynamic]
    if not active:
        raise ConfigError("prepare_qat: the model has no enabled quantizer; run quantize_model first")
    if grad_mode is GradMode.LSQ:
        missing = [n for n, q in active if not q.is_calibrated]
        if missing:
            raise CalibrationError(f"prepare_qat(LSQ) needs calibrated params to start from; uncalibrated: "
                                   f"{', '.join(missing)}; run `with calibrate(model): ...` first")
        for _, quantizer in active:
            quantizer.make_learnable(learn_zero_point=learn_zero_point)
            quantizer.freeze_after = freeze_after
    else:
        for _, quantizer in active:
            quantizer.grad_mode = grad_mode
            quantizer.track_in_training = True
            quantizer.freeze_after = freeze_after
            quantizer.tracked_steps.zero_()
            if quantizer.role is QuantizerRole.ACTIVATION:
                quantizer._observer = None
    return model


def freeze_observers(model: nn.Module) -> None:
    """Stop params from tracking data (STE) and from learning (LSQ)."""
    for _, quantizer in quantizers(model):
        quantizer.track_in_training = False
        if quantizer.is_learnable:
            quantizer.scale.requires_grad_(False)
            if isinstance(quantizer.zero_point, nn.Parameter):
                quantizer.zero_point.requires_grad_(False)
