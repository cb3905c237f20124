"""What the docs promise of the Python API: calibration data from a path with the CLI's options, quantize_torch's
dynamic batch, the TensorRT cache beside `qm.export`, a lower-is-better metric, and what placement reports
(its engine, its time cap, its progress)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import netquant
from netquant.data.calib import (
    ChannelOrder,
    ImageOptions,
    Layout,
    load_calibration,
    model_inputs,
    split_batches,
)
from netquant.errors import ConfigError, DataError, ExportError
from netquant.passes.settings import LowerIsBetter, QuantSettings
from tests.docs.fixtures import TinyCnn, samples, tiny_cnn_model
from tests.helpers.placement_models import conv_stack, stack_batches


@pytest.fixture()
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.onnx"
    onnx.save(tiny_cnn_model(), path)
    return path


def _params(qm: netquant.QuantizedModel, path: Path) -> dict:
    qm.export(path, format="json")
    return json.loads(path.read_text())


def test_an_image_folder_with_the_cli_options_calibrates_as_the_cli_does(model_file: Path, tmp_path: Path) -> None:
    from PIL import Image

    folder = tmp_path / "imgs"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(10):
        Image.fromarray(rng.integers(0, 256, (30, 50, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    opts = dict(height=20, width=24, mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3), channel_order="bgr")
    qm = netquant.quantize_onnx(str(model_file), str(folder), objective=None, quiet=True, batch_size=4, **opts)
    # the CLI's loader with the same options
    inputs = model_inputs(model_file)
    data = load_calibration(folder, inputs, image_options=ImageOptions(
        height=20, width=24, mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3), channel_order=ChannelOrder.BGR,
        layout=Layout.NCHW))
    ref = netquant.quantize_onnx(str(model_file), split_batches(data, inputs, 4), objective=None, quiet=True)
    assert _params(qm, tmp_path / "a.json") == _params(ref, tmp_path / "b.json")
    first = qm.qgraph.validation_batches[0]["x"]
    assert tuple(first.shape) == (4, 3, 20, 24)
    torch.testing.assert_close(first, torch.from_numpy(data["x"][:4]))
    # the options are applied: pixel 0..255 -> (p / 255 - mean) / std per channel, channels in BGR order
    assert float(first[:, 0].min()) >= (0 - 0.5) / 0.2 - 1e-6 and float(first[:, 2].max()) <= (1 - 0.3) / 0.3 + 1e-6
    rgb = netquant.quantize_onnx(str(model_file), str(folder), objective=None, quiet=True, batch_size=4,
                                 **{**opts, "channel_order": "rgb"}).qgraph.validation_batches[0]["x"]
    assert not torch.equal(rgb, first)


def test_npz_and_random_paths_and_options_without_a_path(model_file: Path, tmp_path: Path) -> None:
    np.savez(tmp_path / "data.npz", x=samples(16))
    qm = netquant.quantize_onnx(str(model_file), str(tmp_path / "data.npz"), num_calib=8, batch_size=4,
                                objective=None, quiet=True)
    seen = sum(int(b["x"].shape[0]) for b in qm.qgraph.validation_batches)
    assert seen == 8  # num_calib=8: two batches of 4, both kept for validation
    torch.testing.assert_close(qm.qgraph.validation_batches[0]["x"], torch.from_numpy(samples(16)[:4]))
    with pytest.raises(ConfigError, match="height"):
        netquant.quantize_onnx(str(model_file), [samples(4)], height=32, quiet=True)
    with pytest.raises(DataError, match="does not exist"):
        netquant.quantize_onnx(str(model_file), str(tmp_path / "nothing"), quiet=True)
    with pytest.raises(DataError, match="layout"):
        netquant.quantize_onnx(str(model_file), str(tmp_path / "data.npz"), layout="nchwc", quiet=True)


def test_quantize_torch_takes_any_batch_by_default(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = TinyCnn().eval()
    batches = [torch.rand(16, 3, 32, 32) for _ in range(2)]
    qm = netquant.quantize_torch(module, torch.rand(1, 3, 32, 32), batches, quiet=True, objective=None)
    out = tmp_path / "m.onnx"
    qm.export(out)
    dim0 = onnx.load(str(out)).graph.input[0].type.tensor_type.shape.dim[0]
    assert dim0.dim_param and not dim0.dim_value
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    for n in (16, 3):
        x = np.random.default_rng(n).random((n, 3, 32, 32), dtype=np.float32)
        (y,) = sess.run(None, {sess.get_inputs()[0].name: x})
        ref = module(torch.from_numpy(x)).detach().numpy()
        assert y.shape == (n, 10) and np.corrcoef(y.ravel(), ref.ravel())[0, 1] > 0.99


@pytest.mark.slow
def test_quantize_torch_dynamic_batch_false_fixes_the_examples_batch() -> None:
    module = TinyCnn().eval()
    with pytest.raises(DataError, match="dim 0 must be 1"):
        netquant.quantize_torch(module, torch.rand(1, 3, 32, 32), [torch.rand(16, 3, 32, 32)], dynamic_batch=False,
                                quiet=True)


def test_tensorrt_export_writes_its_calibration_cache_beside_the_onnx_file(model_file: Path, tmp_path: Path) -> None:
    qm = netquant.quantize_onnx(str(model_file), [samples(8)], "tensorrt_int8", quiet=True)
    qm.export(tmp_path / "m.onnx")
    qm.export(tmp_path / "ref.cache", format="tensorrt_cache")
    assert (tmp_path / "m.cache").read_bytes() == (tmp_path / "ref.cache").read_bytes()
    qm.export(tmp_path / "n.onnx", trt_cache=tmp_path / "elsewhere.cache")
    assert (tmp_path / "elsewhere.cache").read_bytes() == (tmp_path / "ref.cache").read_bytes()
    assert not (tmp_path / "n.cache").exists()
    qm.export(tmp_path / "o.onnx", trt_cache=False)
    assert not (tmp_path / "o.cache").exists()
    with pytest.raises(ExportError, match="trt_cache"):  # planned with the model: refused before anything is written
        qm.export(tmp_path / "z.onnx", trt_cache=model_file)
    assert not (tmp_path / "z.onnx").exists() and onnx.load(str(model_file)).graph.name == "tiny_cnn"
    other = netquant.quantize_onnx(str(model_file), [samples(8)], quiet=True)
    other.export(tmp_path / "p.onnx")
    assert not (tmp_path / "p.cache").exists()  # onnxruntime_int8: no TensorRT cache


def test_a_lower_is_better_metric_places_as_its_negation() -> None:
    """higher_is_better=False: the loss is the rise of the metric; the same decisions and losses as the
    higher-is-better -metric (academic_int8: the accuracy budget alone, no timing noise; effort fast: no repair)."""
    x = {"x": torch.from_numpy(stack_batches(1, seed=7)[0])}
    ref = netquant.quantize_onnx(conv_stack(), stack_batches(), quiet=True, objective=None)
    target = ref.run(x, fake_quant=False)["c2"]

    def mse(outputs, t):
        return float(((outputs["c2"] - t) ** 2).mean())

    def neg_mse(outputs, t):
        return -mse(outputs, t)

    def run(**kw):
        return netquant.quantize_onnx(conv_stack(), stack_batches(), "academic_int8", quiet=True,
                                      eval_data=[(x, target)], placement_time_s=30.0, effort="fast", **kw)

    all_int8 = run(metric=neg_mse, max_loss=1e9).placement.measured["loss_all_int8"]
    assert all_int8 > 0
    low = run(metric=mse, higher_is_better=False, max_loss=all_int8 / 4).placement
    high = run(metric=neg_mse, max_loss=all_int8 / 4).placement
    assert low.measured["loss_all_int8"] == pytest.approx(all_int8, rel=1e-9)
    assert [r.decision for r in low.regions] == [r.decision for r in high.regions]
    assert any(r.decision == "float" for r in low.regions)
    assert low.measured["loss_placed"] == pytest.approx(high.measured["loss_placed"], rel=1e-9)
    assert low.measured["loss_placed"] <= all_int8 / 4
    # the wrapper: -metric, applied once; a non-bool flag is refused
    s = QuantSettings.from_kwargs("academic_int8", {"metric": mse, "eval_data": [(x, target)],
                                                    "higher_is_better": False})
    assert isinstance(s.metric, LowerIsBetter) and s.metric.metric is mse
    s.validate()
    assert s.metric.metric is mse
    with pytest.raises(ConfigError, match="higher_is_better"):
        QuantSettings.from_kwargs("academic_int8", {"higher_is_better": "no"})


def test_placement_names_the_platforms_engine_and_its_real_cap(capsys: pytest.CaptureFixture[str],
                                                               tmp_path: Path) -> None:
    lite = netquant.quantize_onnx(conv_stack(), stack_batches(), "tflite_int8", quiet=True, placement_time_s=30.0)
    assert "LiteRT" in lite.placement.note and "qdq_reference" not in lite.placement.note
    capsys.readouterr()
    qm = netquant.quantize_onnx(conv_stack(), stack_batches(), objective="latency", placement_time_s=0.0)
    err = capsys.readouterr().err
    assert "placement: INT8 or float per region" in err  # progress while it measures
    note, took = qm.placement.note, qm.timings["placement"]
    assert "time cap 0.00 s reached: placement took " in note
    reported = float(note.split("time cap 0.00 s reached: placement took ")[1].split(" s")[0])
    assert 0 < reported <= took + 0.005 and reported >= took - 0.25  # the time placement really took (2 decimals)
    qm.export(tmp_path / "m.onnx")
    assert "export: m.onnx" in capsys.readouterr().err  # and so does its export
    quiet = netquant.quantize_onnx(conv_stack(), stack_batches(), "tflite_int8", quiet=True, placement_time_s=30.0)
    quiet.export(tmp_path / "q.onnx")
    assert capsys.readouterr().err == ""  # quiet: no progress
