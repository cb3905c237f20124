"""Shared inputs for the graph tests: real models and realistic inputs for them."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from PIL import Image, ImageDraw

from netquant.api.zoo import light_model_path

PPOCR_SHAPES = {"det": (1, 3, 160, 320), "rec": (1, 3, 48, 320), "cls": (1, 3, 48, 192)}


def text_image(height: int, width: int, text: str = "netquant 2026: graph IR + torch") -> np.ndarray:
    """HxWx3 uint8: dark text on a light, slightly textured background (a PP-OCR-like input)."""
    rng = np.random.default_rng(0)
    bg = (235 + rng.integers(-12, 12, (height, width, 3))).clip(0, 255).astype(np.uint8)
    img = Image.fromarray(bg)
    draw = ImageDraw.Draw(img)
    for row, y in enumerate(range(height // 6, height - 10, 26)):
        draw.text((6 + 3 * row, y), text, fill=(20, 20, 30))
    return np.asarray(img)


def ppocr_input(which: str, batch: int = 1) -> np.ndarray:
    """Normalized NCHW float32 input: det uses ImageNet mean/std, rec/cls (x - 0.5) / 0.5."""
    _, c, h, w = PPOCR_SHAPES[which]
    x = text_image(h, w).astype(np.float32) / 255.0
    if which == "det":
        x = (x - np.array([0.485, 0.456, 0.406], np.float32)) / np.array([0.229, 0.224, 0.225], np.float32)
    else:
        x = (x - 0.5) / 0.5
    x = np.ascontiguousarray(x.transpose(2, 0, 1)[None]).astype(np.float32)
    return np.repeat(x, batch, axis=0)


def light_input(model: onnx.ModelProto) -> np.ndarray:
    """The input onnx's backend runner feeds the light models: arange(n) / n in the declared shape."""
    inits = {i.name for i in model.graph.initializer}
    vi = next(v for v in model.graph.input if v.name not in inits)
    shape = tuple(d.dim_value if d.HasField("dim_value") else 1 for d in vi.type.tensor_type.shape.dim)
    n = int(np.prod(shape))
    return (np.arange(n).reshape(shape) / n).astype(np.float32)


def light_case(name: str) -> tuple[onnx.ModelProto, np.ndarray, np.ndarray]:
    """(model, input, stored reference output) of a model in onnx/backend/test/data/light."""
    model_path, out_path = light_model_path(name)
    model = onnx.load(str(model_path))
    ref = onnx.numpy_helper.to_array(onnx.load_tensor(str(out_path)))
    return model, light_input(model), ref


def ort_run(model: onnx.ModelProto | str, feeds: dict[str, np.ndarray], threads: int = 1) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    sess = ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    """max |out - ref| / max |ref|"""
    return float(np.abs(out.astype(np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30))
