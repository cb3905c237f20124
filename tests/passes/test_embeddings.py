"""passes.embeddings + export.ort_patterns.gather_int8_rows: embedding tables int8 per row, checked against
onnxruntime (values, file size and accuracy vs ORT quantize_dynamic)."""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper

import netquant
from netquant.graph import Executor, load_onnx
from netquant.passes.embeddings import (
    EMBEDDING_MIN_ELEMENTS,
    ROW_SCALE_CODES,
    coded_row_scales,
    half_exact_scales,
)
from tests.helpers.ir import make_model
from tests.helpers.transformer_models import SMALL, cosine, small_bert, small_bert_batches


def _run(path: Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_bert(tmp_path_factory.mktemp("bert") / "bert.onnx", seq=32)


def test_token_table_is_int8_per_row_and_gathered_before_dequantizing(bert: Path, tmp_path: Path) -> None:
    qm = netquant.quantize_onnx(str(bert), small_bert_batches(4), objective=None, quiet=True)
    g = qm.qgraph.graph
    gathers = [n for n in g.nodes if n.op_type == "Gather" and n.inputs[0] in g.initializers
               and g.initializers[n.inputs[0]].numel() >= EMBEDDING_MIN_ELEMENTS]
    assert len(gathers) == 1  # the token table (the position rows are folded to a constant at a fixed shape)
    table = g.initializers[gathers[0].inputs[0]]
    cfg = qm.qgraph.op_configs[gathers[0].name].inputs[0]
    scale = cfg.params.scale
    assert scale.shape == (SMALL["vocab"],)
    exact = 2 * table.abs().amax(1) / 255  # choose_qparams, symmetric ...
    step = scale.max() / ROW_SCALE_CODES  # ... rounded up to c * step, c in 1..255, the largest row's c 255
    codes_c = scale.double() / step.double()
    assert torch.equal(codes_c.round(), codes_c) and int(codes_c.max()) == ROW_SCALE_CODES and codes_c.min() >= 1
    assert bool((scale >= exact).all()) and bool((scale <= exact + step * (1 + 1e-6)).all())
    out = tmp_path / "q.onnx"
    qm.export(out)
    model = onnx.load(str(out))
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    gather = next(n for n in model.graph.node if n.name == gathers[0].name)
    codes = inits[gather.input[0]]
    assert codes.dtype == np.int8 and codes.shape == tuple(table.shape)
    s = scale.numpy()[:, None]
    assert np.all(np.abs(codes * s - table.numpy()) <= s / 2 * (1 + 1e-4))  # round to nearest, one scale per row
    assert not any(n.op_type == "DequantizeLinear" and n.input[0] == gather.input[0] for n in model.graph.node)
    row_scales = [v for v in inits.values() if v.shape == (SMALL["vocab"], 1)]
    assert len(row_scales) == 1 and row_scales[0].dtype == np.uint8  # one byte a row ...
    steps = [v for k, v in inits.items() if k.endswith("_step")]
    assert len(steps) == 1 and steps[0].dtype == np.float32 and steps[0].shape == ()  # ... and one step: c * step exact
    np.testing.assert_array_equal(row_scales[0].astype(np.float32)[:, 0] * steps[0], scale.numpy())
    # onnxruntime's embedding rows are the executor's fake-quantized rows
    feeds = small_bert_batches(1, seed=40)[0]
    ours = Executor(load_onnx(model)).run({k: torch.from_numpy(v) for k, v in feeds.items()})["hidden"].numpy()
    np.testing.assert_allclose(ours, _run(out, feeds), atol=1e-3, rtol=1e-3)


def test_embeddings_false_keeps_the_table_float(bert: Path, tmp_path: Path) -> None:
    qm = netquant.quantize_onnx(str(bert), small_bert_batches(4), objective=None, quiet=True, embeddings=False)
    out = tmp_path / "q.onnx"
    qm.export(out)
    types = Counter(t.data_type for t in onnx.load(str(out)).graph.initializer
                    if list(t.dims) == [SMALL["vocab"], SMALL["dim"]])
    assert types == {onnx.TensorProto.FLOAT: 1}


def _ours_and_ort_dynamic(bert: Path, tmp_path: Path, calib_batches: int) -> tuple[Path, Path]:
    """netquant's default file (objective None) and ORT quantize_dynamic's (per-channel, reduce_range) of `bert`."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    ours = tmp_path / "ours.onnx"
    netquant.quantize_onnx(str(bert), small_bert_batches(calib_batches), objective=None, quiet=True).export(ours)
    peer = tmp_path / "ort.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_dynamic(str(bert), str(peer), per_channel=True, reduce_range=True, weight_type=QuantType.QInt8)
    return ours, peer


def test_file_no_larger_and_as_accurate_as_ort_quantize_dynamic(bert: Path, tmp_path: Path) -> None:
    ours, peer = _ours_and_ort_dynamic(bert, tmp_path, 8)
    assert ours.stat().st_size <= peer.stat().st_size
    cos_ours, cos_peer = [], []
    for feeds in small_bert_batches(6, seed=100):
        ref = _run(bert, feeds)
        cos_ours.append(cosine(_run(ours, feeds), ref))
        cos_peer.append(cosine(_run(peer, feeds), ref))
    assert np.mean(cos_ours) >= np.mean(cos_peer) - 1e-4, (cos_ours, cos_peer)


def _positions_model(path: Path) -> Path:
    """x [1, 64, 256] + pos_table[arange(64)] (the Gather's indices constant, as a dynamo export writes fixed
    positions) -> MatMul [256, 256]: the position table [128, 256] is 32768 floats."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(rng.standard_normal((128, 256)).astype(np.float32), "pos_table"),
             numpy_helper.from_array(np.arange(64, dtype=np.int64), "positions"),
             numpy_helper.from_array((rng.standard_normal((256, 256)) / 16).astype(np.float32), "w")]
    nodes = [helper.make_node("Gather", ["pos_table", "positions"], ["rows"], axis=0, name="pos_gather"),
             helper.make_node("Add", ["x", "rows"], ["h"], name="add"),
             helper.make_node("MatMul", ["h", "w"], ["y"], name="mm")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, 256])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64, 256])], inits)
    onnx.save(make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_a_table_gathered_at_constant_positions_is_stored_int8_not_folded_float(tmp_path: Path) -> None:
    """Clean-up leaves the Gather of constant positions unfolded where embeddings are int8: the file holds the table
    as int8 rows (not its 64 gathered rows as 64 KB of float), and onnxruntime's output stays that of FP32."""
    src = _positions_model(tmp_path / "pos.onnx")
    calib = [{"x": np.random.default_rng(i).standard_normal((1, 64, 256)).astype(np.float32)} for i in range(4)]
    sizes, outs = {}, {}
    for embeddings in (True, False):
        qm = netquant.quantize_onnx(str(src), calib, objective=None, quiet=True, embeddings=embeddings)
        out = tmp_path / f"q_{embeddings}.onnx"
        qm.export(out)
        sizes[embeddings] = out.stat().st_size
        outs[embeddings] = _run(out, calib[0])
        inits = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(out)).graph.initializer}
        big_float = [k for k, v in inits.items() if v.dtype == np.float32 and v.size >= EMBEDDING_MIN_ELEMENTS]
        if embeddings:
            assert any(v.dtype == np.int8 and v.shape == (128, 256) for v in inits.values()) and not big_float
        else:  # float embeddings: the rows are folded to a float constant, as before
            assert big_float and not any(v.shape == (128, 256) for v in inits.values())
    assert sizes[True] < sizes[False] - 30_000  # 64 x 256 floats (65.5 KB) -> 128 x 256 int8 codes (32.8 KB) + scales
    ref = _run(src, calib[0])
    # measured: 0.999865 (int8 table) vs 0.999876 (float rows): the int8 activations' error dominates either way
    assert cosine(outs[True], ref) > 0.9998 and cosine(outs[True], ref) > cosine(outs[False], ref) - 5e-5


def test_coded_row_scales_round_up_to_c_times_step_and_fall_back_where_rows_differ_widely() -> None:
    rng = np.random.default_rng(5)
    table = torch.from_numpy(rng.standard_normal((1000, 64)).astype(np.float32)) * 0.02
    table[7] = 0  # a padding row
    amax = table.abs().amax(1)
    ideal = 2 * amax / 255
    coded = coded_row_scales(ideal, amax)
    step = coded.max() / ROW_SCALE_CODES
    c = coded.double() / step.double()
    assert torch.equal(c.round(), c) and c.min() >= 1 and c.max() == ROW_SCALE_CODES
    live = amax > 0
    assert bool((coded[live] >= ideal[live]).all()) and bool((coded[live] - ideal[live] <= step * 1.000001).all())
    assert float(coded[7]) == float(step)  # the zero row: code 1 (its codes are all 0)
    growth = float(((coded[live] / ideal[live]) ** 2).mean())  # rounding noise, relative to per-row float scales
    assert 1.0 < growth < 1.02
    # rows spanning 1000x: one-byte codes would coarsen the small rows -> float16 scales (2 bytes a row)
    wide = ideal.clone()
    wide[::2] /= 1000
    fallback = coded_row_scales(wide, amax)
    assert torch.equal(fallback, half_exact_scales(wide, amax))


def test_embedding_table_bytes_vs_ort_quantize_dynamic(bert: Path, tmp_path: Path) -> None:
    """The token table [V, D] as the file stores it: int8 codes + one uint8 scale code a row + one step, i.e. ORT
    quantize_dynamic's uint8 codes + one scale + one zero point plus V bytes (it was 2 V bytes with float16 scales);
    and the per-row scales keep the table's rounding error at most ORT's per-table one."""
    ours, peer = _ours_and_ort_dynamic(bert, tmp_path, 4)
    vocab, dim = SMALL["vocab"], SMALL["dim"]

    def table_bytes(path: Path) -> tuple[int, dict[str, np.ndarray]]:
        inits = {t.name: t for t in onnx.load(str(path)).graph.initializer}
        codes = next(k for k, t in inits.items() if list(t.dims) == [vocab, dim])
        stem = codes.removesuffix("_quantized")
        parts = {k: t for k, t in inits.items() if k.startswith(stem)}
        return sum(len(t.raw_data) or t.ByteSize() for t in parts.values()), \
            {k: numpy_helper.to_array(t) for k, t in parts.items()}

    ours_bytes, ours_parts = table_bytes(ours)
    peer_bytes, peer_parts = table_bytes(peer)
    assert ours_bytes <= peer_bytes + vocab + 8, (ours_bytes, peer_bytes)
    assert sorted(v.dtype.name for v in ours_parts.values()) == ["float32", "int8", "uint8"]
    # rounding error of the table: ours per row vs ORT's one scale (asymmetric uint8)
    table = numpy_helper.to_array(next(t for t in onnx.load(str(bert)).graph.initializer
                                       if list(t.dims) == [vocab, dim]))
    q8 = next(v for v in ours_parts.values() if v.dtype == np.int8)
    c = next(v for v in ours_parts.values() if v.dtype == np.uint8)
    step = next(v for v in ours_parts.values() if v.dtype == np.float32)
    err_ours = np.abs(q8 * (c.astype(np.float32) * step) - table).mean()
    qu = next(v for v in peer_parts.values() if v.dtype == np.uint8 and v.ndim == 2)
    scale = next(v for v in peer_parts.values() if v.dtype == np.float32)
    zero = next(v for v in peer_parts.values() if v.dtype == np.uint8 and v.ndim == 0)
    err_peer = np.abs((qu.astype(np.float32) - zero) * scale - table).mean()
    assert err_ours < err_peer, (err_ours, err_peer)
