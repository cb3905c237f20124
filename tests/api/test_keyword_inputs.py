"""quantize_torch with keyword inputs (a dict of example tensors): names, default dynamic batch / sequence dims,
ModelOutput-like outputs named after their fields; the file checked in onnxruntime against the torch module."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import netquant
from netquant.api.keyword_inputs import keyword_export


class _Tokens(torch.nn.Module):
    """Embedding + mask-weighted mean + Linear, called as forward(input_ids=..., attention_mask=...), returning a
    mapping like transformers' ModelOutput."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(300, 64)
        self.fc = torch.nn.Linear(64, 32)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> OrderedDict[str, torch.Tensor]:
        h = self.fc(self.emb(input_ids))
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        return OrderedDict(hidden=h, pooled=(h * m).sum(1) / m.sum(1).clamp(min=1.0))


def _feeds(batch: int, seq: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, seq), dtype=np.int64)
    mask[0, seq // 2:] = 0
    return {"input_ids": rng.integers(0, 300, (batch, seq), dtype=np.int64), "attention_mask": mask}


def test_keyword_export_plan_dims_and_output_names():
    example = {k: torch.from_numpy(v) for k, v in _feeds(1, 1, 0).items()}
    plan = keyword_export(_Tokens().eval(), example)
    assert plan.input_names == ["input_ids", "attention_mask"]
    assert plan.output_names == ["hidden", "pooled"]
    assert plan.dim_names == {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"}}
    assert tuple(plan.kwargs["input_ids"].shape) == (2, 2)  # size-1 dynamic dims doubled so export keeps them free
    fixed = keyword_export(_Tokens().eval(), example, dynamic_batch=False)
    assert fixed.dynamic_shapes is None and tuple(fixed.kwargs["input_ids"].shape) == (1, 1)


def test_quantize_torch_keyword_inputs_runs_any_batch_and_length(tmp_path):
    model = _Tokens().eval()
    example = {k: torch.from_numpy(v) for k, v in _feeds(2, 8, 0).items()}
    qm = netquant.quantize_torch(model, example, [_feeds(2, 8 + 4 * i, i) for i in range(4)], quiet=True,
                                 objective=None)
    path = qm.export(tmp_path / "tokens.onnx").path
    proto = onnx.load(str(path))
    assert [o.name for o in proto.graph.output] == ["hidden", "pooled"]
    assert [d.dim_param for d in proto.graph.input[1].type.tensor_type.shape.dim] == ["batch", "sequence"]
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch, seq in ((1, 5), (3, 40)):
        feeds = _feeds(batch, seq, 50 + seq)
        with torch.no_grad():
            ref = model(**{k: torch.from_numpy(v) for k, v in feeds.items()})
        for got, want in zip(sess.run(None, feeds), ref.values()):
            a, b = got.ravel().astype(np.float64), want.numpy().ravel().astype(np.float64)
            assert got.shape == tuple(want.shape)
            assert a @ b / (np.linalg.norm(a) * np.linalg.norm(b)) > 0.999


def test_keyword_export_refusals_name_the_input_and_what_to_do():
    from netquant.errors import ModelError

    ids = torch.zeros((2, 8), dtype=torch.int64)
    mask = torch.ones((2, 8), dtype=torch.int64)
    with pytest.raises(ModelError, match="example inputs dict is empty; give the inputs the model's forward takes"):
        keyword_export(_Tokens(), {})
    with pytest.raises(ModelError, match="example input 'input_ids' is a str; give tensors or numpy"):
        keyword_export(_Tokens(), {"input_ids": "hello", "attention_mask": mask})
    with pytest.raises(ModelError, match=r"_Tokens cannot run on the example inputs \(input_ids \[2, 8\]\).*"
                                         r"give the keyword inputs its forward takes"):
        keyword_export(_Tokens(), {"input_ids": ids})  # attention_mask missing
    with pytest.raises(ModelError, match=r"dynamic_axes names \['mask'\], not among the example inputs"):
        keyword_export(_Tokens(), {"input_ids": ids, "attention_mask": mask}, dynamic_axes={"mask": {0: "b"}})
