"""The six encoders of benchmarks/transformer_encoders.py, each in the three graph forms users have.

Encoders (transformers configs with eager attention, seeded random init; zoo.bert_module for the fused-QKV style):
    bert_base   BertModel 12 x 768, 12 heads, vocab 30522              inputs input_ids, attention_mask, token_type_ids
    distilbert  DistilBertModel 6 x 768, 12 heads                      inputs input_ids, attention_mask
    minilm      BertModel 6 x 384, 12 heads of 32, ff 1536             inputs input_ids, attention_mask, token_type_ids
    vit         ViTModel B/16 (12 x 768), image 176 -> 121 patches + CLS = 122 tokens   input pixel_values
    whisper     WhisperEncoder 6 x 512, 8 heads, conv front end (2 Conv1d, stride 2), 80 mel x 256 frames -> 128
                positions                                              input input_features
    fused_qkv   zoo.bert_module(): 6 x 384, 12 heads, one fused QKV Linear, additive mask   input_ids, attention_mask

Forms: 'torchscript' (torch.onnx.export dynamo=False, opset 17, dynamic batch / sequence axes), 'dynamo'
(torch.onnx.export dynamo=True at opset 18 through netquant's keyword export: dynamic batch / sequence dims) and
'ortopt' (the TorchScript file after onnxruntime.transformers.optimizer.optimize_model with the encoder's model_type,
heads and hidden size: Attention / SkipLayerNormalization / BiasGelu ... where its fusions match).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

Feeds = dict[str, np.ndarray]
SEQ = 128
FORMS = ("torchscript", "dynamo", "ortopt")
ATTN = "eager"  # transformers' eager attention: the MatMul-Softmax-MatMul form onnxruntime's optimizer fuses


@dataclass(frozen=True)
class Encoder:
    key: str
    title: str
    build: Callable[[], torch.nn.Module]
    inputs: Callable[[int, int], Feeds]  # (batch, seed) -> feeds at the benchmark's length
    seq_inputs: tuple[str, ...]  # inputs whose dim 1 is the sequence
    ort_type: str  # onnxruntime.transformers.optimizer model_type
    heads: int
    hidden: int


def _tokens(vocab: int, types: bool) -> Callable[[int, int], Feeds]:
    def make(batch: int, seed: int) -> Feeds:
        rng = np.random.default_rng(seed)
        lengths = rng.integers(SEQ // 4, SEQ + 1, size=batch)
        lengths[0] = SEQ
        ids = np.minimum(rng.zipf(1.3, size=(batch, SEQ)) + 100, vocab - 1).astype(np.int64)
        mask = (np.arange(SEQ)[None, :] < lengths[:, None]).astype(np.int64)
        feeds = {"input_ids": ids * mask, "attention_mask": mask}
        if types:
            tt = np.zeros((batch, SEQ), np.int64)
            tt[:, SEQ // 2:] = 1
            feeds["token_type_ids"] = tt * mask
        return feeds

    return make


def _seeded(make: Callable[[], torch.nn.Module]) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return make().eval()

    return build


def _bert(layers: int, hidden: int, heads: int, ff: int) -> Callable[[], torch.nn.Module]:
    def make() -> torch.nn.Module:
        from transformers import BertConfig, BertModel

        return BertModel(BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                    intermediate_size=ff, attn_implementation=ATTN))

    return _seeded(make)


def _distilbert() -> torch.nn.Module:
    from transformers import DistilBertConfig, DistilBertModel

    return DistilBertModel(DistilBertConfig(attn_implementation=ATTN))


VIT_IMAGE = 176


def _vit() -> torch.nn.Module:
    from transformers import ViTConfig, ViTModel

    return ViTModel(ViTConfig(image_size=VIT_IMAGE, patch_size=16, attn_implementation=ATTN), add_pooling_layer=False)


def _vit_inputs(batch: int, seed: int) -> Feeds:
    rng = np.random.default_rng(seed)  # smooth images: low-frequency noise upsampled, normalised like ImageNet
    small = rng.standard_normal((batch, 3, VIT_IMAGE // 16, VIT_IMAGE // 16)).astype(np.float32)
    img = np.kron(small, np.ones((1, 1, 16, 16), np.float32)) + 0.3 * rng.standard_normal(
        (batch, 3, VIT_IMAGE, VIT_IMAGE)).astype(np.float32)
    return {"pixel_values": img.astype(np.float32)}


WHISPER_MEL, WHISPER_FRAMES = 80, 2 * SEQ


def _whisper() -> torch.nn.Module:
    from transformers import WhisperConfig, WhisperModel

    cfg = WhisperConfig(d_model=512, encoder_layers=6, encoder_attention_heads=8, encoder_ffn_dim=2048,
                        decoder_layers=1, decoder_attention_heads=8, decoder_ffn_dim=2048, num_mel_bins=WHISPER_MEL,
                        max_source_positions=SEQ, attn_implementation=ATTN)
    return WhisperModel(cfg).get_encoder()


def _whisper_inputs(batch: int, seed: int) -> Feeds:
    rng = np.random.default_rng(seed)  # log-mel-like: smooth in time and frequency, in [-1, 1.5]
    x = rng.standard_normal((batch, WHISPER_MEL, WHISPER_FRAMES)).astype(np.float32)
    x = (x + np.roll(x, 1, 2) + np.roll(x, 1, 1)) / 3
    return {"input_features": np.clip(x, -1.0, 1.5).astype(np.float32)}


def _fused() -> torch.nn.Module:
    from netquant.api import zoo

    return zoo.bert_module()


def _fused_inputs(batch: int, seed: int) -> Feeds:
    from netquant.api import zoo

    return zoo.bert_inputs(batch, SEQ, seed=seed)


TOKENS3 = ("input_ids", "attention_mask", "token_type_ids")
ENCODERS: dict[str, Encoder] = {e.key: e for e in (
    Encoder("minilm", "MiniLM-like BertModel 6x384, 12 heads", _bert(6, 384, 12, 1536), _tokens(30522, True),
            TOKENS3, "bert", 12, 384),
    Encoder("fused_qkv", "fused-QKV BERT-style 6x384 (zoo.bert_module)", _fused, _fused_inputs,
            ("input_ids", "attention_mask"), "bert", 12, 384),
    Encoder("whisper", "Whisper-encoder-like 6x512, conv front end, 128 positions", _seeded(_whisper),
            _whisper_inputs, (), "bert", 8, 512),
    Encoder("distilbert", "DistilBERT 6x768", _seeded(_distilbert), _tokens(30522, False),
            ("input_ids", "attention_mask"), "bert", 12, 768),
    Encoder("vit", f"ViT-B/16-like 12x768, image {VIT_IMAGE} (122 tokens)", _seeded(_vit), _vit_inputs, (),
            "vit", 12, 768),
    Encoder("bert_base", "BERT-base 12x768", _bert(12, 768, 12, 3072), _tokens(30522, True), TOKENS3, "bert",
            12, 768),
)}


class _Positional(torch.nn.Module):
    """forward(*tensors) -> the wrapped model's first output, for the TorchScript exporter (positional inputs,
    one tensor out)."""

    def __init__(self, model: torch.nn.Module, names: tuple[str, ...]) -> None:
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        out = self.model(**dict(zip(self.names, args, strict=True)))
        return out if isinstance(out, torch.Tensor) else out[0]


def export(enc: Encoder, form: str, folder: Path) -> Path:
    """enc in `form` as an ONNX file in `folder` (cached by name)."""
    target = folder / f"{enc.key}_{form}.onnx"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    if form == "ortopt":
        from onnxruntime.transformers import optimizer

        src = export(enc, "torchscript", folder)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = optimizer.optimize_model(str(src), model_type=enc.ort_type, num_heads=enc.heads,
                                           hidden_size=enc.hidden, opt_level=0)
        opt.save_model_to_file(str(target))
        return target
    model = enc.build()
    feeds = enc.inputs(2, 0)
    names = tuple(feeds)
    tensors = {k: torch.from_numpy(v) for k, v in feeds.items()}
    if form == "torchscript":
        axes = {k: ({0: "batch", 1: "sequence"} if k in enc.seq_inputs else {0: "batch"}) for k in names}
        axes["output"] = {0: "batch", 1: "sequence"} if enc.seq_inputs else {0: "batch"}
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(_Positional(model, names).eval(), tuple(tensors.values()), str(target),
                              opset_version=17, input_names=list(names), output_names=["output"], dynamic_axes=axes,
                              dynamo=False)
        return target
    if form == "dynamo":
        import onnx

        from netquant.api.keyword_inputs import keyword_export, name_dims
        from netquant.nn.export import torch_to_onnx

        dims = {k: ({0: "batch", 1: "sequence"} if k in enc.seq_inputs else {0: "batch"}) for k in names}
        plan = keyword_export(model, tensors, dynamic_axes=dims)
        proto = torch_to_onnx(model, (), kwargs=plan.kwargs, opset=18, input_names=plan.input_names,
                              output_names=plan.output_names, dynamic_shapes=plan.dynamic_shapes, what=enc.key)
        name_dims(proto, plan.dim_names)
        onnx.save(proto, str(target))
        return target
    raise ValueError(form)
