"""The tiny files and Python names the documentation examples run on (tests/docs/test_docs_examples.py).

A block's setup (`<!-- doc-test: setup=NAME -->` before it; default `tiny_cnn`) writes its files into the block's
working folder and returns the names the block may use. The files take the names the docs use:

- tiny_cnn: `model.onnx` (Conv-Relu-Conv-Relu-GlobalAveragePool-Gemm, input x[N, 3, H, W], any N, H, W),
  `data.npz` (x: 16 samples 3x32x32), `calib.npy` (the same), `images/` (8 PNG photos-to-be, 40x48 RGB);
  Python: `netquant`, `np`, `torch`, `calib_batches` (2 batches {"x": 8x3x32x32}), `batch` (the first).
- torch_cnn: the tiny_cnn files, and `model` (a torch.nn CNN of the same shape), `example_inputs`
  (torch 1x3x32x32) and `calib_batches` (4 torch batches 8x3x32x32).
- none: an empty folder, `netquant`, `np`, `torch`.
- tiny_llm: `llm.onnx` (+ `llm.onnx.weights`: a 2-layer Llama-style decoder, vocabulary 96, input input_ids[N, S])
  and `tokens.npy` (2,048 token ids).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

import netquant
from tests.helpers.ir import make_model


def tiny_cnn_model(seed: int = 0) -> onnx.ModelProto:
    """x[N, 3, H, W] -> Conv 3x3 (8) -> Relu -> Conv 3x3 (8) -> Relu -> GlobalAveragePool -> Flatten -> Gemm (10)."""
    rng = np.random.default_rng(seed)
    inits = {"w1": rng.standard_normal((8, 3, 3, 3)) * 0.3, "b1": rng.standard_normal(8) * 0.1,
             "w2": rng.standard_normal((8, 8, 3, 3)) * 0.2, "b2": rng.standard_normal(8) * 0.1,
             "wg": rng.standard_normal((10, 8)) * 0.3, "bg": rng.standard_normal(10) * 0.1}
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
             helper.make_node("GlobalAveragePool", ["r2"], ["g"], name="gap"),
             helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
             helper.make_node("Gemm", ["f", "wg", "bg"], ["y"], name="head_fc", transB=1)]
    graph = helper.make_graph(
        nodes, "tiny_cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, "H", "W"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 10])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()])
    return make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def samples(n: int = 16, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).random((n, 3, 32, 32), dtype=np.float32)


class TinyCnn(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                                            torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU(),
                                            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
        self.head = torch.nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def _files(folder: Path) -> None:
    from PIL import Image

    onnx.save(tiny_cnn_model(), folder / "model.onnx")
    x = samples()
    np.savez(folder / "data.npz", x=x)
    np.save(folder / "calib.npy", x)
    images = folder / "images"
    images.mkdir()
    rng = np.random.default_rng(2)
    for i in range(8):
        Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(images / f"{i}.png")


def _base() -> dict[str, Any]:
    return {"netquant": netquant, "np": np, "torch": torch}


def tiny_cnn(folder: Path) -> dict[str, Any]:
    _files(folder)
    x = samples()
    batches = [{"x": x[:8]}, {"x": x[8:]}]
    return {**_base(), "calib_batches": batches, "batch": batches[0]}


def torch_cnn(folder: Path) -> dict[str, Any]:
    _files(folder)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    return {**_base(), "model": TinyCnn().eval(), "example_inputs": torch.rand(1, 3, 32, 32, generator=gen),
            "calib_batches": [torch.rand(8, 3, 32, 32, generator=gen) for _ in range(4)]}


def none(folder: Path) -> dict[str, Any]:
    return _base()


def tiny_llm(folder: Path) -> dict[str, Any]:
    from tests.helpers.llm_models import export_tiny_llama, tiny_llama

    export_tiny_llama(tiny_llama(), folder / "llm.onnx", external=True)
    np.save(folder / "tokens.npy", np.random.default_rng(0).integers(0, 96, size=2048))
    return _base()


def tiny_bert(folder: Path) -> dict[str, Any]:
    """A BertModel (2 x 384) and its WordPiece tokenizer saved in folder/bert, as from_pretrained reads them."""
    import pytest

    transformers = pytest.importorskip("transformers")  # the optional extra netquant[hf]
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "a", "model", "runs", "faster", "in", "int8", "than", "float", "on", "this", "cpu"]
    bert = folder / "bert"
    bert.mkdir()
    (bert / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    tokenizer = transformers.BertTokenizerFast(vocab_file=str(bert / "vocab.txt"))
    tokenizer.save_pretrained(str(bert))
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=len(tokenizer), hidden_size=384, num_hidden_layers=2,
                                     num_attention_heads=6, intermediate_size=1536, max_position_embeddings=128)
    transformers.BertModel(config).save_pretrained(str(bert))
    return _base()


SETUPS: dict[str, Callable[[Path], dict[str, Any]]] = {"tiny_cnn": tiny_cnn, "torch_cnn": torch_cnn, "none": none,
                                                       "tiny_llm": tiny_llm, "tiny_bert": tiny_bert}
DEFAULT_SETUP = "tiny_cnn"
