"""`netquant platforms`: readable at 80 columns, with aliases, engines and each platform's real files."""

from __future__ import annotations

from click.testing import CliRunner

from netquant.cli.main import cli
from netquant.platforms import get_platform, list_platforms


def _run(*args: str, columns: int = 80) -> str:
    res = CliRunner().invoke(cli, list(args), catch_exceptions=False, env={"COLUMNS": str(columns)})
    assert res.exit_code == 0, res.output
    return res.output


def test_the_table_fits_80_columns_and_names_aliases_engines_and_files() -> None:
    for columns in (80, 200):  # the table is 80 wide on any terminal
        out = _run("platforms", columns=columns)
        assert max(len(line) for line in out.splitlines()) <= 80
    for name in list_platforms():
        assert name in out
        for alias in get_platform(name).aliases:
            assert alias in out
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.startswith("│")
            and line.split("│")[1].strip() in list_platforms()}
    assert "LiteRT" in rows["tflite_int8"] and ".tflite" in rows["tflite_int8"] and ".onnx" not in rows["tflite_int8"]
    assert "OpenVINO" in rows["openvino_int8"] and ".xml .bin" in rows["openvino_int8"]
    assert "ncnn" in rows["ncnn_int8"] and ".param .bin" in rows["ncnn_int8"]
    assert "TensorRT" in rows["tensorrt_int8"] and ".onnx .cache" in rows["tensorrt_int8"]
    assert "onnxruntime" in rows["onnxruntime_int8"]


def test_one_platform_by_alias_in_full_and_an_unknown_name_is_one_error_line() -> None:
    out = _run("platforms", "litert")
    assert "platform tflite_int8" in out and "CONV" not in out and "Conv" in out and "LiteRT" in out
    assert max(len(line) for line in out.splitlines()) <= 80
    res = CliRunner().invoke(cli, ["platforms", "nope"])
    assert res.exit_code == 1 and "unknown platform 'nope'" in res.output and "Traceback" not in res.output
    assert _run("platforms", "--names").split() == list_platforms()
