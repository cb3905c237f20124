"""Block reconstruction (passes.reconstruction) and learned scales (passes.learned_scales): blocks cut where one
value crosses, block output error below nearest rounding / the calibrated scales on held-out data for a fixed seed,
weights at most one step from nearest rounding's floor, pair limits kept, the chain deterministic to the byte,
recorded in the quant-params JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import netquant
from netquant.core.int_kernels import count_overflow_pairs
from netquant.passes.learned_scales import LearnedScalePass, LearnedScaleSettings
from netquant.passes.reconstruction import (
    BlockReconstructionPass,
    ReconstructionSettings,
    find_blocks,
    model_error,
)
from netquant.platforms import get_platform
from tests.helpers.repair_models import cnn_inputs, cnn_model
from tests.passes.test_adaround import _codes, pair_model


def w4(act_bits: int = 8):
    """academic_int8 with 4-bit per-channel weights (and act_bits activations)."""
    a8 = get_platform("academic_int8")
    return a8.with_(name=f"w4a{act_bits}", weight=a8.weight.with_(bits=4),
                    activation=a8.activation.with_(bits=act_bits))


CALIB = [cnn_inputs(16, s) for s in range(6)]
HELD = [{"x": torch.from_numpy(cnn_inputs(32, 99))}]


def test_blocks_cut_where_one_value_crosses():
    q = netquant.quantize_onnx(cnn_model(), CALIB[:2], "academic_int8", objective=None, quiet=True)
    blocks = find_blocks(q.qgraph, layers=2)
    layers = [b.layers for b in blocks]
    assert [op for b in layers for op in b] == ["conv1", "dw", "pw", "skip", "pw2", "fc1", "fc2"]
    assert all(1 <= len(b) <= 2 for b in layers)
    order = [n.name for n in q.qgraph.graph.nodes]
    for b in blocks:  # a block reads what was computed before it (or graph inputs), never what comes after
        first = order.index(b.nodes[0].name)
        for v in b.inputs:
            p = q.qgraph.graph.producer(v)
            assert p is None or order.index(p.name) < first
    # one block per weight layer where the layer limit is 1; the residual join stays whole with its two convs
    assert [len(b.layers) for b in find_blocks(q.qgraph, layers=1)] == [1] * 7


def test_reconstruction_lowers_block_error_and_moves_weights_one_step_at_most():
    rec = BlockReconstructionPass(ReconstructionSettings(iterations=120, layers=2, seed=1, guard=False))
    q = netquant.quantize_onnx(cnn_model(), CALIB, w4(), passes=[rec], objective=None, quiet=True)
    plain = netquant.quantize_onnx(cnn_model(), CALIB, w4(), objective=None, quiet=True)
    kept = [r for r in rec.results if r.kept]
    assert kept and all(r.error_learned < r.error_nearest for r in kept)
    assert sum(r.error_learned for r in rec.results if r.kept) < 0.95 * sum(r.error_nearest for r in kept)
    assert model_error(q.qgraph, HELD) < model_error(plain.qgraph, HELD)
    for r in kept:
        for op in r.ops:
            learned, nearest, floor = _codes(q.qgraph, op)
            step = learned - floor
            assert bool(((step == 0) | (step == 1)).all())
    assert sum(r.flipped for r in kept) > 0


def test_reconstruction_keeps_the_pair_limit_and_is_deterministic(tmp_path):
    calib = [np.random.default_rng(s).uniform(0, 2, (32, 64)).astype(np.float32) for s in range(4)]
    for i in range(2):
        rec = BlockReconstructionPass(ReconstructionSettings(iterations=60, guard=False))
        q = netquant.quantize_onnx(pair_model(), calib, "onnxruntime_int8", passes=[rec], objective=None,
                                   quiet=True, target="any")
        limit = q.qgraph.op_configs["fc"].weight_config().effective_pair_limit
        assert limit is not None and rec.results
        assert "w" in q.qgraph.rounded_weights and rec.results[0].flipped > 0
        learned, _, floor = _codes(q.qgraph, "fc")
        assert count_overflow_pairs(learned.to(torch.int32), limit.layout) == 0
        assert count_overflow_pairs((floor + 1).clamp(-128, 127).to(torch.int32), limit.layout) > 0
        q.export(tmp_path / f"m{i}.onnx")
    assert (tmp_path / "m0.onnx").read_bytes() == (tmp_path / "m1.onnx").read_bytes()


def test_learned_scales_lower_the_block_error_and_rederive_biases():
    lsq = LearnedScalePass(LearnedScaleSettings(iterations=100, layers=2, guard=False))
    q = netquant.quantize_onnx(cnn_model(), CALIB, w4(4), passes=[lsq], objective=None, quiet=True)
    plain = netquant.quantize_onnx(cnn_model(), CALIB, w4(4), objective=None, quiet=True)
    kept = [r for r in lsq.results if r.kept]
    assert kept and all(r.error_learned < r.error_before for r in kept)
    assert sum(r.activations for r in kept) > 0 and sum(r.weights for r in kept) > 0
    assert model_error(q.qgraph, HELD) < 0.8 * model_error(plain.qgraph, HELD)  # W4A4: 0.30 -> 0.14 measured
    for oc in q.qgraph.op_configs.values():  # int32 bias scale = s_in * s_w at the learned scales
        b = oc.bias_config()
        if b is not None and b.params is not None and b.state.emits:
            s_in = oc.inputs[0].effective_params.scale.reshape(())
            s_w = oc.weight_config().effective_params.scale
            assert torch.allclose(b.params.scale, (s_in * s_w).float(), rtol=1e-6)


def test_the_chain_is_deterministic_and_recorded(tmp_path):
    def chain():
        return [LearnedScalePass(LearnedScaleSettings(iterations=30, layers=2)),
                BlockReconstructionPass(ReconstructionSettings(iterations=30, layers=2))]

    for i in range(2):
        q = netquant.quantize_onnx(cnn_model(), CALIB[:4], w4(4), passes=chain(), objective=None, quiet=True,
                                   min_cosine=-1)  # W4A4 on a random-weight model: low cosine, same bytes
        q.export(tmp_path / f"m{i}.onnx")
        q.export(tmp_path / f"p{i}.json", format="json")
    assert (tmp_path / "m0.onnx").read_bytes() == (tmp_path / "m1.onnx").read_bytes()
    repairs = json.loads((tmp_path / "p0.json").read_text())["repairs"]
    names = [r["repair"] for r in repairs]
    assert names[0] == "learned scales" and "reconstruction" in names
    assert names.index("reconstruction") > max(i for i, n in enumerate(names) if n == "learned scales")
    assert json.loads((tmp_path / "p1.json").read_text())["repairs"] == repairs


def test_learned_weight_scales_keep_the_pair_limit():
    """Learned scales re-round weights at their new scale through the config's pair limit (x86 without VNNI)."""
    from netquant.passes.quant_graph import constant_codes

    calib = [np.random.default_rng(s).uniform(0, 2, (32, 64)).astype(np.float32) for s in range(4)]
    lsq = LearnedScalePass(LearnedScaleSettings(iterations=60, guard=False))
    q = netquant.quantize_onnx(pair_model(), calib, "onnxruntime_int8", passes=[lsq], objective=None, quiet=True,
                               target="any")
    plain = netquant.quantize_onnx(pair_model(), calib, "onnxruntime_int8", objective=None, quiet=True, target="any")
    cfg = q.qgraph.op_configs["fc"].weight_config()
    assert lsq.results and lsq.results[0].weights == 1
    changed = not torch.equal(cfg.effective_params.scale,
                              plain.qgraph.op_configs["fc"].weight_config().effective_params.scale)
    assert changed == lsq.results[0].kept  # a block that is not kept leaves its scales as calibrated
    codes = constant_codes(q.qgraph.graph.initializers["w"], cfg).to(torch.int32)
    assert count_overflow_pairs(codes, cfg.effective_pair_limit.layout) == 0


def test_settings_refusals_say_what_to_set():
    from netquant.errors import ConfigError
    from netquant.passes.learned_scales import LearnedScaleSettings
    from netquant.passes.reconstruction import ReconstructionSettings

    with pytest.raises(ConfigError, match="reconstruction iterations, samples, max_batches and layers must be >= 1"):
        ReconstructionSettings(iterations=0)
    with pytest.raises(ConfigError, match=r"reconstruction warmup is a share of the iterations in \[0, 1\), got 1.5"):
        ReconstructionSettings(warmup=1.5)
    with pytest.raises(ConfigError, match="learned-scale iterations, samples, max_batches and layers must be >= 1"):
        LearnedScaleSettings(layers=0)
    with pytest.raises(ConfigError, match="learns nothing: set activations and / or weights"):
        LearnedScaleSettings(activations=False, weights=False)
