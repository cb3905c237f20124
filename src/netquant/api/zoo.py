"""Real models that ship inside PyPI wheels, fetched with `pip download --no-deps` into a cache.

No hub downloads: the PP-OCRv4 models come from the `rapidocr-onnxruntime==1.4.4` wheel,
the light CNNs from `onnx/backend/test/data/light` inside the installed onnx package.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import onnx

from netquant.errors import ConfigError, ModelError

RAPIDOCR_WHEEL = "rapidocr-onnxruntime==1.4.4"
# file names inside the wheel (rapidocr_onnxruntime/models/...)
PPOCR_MODELS = {
    "det": "ch_PP-OCRv4_det_infer.onnx",
    "rec": "ch_PP-OCRv4_rec_infer.onnx",
    "cls": "ch_ppocr_mobile_v2.0_cls_infer.onnx",
}
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


def _fetch_wheel(wheels: Path) -> Path:
    """The cached rapidocr wheel; `pip download --no-deps` into a private temp dir, then an atomic rename."""
    found = sorted(wheels.glob("rapidocr_onnxruntime-1.4.4-*.whl"))
    if found:
        return found[0]
    _make_dir(wheels)
    with tempfile.TemporaryDirectory(dir=wheels) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, RAPIDOCR_WHEEL]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = sorted(Path(tmp).glob("rapidocr_onnxruntime-1.4.4-*.whl"))
        if proc.returncode != 0 or not got:
            raise ModelError(f"could not fetch {RAPIDOCR_WHEEL} with pip download into {wheels}: "
                             f"{proc.stderr.strip()[-400:]}; check that PyPI is reachable or place the wheel there")
        final = wheels / got[0].name
        os.replace(got[0], final)
    return final


def _rapidocr_dir() -> Path:
    """Folder with the wheel's .onnx models, extracted once (atomic rename, safe across processes)."""
    target = cache_dir() / "rapidocr-1.4.4"
    if (target / PPOCR_MODELS["rec"]).exists():
        return target
    wheel = _fetch_wheel(_make_dir(cache_dir()) / "wheels")
    tmp = Path(tempfile.mkdtemp(dir=cache_dir(), prefix="rapidocr-"))
    try:
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                base = name.rsplit("/", 1)[-1]
                if base.endswith((".onnx", ".txt", ".yaml")):
                    (tmp / base).write_bytes(zf.read(name))
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first
            if not (target / PPOCR_MODELS["rec"]).exists():
                raise
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
    model = onnx.load(str(ppocr_model_path("rec")), load_external_data=False)
    meta = {p.key: p.value for p in model.metadata_props}
    if "character" not in meta:
        raise ModelError(f"{ppocr_model_path('rec')} has no 'character' metadata")
    return ["blank", *meta["character"].splitlines(), " "]


def light_model_path(name: str) -> tuple[Path, Path]:
    """(model.onnx, output_0.pb) of a model in onnx/backend/test/data/light."""
    root = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
    model, out = root / f"light_{name}.onnx", root / f"light_{name}_output_0.pb"
    if not model.exists():
        raise ModelError(f"{model} not found; light models: {', '.join(LIGHT_MODELS)}")
    return model, out
