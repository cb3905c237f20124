"""TensorQuantConfig states, dominated_by chains and the export check."""

from __future__ import annotations

import pytest
import torch

from netquant import QuantState, TensorQuantConfig
from netquant.core import choose_qparams
from netquant.core.spec import QuantSpec
from netquant.core.tensor_config import check_deployable
from netquant.errors import ConfigError, ExportError

SPEC = QuantSpec.int8()


def _params(amax: float):
    return choose_qparams(-amax, amax, SPEC)


def test_states_and_defaults() -> None:
    assert [s.name for s in QuantState] == [
        "INITIAL", "PASSIVE_INIT", "ACTIVATED", "PASSIVE", "OVERLAPPED", "BAKED", "FP32", "SOI"]
    config = TensorQuantConfig(SPEC, name="conv1.weight")
    assert config.state is QuantState.INITIAL and config.observer == "minmax" and config.params is None
    assert not config.is_active and config.effective_params is None and config.root is config
    active = {s for s in QuantState if TensorQuantConfig(SPEC, state=s).is_active}
    assert active == {QuantState.ACTIVATED, QuantState.PASSIVE, QuantState.OVERLAPPED, QuantState.BAKED}
    assert {s for s in QuantState if s.is_pending} == {QuantState.INITIAL, QuantState.PASSIVE_INIT}
    # configs compare by identity: two equal-looking configs are different tensors
    assert TensorQuantConfig(SPEC) != TensorQuantConfig(SPEC)


def test_effective_params_follow_the_dominated_by_chain() -> None:
    root = TensorQuantConfig(SPEC, state=QuantState.ACTIVATED, params=_params(2.0), name="concat_out")
    mid = TensorQuantConfig(SPEC, name="concat_in0")
    leaf = TensorQuantConfig(SPEC, params=_params(9.0), name="concat_in1")  # own params are shadowed
    mid.overlap_with(root)
    leaf.overlap_with(mid)
    assert mid.state is leaf.state is QuantState.OVERLAPPED
    assert leaf.root is root and leaf.effective_params is root.params
    assert float(leaf.effective_params.scale) == pytest.approx(2.0 / 127.5)
    root.params = _params(4.0)  # recalibrating the root moves the whole group
    assert torch.equal(leaf.effective_params.scale, _params(4.0).scale)


def test_cycles_are_refused() -> None:
    a = TensorQuantConfig(SPEC, name="a")
    b = TensorQuantConfig(SPEC, name="b")
    b.overlap_with(a)
    with pytest.raises(ConfigError, match="cycle"):
        a.overlap_with(b)
    with pytest.raises(ConfigError, match="cycle"):
        a.overlap_with(a)
    assert a.dominated_by is None and a.state is QuantState.INITIAL  # nothing changed
    a.dominated_by = b  # set by hand, the cycle shows up on use, naming the chain
    with pytest.raises(ConfigError, match="'a' -> 'b' -> 'a'"):
        _ = a.effective_params
    with pytest.raises(ConfigError, match="TensorQuantConfig"):
        a.overlap_with("b")  # type: ignore[arg-type]


def test_bad_fields_raise_config_error() -> None:
    with pytest.raises(ConfigError, match="QuantSpec"):
        TensorQuantConfig("int8")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="QuantState"):
        TensorQuantConfig(SPEC, state="activated")  # type: ignore[arg-type]


def test_check_deployable_names_every_pending_config() -> None:
    ready = TensorQuantConfig(SPEC, state=QuantState.ACTIVATED, params=_params(1.0), name="x")
    shared = TensorQuantConfig(SPEC, name="y")
    shared.overlap_with(ready)
    float_ones = [TensorQuantConfig(SPEC, state=QuantState.FP32, name="f"),
                  TensorQuantConfig(SPEC, state=QuantState.SOI, name="shape")]
    check_deployable([ready, shared, *float_ones])  # fine
    check_deployable([])
    pending = [TensorQuantConfig(SPEC, name="conv1.input"),
               TensorQuantConfig(SPEC, state=QuantState.PASSIVE_INIT, name="conv1.bias")]
    with pytest.raises(ExportError) as info:
        check_deployable([ready, *pending, *float_ones])
    message = str(info.value)
    assert "'conv1.input' is INITIAL" in message and "'conv1.bias' is PASSIVE_INIT" in message
    assert "2 tensor quantization config(s)" in message and "'x'" not in message


def test_check_deployable_refuses_active_configs_without_params_and_cycles() -> None:
    orphan = TensorQuantConfig(SPEC, state=QuantState.ACTIVATED, name="relu_out")
    empty_root = TensorQuantConfig(SPEC, state=QuantState.FP32, name="root")
    follower = TensorQuantConfig(SPEC, name="follower")
    follower.overlap_with(empty_root)
    a = TensorQuantConfig(SPEC, state=QuantState.OVERLAPPED, name="a")
    b = TensorQuantConfig(SPEC, state=QuantState.OVERLAPPED, name="b", dominated_by=a)
    a.dominated_by = b
    unnamed = TensorQuantConfig(SPEC)
    with pytest.raises(ExportError) as info:
        check_deployable([orphan, follower, a, unnamed])
    message = str(info.value)
    assert "'relu_out' is ACTIVATED but has no params" in message
    assert "'follower' is OVERLAPPED but has no params (its dominator 'root' has none)" in message
    assert "cycle" in message and "<unnamed config at" in message


def test_repr() -> None:
    root = TensorQuantConfig(SPEC, state=QuantState.ACTIVATED, params=_params(1.0), name="x")
    leaf = TensorQuantConfig(QuantSpec.uint8_affine(), observer="percentile", name="y")
    leaf.overlap_with(root)
    assert repr(leaf) == ("TensorQuantConfig('y', OVERLAPPED, uint8, affine, per_tensor, ROUND_HALF_EVEN, "
                          "observer='percentile', params=None, dominated_by='x')")
