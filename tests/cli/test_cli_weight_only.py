"""`netquant quantize --weight-only`: files written, figures printed, inputs never overwritten."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from click.testing import CliRunner

from netquant.cli.main import cli
from tests.helpers.llm_models import export_tiny_llama, tiny_llama


def _llm(tmp_path: Path) -> Path:
    return export_tiny_llama(tiny_llama(), tmp_path / "llm.onnx")


def test_weight_only_awq_from_token_file(tmp_path: Path) -> None:
    model = _llm(tmp_path)
    np.save(tmp_path / "tokens.npy", np.random.default_rng(0).integers(0, 96, size=2000))
    out = tmp_path / "llm_q4.onnx"
    res = CliRunner().invoke(cli, ["quantize", str(model), "--weight-only", "int4", "--block-size", "32",
                                   "--algorithm", "awq", "--calib", str(tmp_path / "tokens.npy"), "--seq-len", "16",
                                   "-o", str(out)])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "16 weights quantized (2 in int8" in text and "cosine 0.9" in text
    m = onnx.load(str(out), load_external_data=False)
    assert sum(n.op_type == "MatMulNBits" for n in m.graph.node) == 15
    ids = np.random.default_rng(5).integers(0, 96, size=(1, 16))
    ref = ort.InferenceSession(str(model)).run(None, {"input_ids": ids})[0]
    got = ort.InferenceSession(str(out)).run(None, {"input_ids": ids})[0]
    cos = float((ref * got).sum() / np.linalg.norm(ref) / np.linalg.norm(got))
    assert cos > 0.98


def test_weight_only_refuses_overwriting_the_calibration_file(tmp_path: Path) -> None:
    model = _llm(tmp_path)
    np.save(tmp_path / "tokens.npy", np.arange(64) % 96)
    before = (tmp_path / "tokens.npy").read_bytes()
    res = CliRunner().invoke(cli, ["quantize", str(model), "--weight-only", "int8", "--calib",
                                   str(tmp_path / "tokens.npy"), "-o", str(tmp_path / "tokens.npy")])
    assert res.exit_code == 1 and "tokens.npy" in res.output and "Traceback" not in res.output
    assert (tmp_path / "tokens.npy").read_bytes() == before


def test_weight_only_text_without_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    model = _llm(tmp_path)
    (tmp_path / "text.txt").write_text("hello world " * 100)
    res = CliRunner().invoke(cli, ["quantize", str(model), "--weight-only", "int4", "--algorithm", "gptq",
                                   "--calib", str(tmp_path / "text.txt"), "-o", str(tmp_path / "q.onnx")])
    assert res.exit_code == 1 and "--tokenizer" in res.output
    assert not (tmp_path / "q.onnx").exists()


def test_weight_only_random_calibration_dq_format(tmp_path: Path) -> None:
    model = _llm(tmp_path)
    res = CliRunner().invoke(cli, ["quantize", str(model), "--weight-only", "int4", "--wo-format", "dq",
                                   "--block-size", "32", "--asymmetric", "--embeddings", "--calib", "random", "--seq-len", "16",
                                   "-o", str(tmp_path / "q.onnx")])
    assert res.exit_code == 0, res.output
    m = onnx.load(str(tmp_path / "q.onnx"), load_external_data=False)
    dq = [n for n in m.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dq) == 16 and all(a.i == 32 for n in dq for a in n.attribute if a.name == "block_size")  # + the table


def test_weight_only_mixed_bits_from_the_cli(tmp_path: Path) -> None:
    model = _llm(tmp_path)
    res = CliRunner().invoke(cli, ["quantize", str(model), "--weight-only", "int4", "--block-size", "32",
                                   "--max-loss", "0.0005", "--calib", "random", "--seq-len", "16",
                                   "-o", str(tmp_path / "q.onnx")])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())  # rich wraps lines at the terminal width
    assert "mixed int4 / int8:" in text and "within --max-loss 0.0005" in text
