"""analysis.wider: regions run in the platform's wider format compute the same in fake-quant and in the exported file."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper

from netquant.analysis.regions import find_regions, keep_float
from netquant.analysis.wider import check_twin, widen
from netquant.api import quantize_onnx
from netquant.errors import ConfigError
from netquant.export import build_qdq_model
from netquant.platforms import get_platform
from tests.helpers.placement_models import conv_stack, stack_batches

X = stack_batches(1, seed=7)[0]


def _pair(platform: str):
    narrow = quantize_onnx(conv_stack(), stack_batches(), platform, quiet=True, objective=None)
    wide = quantize_onnx(conv_stack(), stack_batches(), get_platform(platform).widened(), quiet=True, objective=None)
    return narrow.qgraph, wide.qgraph


def _reference(model: onnx.ModelProto) -> np.ndarray:
    """The file in the Q/DQ reference semantics: onnxruntime with graph optimizations off."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": X})[0]


def _fake_quant(qgraph) -> np.ndarray:
    return next(iter(qgraph.run({"x": torch.from_numpy(X)}).values())).numpy()


def _agree(ref: np.ndarray, fq: np.ndarray, qgraph) -> None:
    """The file's outputs and the executor's agree: where the output is quantized, to one output step (float sums may
    round a tie the other way, seldom); float outputs, but for the rare element whose input quantizer met such a tie."""
    diff = np.abs(ref - fq)
    out_cfg = qgraph.output_config(qgraph.graph.outputs[0].name)
    if out_cfg is not None and out_cfg.is_active:
        step = float(out_cfg.effective_params.scale)
        assert diff.max() <= 1.01 * step and diff.mean() < 0.1 * step
    else:
        assert (diff > 1e-5).mean() < 0.005 and diff.max() < 0.01 * np.abs(ref).max()


def _elem_types(model: onnx.ModelProto) -> set[int]:
    zps = {n.input[2] for n in model.graph.node if n.op_type == "QuantizeLinear"}
    return {t.data_type for t in model.graph.initializer if t.name in zps}


def _weight_code_ranges(model: onnx.ModelProto) -> list[int]:
    """max |q| of each Conv's weight codes, in graph order."""
    inits = {t.name: t for t in model.graph.initializer}
    dq = {n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    return [int(np.abs(numpy_helper.to_array(inits[dq[n.input[1]]]).astype(np.int64)).max())
            for n in model.graph.node if n.op_type == "Conv"]


@pytest.mark.parametrize("platform", ["qnn_dsp", "academic_int4"])
def test_wide_regions_export_as_the_executor_runs_them(platform):
    """The middle conv alone, then every region, in the wider format (qnn_dsp: uint16 activations; academic_int4:
    W8A8): the exported Q/DQ file run in onnxruntime (optimizations off) matches the fake-quant executor (to one
    output step at rounding ties where the output is quantized, as the narrow file does); every region wide computes
    and exports as the model calibrated in the wider format and is closer to FP32; undoing restores the narrow model
    exactly."""
    qgraph, wide = _pair(platform)
    fp32 = next(iter(qgraph.run({"x": torch.from_numpy(X)}, fake_quant=False).values())).numpy()
    before = _fake_quant(qgraph)
    regions = find_regions(qgraph)
    assert [r.anchor for r in regions] == ["conv0", "conv1", "conv2"]
    for chosen in ([regions[1]], regions):
        with widen(qgraph, wide, chosen):
            after = _fake_quant(qgraph)
            model = build_qdq_model(qgraph)[0]
            ref = _reference(model)
        if len(chosen) == 1:
            _agree(ref, after, qgraph)
        else:  # every region wide is the model calibrated in the wider format: the same computation, the same file
            assert np.array_equal(after, _fake_quant(wide))
            assert np.abs(ref - _reference(build_qdq_model(wide)[0])).max() < 1e-6
        kinds = _elem_types(model)
        if platform == "qnn_dsp":  # uint16 where the regions run wide (uint8 where a narrow one meets them)
            assert onnx.TensorProto.UINT16 in kinds and (onnx.TensorProto.UINT8 in kinds) == (len(chosen) == 1)
            assert max(op.version for op in model.opset_import if op.domain in ("", "ai.onnx")) >= 21
        else:  # 8-bit weight codes for the wide regions, 4-bit elsewhere (stored in int8 at this opset)
            assert _weight_code_ranges(model) == ([8, 128, 8] if len(chosen) == 1 else [128, 128, 128])
    # int8 weights stay (qnn_dsp: 0.65x the narrow error); int8 weights too (academic_int4)
    assert np.abs(after - fp32).mean() < (0.75 if platform == "qnn_dsp" else 0.5) * np.abs(before - fp32).mean()
    assert np.array_equal(_fake_quant(qgraph), before)  # undone exactly


def test_wide_and_float_regions_together_and_twin_check():
    """One region wide and its neighbour float: the file still matches the executor; a twin of another model is
    refused."""
    qgraph, wide = _pair("qnn_dsp")
    regions = {r.anchor: r for r in find_regions(qgraph)}
    with widen(qgraph, wide, [regions["conv0"]]), keep_float(qgraph, [regions["conv1"]]):
        _agree(_reference(build_qdq_model(qgraph)[0]), _fake_quant(qgraph), qgraph)
    other = quantize_onnx(conv_stack(width=32), stack_batches(), "qnn_dsp", quiet=True, objective=None).qgraph
    other.op_configs.pop(next(iter(other.op_configs)))
    with pytest.raises(ConfigError, match="other quantized ops"):
        check_twin(qgraph, other)
    name = next(iter(wide.op_configs))
    wide.op_configs[name].outputs.append(None)  # one config place more than the narrow op
    with pytest.raises(ConfigError, match=f"op '{name}' has other config places in the wide-format graph"):
        check_twin(qgraph, wide)
