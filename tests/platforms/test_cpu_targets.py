"""CPU targets: weight schemes per target, the static saturation check at export, validation with this
machine's int8 arithmetic, and the doctor command."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from click.testing import CliRunner
from onnx import numpy_helper

import netquant
from netquant.cli.main import cli
from netquant.core.int_kernels import PAIR_LIMIT, Accumulation, count_overflow_pairs
from netquant.errors import ConfigError, ExportError
from netquant.passes.int_emulation import kernel_sites
from netquant.platforms import get_platform
from netquant.platforms.targets import CpuTarget, WeightScheme, host_accumulation
from tests.helpers.export_models import conv_net, images
from tests.helpers.exports import json_record, read_params_json


def _quantize(**kw):
    return netquant.quantize_onnx(conv_net(channels=16), {"x": images(16)}, quiet=True, **kw)


def test_default_target_is_any_with_saturation_free_weights() -> None:
    qm = _quantize()
    assert qm.platform.cpu_target is CpuTarget.ANY
    assert qm.platform.weight_scheme is WeightScheme.INT8_PAIR_LIMITED  # measured: results/weight_schemes.md
    sites = kernel_sites(qm.qgraph)
    assert sites and all(s.overflow_pairs == 0 for s in sites)
    assert max(int(s.weight_codes.abs().max()) for s in sites) > 64  # 8-bit codes


def test_int7_scheme_keeps_codes_within_64() -> None:
    qm = _quantize(weight_scheme="int7")
    sites = kernel_sites(qm.qgraph)
    assert sites and all(s.overflow_pairs == 0 for s in sites)
    assert max(int(s.weight_codes.abs().max()) for s in sites) == 64


def test_pair_limited_scheme_keeps_8_bit_codes_without_overflow() -> None:
    qm = _quantize(weight_scheme="int8-pairs")
    sites = kernel_sites(qm.qgraph)
    assert sites and all(s.overflow_pairs == 0 for s in sites)
    assert max(int(s.weight_codes.abs().max()) for s in sites) > 64


@pytest.mark.parametrize(("target", "scheme", "lo", "hi"), [
    ("x86-vnni", None, -128, 127), ("arm64", None, -128, 127), ("any", "int7", -64, 64), ("x86-no-vnni", "int7", -64, 64),
])
def test_weight_spec_per_target(target: str, scheme: str | None, lo: int, hi: int) -> None:
    p = get_platform("onnxruntime_int8").for_cpu(target, scheme)
    assert (p.weight.qmin, p.weight.qmax) == (lo, hi)
    assert p.cpu_target is CpuTarget.parse(target)


def test_uint8_scheme_and_errors() -> None:
    p = get_platform("onnxruntime_int8").for_cpu("any", "uint8")
    assert (p.weight.qmin, p.weight.qmax, p.weight.signed) == (0, 255, False)
    with pytest.raises(ConfigError, match="unknown CPU target 'pentium'"):
        get_platform("onnxruntime_int8").for_cpu("pentium")
    with pytest.raises(ConfigError, match="takes no CPU target"):
        get_platform("tensorrt_int8").for_cpu("x86-vnni")
    with pytest.raises(ConfigError, match="needs the engine's weight packing order"):
        get_platform("openvino_int8").with_(knows_weight_packing=False).for_cpu("any", "int8-pairs")


def test_full_range_weights_for_target_any_are_refused_naming_op_and_fix(tmp_path) -> None:
    qm = _quantize(weight_scheme="int8")  # full int8 on target 'any': overflow-prone pairs
    assert any(s.overflow_pairs for s in kernel_sites(qm.qgraph))
    with pytest.raises(ExportError, match=r"targets CPU 'any'.*Conv 'conv\d'.*weight_scheme='int8-pairs'"):
        qm.export(tmp_path / "m.onnx")
    assert list(tmp_path.iterdir()) == []


def test_vnni_target_file_validates_here_with_this_machines_arithmetic(tmp_path) -> None:
    """A full-range file for VNNI CPUs: ORT here equals the executor emulating this machine's kernels."""
    qm = _quantize(target="x86-vnni")
    report = qm.export(tmp_path / "m.onnx")
    assert report.validated and report.accumulation is host_accumulation() and report.validation_batches == 1
    x = images(8, seed=7)
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"x": x})[0]
    here = qm.run({"x": torch.from_numpy(x)}, accumulation=host_accumulation())["y"].numpy()
    np.testing.assert_allclose(got, here, rtol=0, atol=1e-5)
    exact = qm.run({"x": torch.from_numpy(x)})["y"].numpy()
    pairwise = qm.run({"x": torch.from_numpy(x)}, accumulation=Accumulation.PAIRWISE_INT16)["y"].numpy()
    assert np.abs(exact - pairwise).max() > 1e-3  # these weights do saturate on x86 without VNNI


def test_pair_limited_file_is_identical_under_both_arithmetics(tmp_path) -> None:
    qm = _quantize(weight_scheme="int8-pairs")
    x = torch.from_numpy(images(8, seed=3))
    exact = qm.run({"x": x})["y"]
    pairwise = qm.run({"x": x}, accumulation=Accumulation.PAIRWISE_INT16)["y"]
    assert torch.equal(exact, pairwise)
    for site in kernel_sites(qm.qgraph):
        assert count_overflow_pairs(site.weight_codes, site_layout(site), PAIR_LIMIT) == 0


def site_layout(site):
    from netquant.core.int_kernels import WeightLayout

    return WeightLayout(site.kind)


def test_cli_target_and_scheme_reach_the_weights(tmp_path) -> None:
    model = tmp_path / "m.onnx"
    onnx.save(conv_net(channels=16), str(model))
    weights = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(model)).graph.initializer}
    runner = CliRunner()
    for scheme, bound in (("int7", 64), ("int8-pairs", 128)):
        out = tmp_path / f"q_{scheme}.onnx"
        res = runner.invoke(cli, ["quantize", str(model), "--calib", "random", "-o", str(out), "--quiet",
                                  "--weight-scheme", scheme, "--json", str(tmp_path / f"{scheme}.json")])
        assert res.exit_code == 0, res.output
        w = _int8_initializers(out)
        biggest = max(int(np.abs(a.astype(np.int32)).max()) for a in w)
        assert (biggest == 64) if bound == 64 else (64 < biggest <= 128)
        params = read_params_json(tmp_path / f"{scheme}.json")
        for node, tensor in (("conv1", "w1"), ("conv2", "w2"), ("fc", "wg")):
            rec = json_record(params, node, "input:1")
            assert (rec["tensor"], rec["state"], rec["granularity"], rec["axis"]) == (tensor, "ACTIVATED",
                                                                                       "per_channel", 0)
            assert (rec["quant_min"], rec["quant_max"]) == ((-64, 64) if scheme == "int7" else (-128, 127))
            if scheme == "int7":  # symmetric min/max: per output channel max |w| / 64
                amax = np.abs(weights[tensor].reshape(len(weights[tensor]), -1)).max(axis=1)
                if node == "conv1":  # BatchNormalization folded into conv1: w * gamma / sqrt(var + 1e-5)
                    amax = amax * np.abs(weights["bn_scale"]) / np.sqrt(weights["bn_var"].astype(np.float64) + 1e-5)
                assert rec["scale"] == pytest.approx((amax / 64).tolist(), rel=1e-6)
    res = runner.invoke(cli, ["quantize", str(model), "--calib", "random", "-o", str(tmp_path / "x.onnx"),
                              "--target", "pentium"])
    assert res.exit_code != 0 and "unknown CPU target 'pentium'" in res.output


def _int8_initializers(path):
    import onnx
    from onnx import numpy_helper

    return [numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer
            if t.data_type == onnx.TensorProto.INT8 and len(t.dims) == 4]


def test_doctor_prints_cpu_and_the_probed_family() -> None:
    res = CliRunner().invoke(cli, ["doctor"])
    assert res.exit_code == 0, res.output
    assert host_accumulation().value in res.output and "onnxruntime" in res.output


def test_saturation_report_matches_the_emulation_of_a_full_range_file() -> None:
    """For a full-range int8 model the report's 'full int8' figures are the model's own: they equal what the
    emulating executor counts; the default (7-bit) model has no overflow pair but the same full-int8 figures."""
    from netquant.passes.int_emulation import SaturationEmulator

    x = images(16)
    full = _quantize(target="x86-vnni")
    rows = {r.op: r for r in full.saturation_report({"x": x})}
    emu = SaturationEmulator.for_graph(full.qgraph)
    ex = full.qgraph.executor(fake_quant=True)
    ex.add_pre_hook(lambda node, inputs: emu.capture(node, inputs))
    ex.add_post_hook(lambda node, outputs: emu.adjust(node, outputs))
    with torch.no_grad():
        ex.run({"x": torch.from_numpy(x)})
    assert emu.sites and any(s.saturated_outputs for s in emu.sites.values())
    for name, site in emu.sites.items():
        row = rows[name]
        assert row.full_int8_overflow_pairs == row.overflow_pairs == site.overflow_pairs > 0
        assert row.saturated_outputs == pytest.approx(site.saturated_outputs / site.outputs)
        assert row.signal_to_saturation_db < 80
    safe = {r.op: r for r in _quantize().saturation_report({"x": x})}
    assert all(r.overflow_pairs == 0 for r in safe.values())
    assert {k: r.full_int8_overflow_pairs for k, r in safe.items()} == {k: r.full_int8_overflow_pairs
                                                                        for k, r in rows.items()}
