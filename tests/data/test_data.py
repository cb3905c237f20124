"""Calibration data loading and the OCR data module (rendering, rapidocr preprocessing, CTC decoding)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from netquant.data import ChannelOrder, ImageOptions, Layout, ModelInput, load_calibration, model_inputs
from netquant.data.ocr import (
    CLS_SHAPE,
    REC_SHAPE,
    ctc_greedy_decode,
    direction_samples,
    edit_distance,
    rec_batch,
    resize_norm,
    score_lines,
)
from netquant.data.text_render import make_text_lines
from netquant.errors import CalibrationError, DataError

IMG = ModelInput("images", (None, 3, 8, 12))


# ---- rendering ---------------------------------------------------------------------------------------

def test_rendering_is_deterministic_in_the_seed() -> None:
    a, b, c = make_text_lines(6, seed=3), make_text_lines(6, seed=3), make_text_lines(6, seed=4)
    assert [x.text for x in a] == [x.text for x in b]
    assert all(np.array_equal(np.asarray(x.image), np.asarray(y.image)) for x, y in zip(a, b))
    assert [x.text for x in a] != [x.text for x in c]


def test_rendering_uses_only_the_fonts_netquant_ships() -> None:
    """The lines (and every accuracy number measured on them) do not depend on the machine's installed fonts: each
    face is a file inside the package, or PIL's own default font (None)."""
    import netquant
    from netquant.data.text_render import DEJAVU_FACES, _font_sources

    package = Path(netquant.__file__).parent
    files = [s for s in _font_sources() if s is not None]
    assert len(files) == len(DEJAVU_FACES) and None in _font_sources()
    assert all(Path(f).is_file() and Path(f).is_relative_to(package) for f in files)
    assert (package / "data" / "fonts" / "LICENSE").is_file()


def test_rendered_lines_fit_the_recognizer_width_and_use_known_characters() -> None:
    from netquant.api import zoo

    chars = set(zoo.ppocr_rec_dictionary())
    lines = make_text_lines(60, seed=9)
    for line in lines:
        w, h = line.image.size
        assert w / h <= 320 / 48 + 1e-6
        assert line.text and line.text == line.text.strip() and set(line.text) <= chars
    assert any(ch.isdigit() for line in lines for ch in line.text)


# ---- rapidocr preprocessing ----------------------------------------------------------------------------

def test_resize_norm_matches_rapidocr_formula() -> None:
    im = Image.new("RGB", (100, 50), (255, 0, 0))  # pure red
    x = resize_norm(im, REC_SHAPE)
    new_w = math.ceil(48 * 100 / 50)  # 96
    assert x.shape == REC_SHAPE and x.dtype == np.float32
    # BGR order: channel 2 is red -> (1 - 0.5) / 0.5 = 1, the others (0 - 0.5) / 0.5 = -1
    assert np.allclose(x[2, :, :new_w], 1.0) and np.allclose(x[0, :, :new_w], -1.0)
    assert np.all(x[:, :, new_w:] == 0)  # right zero padding
    wide = resize_norm(Image.new("RGB", (1000, 48), (0, 0, 0)), CLS_SHAPE)
    assert wide.shape == CLS_SHAPE and np.allclose(wide, -1.0)  # squeezed to the full width


def test_direction_samples_rotate_every_other_line() -> None:
    lines = make_text_lines(4, seed=1)
    samples = direction_samples(lines)
    assert [s.label for s in samples] == [0, 1, 0, 1]
    assert np.array_equal(np.asarray(samples[1].image), np.asarray(lines[1].image.rotate(180)))


# ---- CTC decode and metrics ------------------------------------------------------------------------------

def test_ctc_greedy_decode_merges_repeats_and_drops_blank() -> None:
    dictionary = ["blank", "a", "b", " "]
    steps = [0, 1, 1, 0, 1, 2, 2, 3, 0, 0]  # -> a, (blank), a, b, ' '
    probs = np.eye(4, dtype=np.float32)[steps][None]
    assert ctc_greedy_decode(probs, dictionary) == ["aab "]
    with pytest.raises(ValueError, match="4 classes"):
        ctc_greedy_decode(np.zeros((1, 3, 5), np.float32), dictionary)


def test_edit_distance_and_scores() -> None:
    assert edit_distance("kitten", "sitting") == 3
    assert edit_distance("", "abc") == 3 and edit_distance("abc", "abc") == 0
    s = score_lines(["abc", "abd", ""], ["abc", "abc", "xy"])
    assert s.line_acc == pytest.approx(1 / 3)
    assert s.char_acc == pytest.approx(1 - 3 / 8)


def test_real_recognizer_reads_rendered_lines() -> None:
    """The dictionary matches the model's class count and FP32 reads the rendered text (issue: ~97%)."""
    from netquant.api import zoo
    from netquant.data.ocr import ort_session, run_batched

    dictionary = zoo.ppocr_rec_dictionary()
    lines = make_text_lines(32, seed=2024)
    probs = run_batched(ort_session(zoo.ppocr_model_path("rec"), threads=1), rec_batch(lines))
    assert probs.shape[-1] == len(dictionary) == 6625
    score = score_lines(ctc_greedy_decode(probs, dictionary), [line.text for line in lines])
    assert score.line_acc >= 0.85 and score.char_acc >= 0.98


# ---- calibration loading -----------------------------------------------------------------------------------

def test_model_inputs_reads_names_shapes_dtypes(tmp_path: Path) -> None:
    import onnx

    from tests.helpers.export_models import conv_net

    onnx.save(conv_net(), tmp_path / "m.onnx")
    (inp,) = model_inputs(tmp_path / "m.onnx")
    assert inp.name == "x" and inp.shape == ("N", 3, 16, 16) and inp.dtype == np.float32


def test_npy_and_npz_loading(tmp_path: Path) -> None:
    x = np.random.default_rng(0).standard_normal((5, 3, 8, 12)).astype(np.float32)
    np.save(tmp_path / "a.npy", x[:3])
    np.save(tmp_path / "b.npy", x[3])  # one sample without the batch dim
    out = load_calibration(tmp_path, [IMG])
    assert np.array_equal(out["images"], x[:4])
    np.savez(tmp_path / "c.npz", anything=x[4:].astype(np.float64))  # converted to the model dtype
    out = load_calibration(tmp_path, [IMG], limit=5)
    assert out["images"].dtype == np.float32 and np.allclose(out["images"], x)
    two = [ModelInput("a", (None, 2)), ModelInput("b", (None, 3))]
    np.savez(tmp_path / "two.npz", a=np.ones((4, 2), np.float32), b=np.zeros((4, 3), np.float32))
    got = load_calibration(tmp_path / "two.npz", two)
    assert got["a"].shape == (4, 2) and got["b"].shape == (4, 3)


def test_wrong_shape_names_input_and_expected_shape(tmp_path: Path) -> None:
    np.save(tmp_path / "bad.npy", np.zeros((2, 3, 8, 10), np.float32))
    with pytest.raises(DataError, match=r"'images' \[\?, 3, 8, 12\].*dim 3 must be 12"):
        load_calibration(tmp_path / "bad.npy", [IMG])
    np.save(tmp_path / "bad.npy", np.zeros((2, 8, 12), np.float32))  # read as one sample: wrong channels
    with pytest.raises(DataError, match="dim 1 must be 3"):
        load_calibration(tmp_path / "bad.npy", [IMG])
    np.save(tmp_path / "bad.npy", np.zeros((8, 12), np.float32))
    with pytest.raises(DataError, match="expected 4-d"):
        load_calibration(tmp_path / "bad.npy", [ModelInput("images", (None, 3, 8, 12))])


def test_npz_missing_input_and_nan_are_data_errors(tmp_path: Path) -> None:
    two = [ModelInput("a", (None, 2)), ModelInput("b", (None, 3))]
    np.savez(tmp_path / "one.npz", a=np.ones((4, 2), np.float32))
    with pytest.raises(DataError, match=r"lacks model inputs \['b'\]"):
        load_calibration(tmp_path / "one.npz", two)
    bad = np.ones((2, 3, 8, 12), np.float32)
    bad[0, 0, 0, 0] = np.nan
    np.save(tmp_path / "nan.npy", bad)
    with pytest.raises(DataError, match="NaN"):
        load_calibration(tmp_path / "nan.npy", [IMG])


def test_missing_empty_and_unreadable_sources(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        load_calibration(tmp_path / "nothing", [IMG])
    (tmp_path / "empty").mkdir()
    with pytest.raises(CalibrationError, match="no images"):
        load_calibration(tmp_path / "empty", [IMG])
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(DataError, match="not .npy or .npz"):
        load_calibration(tmp_path / "notes.txt", [IMG])
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "a.png").write_bytes(b"not a png")
    with pytest.raises(DataError, match="cannot read image"):
        load_calibration(folder, [IMG])
    with pytest.raises(DataError, match=">= 1"):
        load_calibration("random", [IMG], limit=0)


def test_image_folder_normalization_channel_order_and_layout(tmp_path: Path) -> None:
    rgb = (200, 100, 50)
    Image.new("RGB", (24, 16), rgb).save(tmp_path / "b.png")
    Image.new("RGB", (12, 8), (0, 0, 0)).save(tmp_path / "a.png")
    opts = ImageOptions(mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    out = load_calibration(tmp_path, [IMG], image_options=opts)["images"]
    assert out.shape == (2, 3, 8, 12)  # resized to the model's static H x W, sorted by name
    assert np.allclose(out[0], (0 - 0.5) / 0.25)
    want = [(v / 255 - 0.5) / 0.25 for v in rgb]
    assert np.allclose(out[1, :, 4, 6], want, atol=1e-5)
    bgr = load_calibration(tmp_path, [IMG], image_options=ImageOptions(
        mean=(0.5,) * 3, std=(0.25,) * 3, channel_order=ChannelOrder.BGR))["images"]
    assert np.allclose(bgr[1, :, 4, 6], want[::-1], atol=1e-5)
    nhwc = ModelInput("images", (None, 8, 12, 3))
    got = load_calibration(tmp_path, [nhwc], image_options=ImageOptions(layout=Layout.NHWC))["images"]
    assert got.shape == (2, 8, 12, 3) and np.allclose(got[1, 4, 6], [v / 255 for v in rgb], atol=1e-5)


def test_image_folder_needs_size_for_dynamic_models(tmp_path: Path) -> None:
    Image.new("RGB", (30, 10), (10, 10, 10)).save(tmp_path / "a.png")
    dyn = ModelInput("x", (None, 3, "h", "w"))
    with pytest.raises(DataError, match="dynamic height/width"):
        load_calibration(tmp_path, [dyn])
    out = load_calibration(tmp_path, [dyn], image_options=ImageOptions(height=48, width=320, keep_aspect_pad=True))
    assert out["x"].shape == (1, 3, 48, 320) and np.all(out["x"][0, :, :, 144:] == 0)
    with pytest.raises(DataError, match="std"):
        ImageOptions(std=(0.0, 1.0, 1.0))


def test_random_data_fills_dynamic_dims() -> None:
    out = load_calibration("random", [ModelInput("x", ("N", 3, "h", 20))], limit=4, seed=1)
    assert out["x"].shape == (4, 3, 32, 20) and out["x"].dtype == np.float32
    again = load_calibration("random", [ModelInput("x", ("N", 3, "h", 20))], limit=4, seed=1)
    assert np.array_equal(out["x"], again["x"])


def test_random_data_takes_image_size_for_dynamic_spatial_dims() -> None:
    inp = ModelInput("x", ("N", 3, "h", "w"))
    out = load_calibration("random", [inp], limit=2, image_options=ImageOptions(height=48, width=320))
    assert out["x"].shape == (2, 3, 48, 320)
    nhwc = ModelInput("x", ("N", "h", "w", 3))
    out = load_calibration("random", [nhwc], limit=2, image_options=ImageOptions(height=8, width=6, layout=Layout.NHWC))
    assert out["x"].shape == (2, 8, 6, 3)
