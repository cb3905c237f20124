"""`netquant quantize` shows progress while placement measures and while the export is written and checked."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from click.testing import CliRunner

from netquant.cli.main import cli
from tests.docs.fixtures import samples, tiny_cnn_model


def test_placement_and_export_show_progress_unless_quiet(tmp_path: Path) -> None:
    model, data = tmp_path / "m.onnx", tmp_path / "d.npy"
    onnx.save(tiny_cnn_model(), model)
    np.save(data, samples(8))
    runner = CliRunner()
    for platform, out, engine in (("onnxruntime_int8", "q.onnx", "onnxruntime"), ("trt", "t.onnx", "Q/DQ reference"),
                                  ("tflite", "q.tflite", "LiteRT")):
        res = runner.invoke(cli, ["quantize", str(model), "--calib", str(data), "-o", str(tmp_path / out),
                                  "--platform", platform], catch_exceptions=False)
        assert res.exit_code == 0, res.output
        assert "placement: INT8 or float per region" in res.output
        assert f"export: {out}, checked in {engine}" in res.output
    quiet = runner.invoke(cli, ["quantize", str(model), "--calib", str(data), "-o", str(tmp_path / "r.onnx"), "-q"],
                          catch_exceptions=False)
    assert quiet.exit_code == 0 and quiet.output.strip() == ""
