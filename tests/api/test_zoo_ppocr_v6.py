"""The PP-OCRv6 small models from the rapidocr==3.10.0 wheel (zoo.ppocr_v6_model_path): fetched once into the cache,
a real recognizer with a transformer neck that reads rendered lines."""

from __future__ import annotations

import collections
from pathlib import Path

import onnx
import pytest

from netquant.api import zoo
from netquant.data.ocr import rec_batch, rec_score
from netquant.data.text_render import make_text_lines
from netquant.errors import ModelError


@pytest.fixture(scope="module")
def rec() -> Path:
    try:
        return zoo.ppocr_v6_model_path("rec")
    except ModelError as exc:  # no wheel in the cache and no package index: nothing to test against
        pytest.skip(str(exc))


def test_the_recognizer_has_attention_and_a_matching_dictionary(rec: Path) -> None:
    model = onnx.load(str(rec))
    ops = collections.Counter(n.op_type for n in model.graph.node)
    assert ops["Softmax"] >= 2 and ops["MatMul"] >= 8 and ops["Erf"] >= 2  # attention, GELU
    classes = model.graph.output[0].type.tensor_type.shape.dim[-1].dim_value
    words = zoo.ppocr_v6_rec_dictionary()
    assert len(words) == classes == 18710 and words[0] == "blank" and words[-1] == " "


def test_the_recognizer_reads_rendered_lines(rec: Path) -> None:
    lines = make_text_lines(24, seed=5)
    score = rec_score(rec, rec_batch(lines), [line.text for line in lines], zoo.ppocr_v6_rec_dictionary(), threads=1)
    assert score.char_acc > 0.9, score


def test_unknown_model_names_are_model_errors() -> None:
    with pytest.raises(ModelError, match="unknown PP-OCRv6 model 'table'"):
        zoo.ppocr_v6_model_path("table")


def test_the_recognizer_quantizes_and_exports_with_the_defaults(rec: Path, tmp_path: Path) -> None:
    """quantize_onnx's defaults on 32 rendered lines of one sample each, then export with its validation: the file is
    written and reads held-out lines in onnxruntime within 3 points of FP32. (Its validation's first look, three
    samples, refused such a file once: the later calibration batches confirm a refusal, export.validate.)"""
    import netquant

    name = onnx.load(str(rec), load_external_data=False).graph.input[0].name
    x = rec_batch(make_text_lines(32, seed=1000))
    qm = netquant.quantize_onnx(str(rec), [{name: x[i:i + 1]} for i in range(len(x))], quiet=True)
    out = tmp_path / "rec_int8.onnx"
    report = qm.export(out)
    assert report.validated and report.validation_batches in (3, 24)
    lines = make_text_lines(48, seed=2000)
    words, truth = zoo.ppocr_v6_rec_dictionary(), [line.text for line in lines]
    scores = [rec_score(p, rec_batch(lines), truth, words, threads=1) for p in (rec, out)]
    assert scores[1].line_acc >= scores[0].line_acc - 0.03 and scores[1].char_acc >= scores[0].char_acc - 0.01, scores
