"""Real models that ship inside PyPI wheels, fetched with `pip download --no-deps` into a cache.

No hub downloads: the PP-OCRv4 models come from the `rapidocr-onnxruntime==1.4.4` wheel, the PP-OCRv6 'small'
ones (a recognizer with a transformer neck) from the `rapidocr==3.10.0` wheel,
the light CNNs from `onnx/backend/test/data/light` inside the installed onnx package; the transformer
encoders (nn.TransformerEncoder, and a BERT-style one with a fused QKV Linear) are built here from seeded torch
weights and exported once.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import warnings
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx

from netquant.atomic import atomic_path
from netquant.errors import ConfigError, ModelError

if TYPE_CHECKING:
    import torch

RAPIDOCR_WHEEL = "rapidocr-onnxruntime==1.4.4"
# file names inside the wheel (rapidocr_onnxruntime/models/...)
PPOCR_MODELS = {
    "det": "ch_PP-OCRv4_det_infer.onnx",
    "rec": "ch_PP-OCRv4_rec_infer.onnx",
    "cls": "ch_ppocr_mobile_v2.0_cls_infer.onnx",
}
# PP-OCRv6 'small' models inside the rapidocr==3.10.0 wheel (rapidocr/models/...)
RAPIDOCR3_WHEEL = "rapidocr==3.10.0"
PPOCR_V6_MODELS = {
    "det": "PP-OCRv6_det_small.onnx",
    "rec": "PP-OCRv6_rec_small.onnx",
    "cls": "ch_ppocr_mobile_v2.0_cls_mobile.onnx",
}
# the built-in transformer encoder: torch.nn.TransformerEncoder, seeded weights (see encoder_model_path)
ENCODER_LAYERS, ENCODER_DIM, ENCODER_HEADS, ENCODER_FF, ENCODER_SEQ = 6, 384, 6, 1536, 64
ENCODER_SEED = 0
ENCODER_FILE = "encoder_6x384_seq64_v2.onnx"
LIGHT_MODELS = ("bvlc_alexnet", "densenet121", "inception_v1", "inception_v2", "resnet50",
                "shufflenet", "squeezenet", "vgg19", "zfnet512")


def cache_dir() -> Path:
    """$NETQUANT_CACHE, else $XDG_CACHE_HOME/netquant, else ~/.cache/netquant (independent of the cwd)."""
    env = os.environ.get("NETQUANT_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "netquant"


def _make_dir(folder: Path) -> Path:
    """mkdir -p `folder` inside the cache; ConfigError naming it (and $NETQUANT_CACHE) when that fails."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as exc:
        raise ConfigError(f"cannot use the model cache folder '{folder}' ({exc.strerror or exc}); set "
                          "NETQUANT_CACHE to a writable folder") from exc
    return folder


def _fetch_wheel(wheels: Path, spec: str = RAPIDOCR_WHEEL) -> Path:
    """The cached wheel of `spec` ('name==version'); `pip download --no-deps` into a private temp dir, then an atomic
    rename."""
    name, version = spec.split("==")
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    found = sorted(wheels.glob(pattern))
    if found:
        return found[0]
    _make_dir(wheels)
    with tempfile.TemporaryDirectory(dir=wheels) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, spec]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = sorted(Path(tmp).glob(pattern))
        if proc.returncode != 0 or not got:
            raise ModelError(f"could not fetch {spec} with pip download into {wheels}: "
                             f"{proc.stderr.strip()[-400:]}; check that PyPI is reachable or place the wheel there")
        final = wheels / got[0].name
        os.replace(got[0], final)
    return final


def _dir_mode() -> int:
    """0o777 minus the process umask: the mode mkdir gives a new folder (mkdtemp's is 0o700)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o777 & ~mask


def _check_readable(folder: Path) -> None:
    """ConfigError naming `folder` and NETQUANT_CACHE when it exists but this user cannot read it (a shared cache
    another user filled)."""
    if folder.exists() and not os.access(folder, os.R_OK | os.X_OK):
        raise ConfigError(f"the model cache folder '{folder}' exists but this user cannot read it (made by another "
                          "user?); set NETQUANT_CACHE to a folder of your own, or have its owner run "
                          f"chmod -R a+rX '{folder}'")


def _rapidocr_dir() -> Path:
    """Folder with the rapidocr-onnxruntime 1.4.4 wheel's .onnx models (see _wheel_models_dir)."""
    return _wheel_models_dir(RAPIDOCR_WHEEL, "rapidocr-1.4.4", PPOCR_MODELS["rec"])


def _wheel_models_dir(spec: str, folder: str, probe: str) -> Path:
    """Folder `folder` of the cache with the .onnx / .txt / .yaml files of the wheel `spec`, extracted once (atomic
    rename, safe across processes; `probe` is a file that must be there), readable by every user the umask allows
    (a shared NETQUANT_CACHE)."""
    target = cache_dir() / folder
    if (target / probe).exists():
        return target
    _check_readable(target)
    wheel = _fetch_wheel(_make_dir(cache_dir()) / "wheels", spec)
    tmp = Path(tempfile.mkdtemp(dir=cache_dir(), prefix=f"{folder}-"))
    try:
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                base = name.rsplit("/", 1)[-1]
                if base.endswith((".onnx", ".txt", ".yaml")):
                    (tmp / base).write_bytes(zf.read(name))
        if not (tmp / probe).exists():
            raise ModelError(f"{wheel} has no {probe}; remove the wheel from {wheel.parent} to fetch it again")
        os.chmod(tmp, _dir_mode())
        try:
            os.rename(tmp, target)
        except OSError as exc:  # another process finished first, or a folder this user cannot use is in the way
            if not (target / probe).exists():
                _check_readable(target)
                raise ConfigError(f"cannot put the models of {spec} into the model cache folder '{target}' "
                                  f"({exc.strerror or exc}); remove it or set NETQUANT_CACHE to a writable "
                                  "folder") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def ppocr_model_path(which: str) -> Path:
    """Path of a PP-OCR model: which in {'det', 'rec', 'cls'}."""
    if which not in PPOCR_MODELS:
        raise ModelError(f"unknown PP-OCR model '{which}'; choose one of {sorted(PPOCR_MODELS)}")
    return _rapidocr_dir() / PPOCR_MODELS[which]


def ppocr_rec_dictionary() -> list[str]:
    """CTC character list of the PP-OCRv4 recognizer: index 0 is blank, the last is space.

    rapidocr 1.4.4 keeps it in the model's metadata ('character'), one char per line.
    """
    return _metadata_dictionary(ppocr_model_path("rec"))


def ppocr_v6_model_path(which: str) -> Path:
    """Path of a PP-OCRv6 'small' model from the rapidocr==3.10.0 wheel: which in {'det', 'rec', 'cls'}. The
    recognizer is a conv backbone with a transformer neck (attention: Q·Kᵀ / Softmax / A·V MatMuls, LayerNorm,
    GELU): input [N, 3, 48, W] BGR in [-1, 1] (netquant.data.ocr.rec_batch), CTC scores over
    ppocr_v6_rec_dictionary()."""
    if which not in PPOCR_V6_MODELS:
        raise ModelError(f"unknown PP-OCRv6 model '{which}'; choose one of {sorted(PPOCR_V6_MODELS)}")
    return _wheel_models_dir(RAPIDOCR3_WHEEL, "rapidocr-3.10.0", PPOCR_V6_MODELS["rec"]) / PPOCR_V6_MODELS[which]


def ppocr_v6_rec_dictionary() -> list[str]:
    """CTC character list of the PP-OCRv6 small recognizer (its 'character' metadata): blank, the characters, space."""
    return _metadata_dictionary(ppocr_v6_model_path("rec"))


def _metadata_dictionary(path: Path) -> list[str]:
    model = onnx.load(str(path), load_external_data=False)
    meta = {p.key: p.value for p in model.metadata_props}
    if "character" not in meta:
        raise ModelError(f"{path} has no 'character' metadata")
    return ["blank", *meta["character"].splitlines(), " "]


def light_model_path(name: str) -> tuple[Path, Path]:
    """(model.onnx, output_0.pb) of a model in onnx/backend/test/data/light."""
    root = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
    model, out = root / f"light_{name}.onnx", root / f"light_{name}_output_0.pb"
    if not model.exists():
        raise ModelError(f"{model} not found; light models: {', '.join(LIGHT_MODELS)}")
    return model, out


def _encoder_module() -> torch.nn.Module:
    """TransformerEncoder (6 layers, d_model 384, 6 heads, ff 1536, batch_first) with weights from
    torch.manual_seed(ENCODER_SEED) (global RNG state restored afterwards); forward(x, mask) -> y."""
    import torch

    class MaskedEncoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            layer = torch.nn.TransformerEncoderLayer(ENCODER_DIM, ENCODER_HEADS, ENCODER_FF, dropout=0.0,
                                                     batch_first=True)
            # enable_nested_tensor=False: the nested-tensor fast path drops padded tokens and is not exportable
            self.encoder = torch.nn.TransformerEncoder(layer, ENCODER_LAYERS, enable_nested_tensor=False)
            for clone in self.encoder.layers:  # the encoder deep-copies one layer: give each its own weights
                clone.self_attn._reset_parameters()  # in_proj weight (zero biases)
                clone.self_attn.out_proj.reset_parameters()
                torch.nn.init.normal_(clone.self_attn.in_proj_bias, 0.0, 0.02)
                clone.linear1.reset_parameters()
                clone.linear2.reset_parameters()
                for norm in (clone.norm1, clone.norm2):  # trained-like gains and shifts, not 1 and 0
                    torch.nn.init.normal_(norm.weight, 1.0, 0.2)
                    torch.nn.init.normal_(norm.bias, 0.0, 0.1)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            """x [batch, seq, 384] float, mask [batch, seq] int64 (1 = token, 0 = padding) -> y like x."""
            return self.encoder(x, src_key_padding_mask=mask == 0)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ENCODER_SEED)
        return MaskedEncoder().eval()


def encoder_model_path() -> Path:
    """The built-in 6-layer transformer encoder as ONNX (inputs x [batch, 64, 384] float32 and mask [batch, 64]
    int64, output y [batch, 64, 384]); exported once into the cache (atomic write), same bytes every build."""
    import torch

    target = cache_dir() / "encoder" / ENCODER_FILE
    if target.exists():
        return target
    _make_dir(target.parent)
    module = _encoder_module()
    x = torch.zeros(2, ENCODER_SEQ, ENCODER_DIM)
    mask = torch.ones(2, ENCODER_SEQ, dtype=torch.int64)
    mask[1, ENCODER_SEQ // 2:] = 0
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)  # aten::_transformer_encoder_layer_fwd has no ONNX export
    try:
        with atomic_path(target, "encoder model", ModelError) as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the TorchScript exporter is deliberate: plain, stable ONNX
            torch.onnx.export(module, (x, mask), str(tmp), opset_version=17, input_names=["x", "mask"],
                              output_names=["y"], dynamic_axes={"x": {0: "batch"}, "mask": {0: "batch"},
                                                                "y": {0: "batch"}}, dynamo=False)
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
    return target


def encoder_inputs(count: int, seed: int = 0) -> dict[str, np.ndarray]:
    """`count` encoder samples {'x': [count, 64, 384] float32, 'mask': [count, 64] int64}.

    Like a tokenized batch: each row has a length drawn from [8, 64]; its tokens are rows of a fixed
    2000-entry embedding table (N(0, 1) entries) plus the sinusoidal position code, padded positions hold the
    pad embedding (zeros) and mask 0.
    """
    if count < 1:
        raise ConfigError(f"encoder_inputs: count must be >= 1, got {count}")
    table = np.random.default_rng(ENCODER_SEED + 1234).standard_normal((2000, ENCODER_DIM)).astype(np.float32)
    pos = np.arange(ENCODER_SEQ)[:, None] / np.power(10000.0, np.arange(0, ENCODER_DIM, 2) / ENCODER_DIM)
    code = np.zeros((ENCODER_SEQ, ENCODER_DIM), np.float32)
    code[:, 0::2], code[:, 1::2] = np.sin(pos), np.cos(pos)
    rng = np.random.default_rng(seed)
    lengths = rng.integers(8, ENCODER_SEQ + 1, size=count)
    tokens = rng.integers(0, len(table), size=(count, ENCODER_SEQ))
    mask = (np.arange(ENCODER_SEQ)[None, :] < lengths[:, None]).astype(np.int64)
    x = (table[tokens] + code[None]) * mask[..., None].astype(np.float32)
    return {"x": x.astype(np.float32), "mask": mask}


# a BERT-style encoder as users export it (see bert_model_path): token + position Embedding, fused QKV Linear,
# additive mask, post-LayerNorm, GELU; seeded random weights with BERT's initialisation
BERT_LAYERS, BERT_DIM, BERT_HEADS, BERT_FF, BERT_VOCAB, BERT_MAX_SEQ = 6, 384, 12, 1536, 8192, 512
BERT_SEED = 0
BERT_FILE = "bert_fused_qkv_6x384_v1.onnx"


def bert_module(layers: int = BERT_LAYERS, dim: int = BERT_DIM, heads: int = BERT_HEADS, ff: int = BERT_FF,
                vocab: int = BERT_VOCAB, seed: int = BERT_SEED) -> torch.nn.Module:
    """A BERT-style encoder (default 6 layers, width 384, 12 heads of 32, ff 1536, vocab 8192) with weights from
    torch.manual_seed(seed), N(0, 0.02) like BERT's init, LayerNorm gains N(1, 0.1); forward(input_ids,
    attention_mask) -> hidden states [batch, seq, dim]. Each layer: one fused QKV Linear, additive mask
    (1 - mask) * -10000, post-LayerNorm, erf GELU."""
    import torch
    from torch import nn

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(dim, 3 * dim)  # one fused Linear for Q, K and V
            self.out = nn.Linear(dim, dim)
            self.norm1 = nn.LayerNorm(dim, eps=1e-12)
            self.ff1 = nn.Linear(dim, ff)
            self.ff2 = nn.Linear(ff, dim)
            self.norm2 = nn.LayerNorm(dim, eps=1e-12)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            b, s, _ = x.shape
            head = dim // heads
            qkv = self.qkv(x).view(b, s, 3, heads, head).permute(2, 0, 3, 1, 4)
            q, k, v = qkv[0], qkv[1], qkv[2]
            scores = torch.matmul(q, k.transpose(-1, -2)) / head ** 0.5 + mask
            ctx = torch.matmul(scores.softmax(-1), v).transpose(1, 2).reshape(b, s, dim)
            x = self.norm1(x + self.out(ctx))
            return self.norm2(x + self.ff2(nn.functional.gelu(self.ff1(x))))

    class Bert(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tokens = nn.Embedding(vocab, dim)
            self.positions = nn.Embedding(BERT_MAX_SEQ, dim)
            self.norm = nn.LayerNorm(dim, eps=1e-12)
            self.layers = nn.ModuleList(Layer() for _ in range(layers))
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(module.weight, 0.0, 0.02)
                if isinstance(module, nn.Linear):
                    nn.init.normal_(module.bias, 0.0, 0.02)
                if isinstance(module, nn.LayerNorm):
                    nn.init.normal_(module.weight, 1.0, 0.1)
                    nn.init.normal_(module.bias, 0.0, 0.05)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            x = self.norm(self.tokens(input_ids) + self.positions(positions)[None])
            mask = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * -10000.0  # additive, as BERT's
            for layer in self.layers:
                x = layer(x, mask)
            return x

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Bert().eval()


def bert_model_path(seq: int | None = None) -> Path:
    """The BERT-style encoder (bert_module()) as ONNX, exported like users do (`torch.onnx.export(..., dynamo=False,
    opset_version=17)`): inputs input_ids and attention_mask [batch, seq] int64, output hidden [batch, seq, 384];
    seq None: dynamic batch and seq axes (seq <= 512); an int: fixed shape [1, seq] (torch.onnx's default without
    dynamic_axes). Exported once into the cache (atomic write)."""
    target = cache_dir() / "encoder" / BERT_FILE.replace(".onnx", f"_{'dynamic' if seq is None else f'1x{seq}'}.onnx")
    if not target.exists():
        _make_dir(target.parent)
        with atomic_path(target, "BERT-style encoder model", ModelError) as tmp:
            export_bert(bert_module(), tmp, seq)
    return target


def export_bert(module: torch.nn.Module, path: str | os.PathLike[str], seq: int | None = None) -> None:
    """torch.onnx.export (TorchScript, opset 17) of a bert_module at `path`: dynamic batch / seq axes when seq is
    None, else the fixed shape [1, seq]."""
    import torch

    n = 16 if seq is None else seq
    ids = torch.zeros(1 if seq is not None else 2, n, dtype=torch.int64)
    mask = torch.ones_like(ids)
    axes = None if seq is not None else {name: {0: "batch", 1: "seq"}
                                         for name in ("input_ids", "attention_mask", "hidden")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter is what users run (dynamo=False)
        torch.onnx.export(module, (ids, mask), str(path), opset_version=17,
                          input_names=["input_ids", "attention_mask"], output_names=["hidden"],
                          dynamic_axes=axes, dynamo=False)


def bert_inputs(count: int, seq: int = 64, seed: int = 0, vocab: int = BERT_VOCAB) -> dict[str, np.ndarray]:
    """`count` tokenized rows for bert_model_path(): {'input_ids', 'attention_mask'} [count, seq] int64.

    Each row has a length drawn from [seq // 4, seq]; tokens are drawn with a Zipf-like law over the vocabulary
    (frequent ids small, as real tokenizers' are), padding is id 0 with mask 0."""
    if count < 1 or not 1 <= seq <= BERT_MAX_SEQ:
        raise ConfigError(f"bert_inputs: count must be >= 1 and 1 <= seq <= {BERT_MAX_SEQ}, got {count}, {seq}")
    rng = np.random.default_rng(seed)
    lengths = rng.integers(max(1, seq // 4), seq + 1, size=count)
    ids = np.minimum(rng.zipf(1.3, size=(count, seq)) + 1, vocab - 1).astype(np.int64)
    mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int64)
    return {"input_ids": ids * mask, "attention_mask": mask}
