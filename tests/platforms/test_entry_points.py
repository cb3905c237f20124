"""Platforms from other packages: the `netquant.platforms` entry-point group, read through importlib.metadata from
a real (tiny) installed distribution on sys.path."""

from __future__ import annotations

import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from netquant.cli.main import cli
from netquant.platforms import (
    ENTRY_POINT_GROUP,
    PlatformPluginWarning,
    get_platform,
    list_platforms,
    load_entry_point_platforms,
    unregister_platform,
)


def _install(site: Path, dist: str, module: str, source: str, entry_points: str) -> None:
    """A minimal installed distribution: `module.py` and `dist-0.1.dist-info` with METADATA and entry_points.txt."""
    (site / f"{module}.py").write_text(textwrap.dedent(source))
    info = site / f"{dist}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{textwrap.dedent(entry_points)}")


@pytest.fixture()
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    yield folder
    sys.path.remove(str(folder))
    for name in ("ep_dsp", "ep_npu_a", "ep_npu_b"):
        unregister_platform(name)
    for mod in [m for m in sys.modules if m.startswith("nqplug_")]:
        del sys.modules[mod]
    load_entry_point_platforms(force=True)  # back to the environment's own entry points


def test_an_installed_package_adds_platforms_to_the_api_and_the_cli(site: Path, tmp_path: Path) -> None:
    _install(site, "nqplug-dsp", "nqplug_dsp", """
        from netquant.platforms import Platform
        EP_DSP = Platform.create("ep_dsp", quantizable={"Conv", "Gemm"}, engine="My DSP", files=(".onnx",),
                                 aliases=("epdsp",))
        def more():
            return [Platform.create("ep_npu_a"), Platform.create("ep_npu_b")]
        """, "ep_dsp = nqplug_dsp:EP_DSP\nmore = nqplug_dsp:more\n")
    assert sorted(load_entry_point_platforms(force=True)) == ["ep_dsp", "ep_npu_a", "ep_npu_b"]
    assert {"ep_dsp", "ep_npu_a", "ep_npu_b"} <= set(list_platforms())
    p = get_platform("epdsp")
    assert p.name == "ep_dsp" and p.engine_name == "My DSP" and set(p.quantizable_op_types) == {"Conv", "Gemm"}

    runner = CliRunner()
    listed = runner.invoke(cli, ["platforms", "--names"], catch_exceptions=False)
    assert {"ep_dsp", "ep_npu_a", "ep_npu_b"} <= set(listed.output.split())
    table = runner.invoke(cli, ["platforms"], catch_exceptions=False)
    assert "ep_dsp" in table.output and "My DSP" in table.output
    # the CLI quantizes with it: Conv and Gemm become int8 (QDQ in the file), nothing else
    import onnx

    from tests.helpers.export_models import conv_net, images

    model, calib, out = tmp_path / "m.onnx", tmp_path / "c.npy", tmp_path / "q.onnx"
    onnx.save(conv_net(batch=1), model)
    np.save(calib, images(8))
    res = runner.invoke(cli, ["quantize", str(model), "--calib", str(calib), "-o", str(out), "--platform", "ep_dsp",
                              "-q"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    q = onnx.load(str(out))
    dq_consumers = {n.op_type for n in q.graph.node
                    if any(i in {d.output[0] for d in q.graph.node if d.op_type == "DequantizeLinear"}
                           for i in n.input)}
    assert {"Conv", "Gemm"} <= dq_consumers  # their inputs are int8 in the file
    import netquant

    qm = netquant.quantize_onnx(str(model), list(images(8)[:, None]), platform="epdsp", quiet=True)
    assert qm.platform.name == "ep_dsp" and set(qm.summary()["quantized_by_type"]) == {"Conv", "Gemm", "Relu"}  # Relu: fused into Conv
    # (Platform.create's default fusions); the platform's own op types, not onnxruntime_int8's (Add, MaxPool, ...)


def test_a_broken_or_clashing_entry_point_warns_and_the_rest_load(site: Path) -> None:
    _install(site, "nqplug-bad", "nqplug_bad", """
        from netquant.platforms import Platform
        CLASH = Platform.create("onnxruntime_int8")
        GOOD = Platform.create("ep_dsp")
        NOT_A_PLATFORM = 42
        """, "clash = nqplug_bad:CLASH\nmissing = nqplug_bad:NOPE\nwrong = nqplug_bad:NOT_A_PLATFORM\n"
             "good = nqplug_bad:GOOD\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        added = load_entry_point_platforms(force=True)
    assert added == ["ep_dsp"]
    messages = [str(w.message) for w in caught if issubclass(w.category, PlatformPluginWarning)]
    assert len(messages) == 3
    assert any("'clash = nqplug_bad:CLASH'" in m and "already registered" in m for m in messages)
    assert any("'missing = nqplug_bad:NOPE'" in m and "AttributeError" in m for m in messages)
    assert any("'wrong = nqplug_bad:NOT_A_PLATFORM'" in m and "int" in m for m in messages)
    assert get_platform("onnxruntime_int8").engine == "onnxruntime"  # the built-in one stays
