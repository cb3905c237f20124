"""PP-OCR pre/post-processing as rapidocr does it, CTC greedy decoding and OCR metrics.

Recognizer input: BGR, height 48, width = min(ceil(48 * w / h), 320), x' = (x / 255 - 0.5) / 0.5,
zero-padded on the right to 320, NCHW float32.  Classifier input: the same at 3 x 48 x 192,
output [p(0 deg), p(180 deg)].
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
from PIL import Image

from netquant.data.text_render import TextLine

REC_SHAPE = (3, 48, 320)
CLS_SHAPE = (3, 48, 192)


def resize_norm(image: Image.Image, shape: tuple[int, int, int] = REC_SHAPE) -> np.ndarray:
    """One RGB image -> (C, H, W) float32 in [-1, 1], BGR channel order, right zero padding."""
    _, h_out, w_out = shape
    w, h = image.size
    new_w = min(w_out, max(1, math.ceil(h_out * w / h)))
    resized = np.asarray(image.convert("RGB").resize((new_w, h_out), Image.BILINEAR), dtype=np.float32)
    resized = resized[:, :, ::-1].transpose(2, 0, 1) / 255.0  # RGB -> BGR (rapidocr reads with cv2), CHW
    out = np.zeros(shape, dtype=np.float32)
    out[:, :, :new_w] = (resized - 0.5) / 0.5
    return out


def rec_batch(lines: Sequence[TextLine]) -> np.ndarray:
    """Recognizer input batch (N, 3, 48, 320)."""
    return np.stack([resize_norm(line.image, REC_SHAPE) for line in lines])


def cls_batch(images: Sequence[Image.Image]) -> np.ndarray:
    """Direction-classifier input batch (N, 3, 48, 192)."""
    return np.stack([resize_norm(im, CLS_SHAPE) for im in images])


@dataclass(frozen=True)
class ClsSample:
    """A text-line image and whether it is upside down (label 1 = rotated 180 degrees)."""

    image: Image.Image
    label: int


def direction_samples(lines: Sequence[TextLine]) -> list[ClsSample]:
    """Every other line rotated by 180 degrees: labels alternate 0, 1, 0, 1..."""
    return [ClsSample(line.image.rotate(180) if i % 2 else line.image, i % 2) for i, line in enumerate(lines)]


def ctc_greedy_decode(probs: np.ndarray, dictionary: Sequence[str]) -> list[str]:
    """(N, T, C) scores -> strings: argmax per step, merge repeats, drop blank (index 0)."""
    if probs.ndim != 3 or probs.shape[-1] != len(dictionary):
        raise ValueError(f"CTC scores of shape {probs.shape} do not match a dictionary of "
                         f"{len(dictionary)} classes (expected (N, T, {len(dictionary)}))")
    best = probs.argmax(axis=-1)
    texts = []
    for row in best:
        keep = np.ones(len(row), dtype=bool)
        keep[1:] = row[1:] != row[:-1]
        keep &= row != 0
        texts.append("".join(dictionary[i] for i in row[keep]))
    return texts


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insert, delete, substitute cost 1)."""
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


@dataclass(frozen=True)
class OcrScore:
    """line_acc = exact matches / lines; char_acc = 1 - sum(edit distance) / sum(len(truth))."""

    line_acc: float
    char_acc: float
    count: int


def score_lines(predicted: Sequence[str], truth: Sequence[str]) -> OcrScore:
    if len(predicted) != len(truth):
        raise ValueError(f"{len(predicted)} predictions for {len(truth)} ground-truth lines")
    exact = sum(p.strip() == t.strip() for p, t in zip(predicted, truth))
    errors = sum(edit_distance(p.strip(), t.strip()) for p, t in zip(predicted, truth))
    chars = max(1, sum(len(t.strip()) for t in truth))
    return OcrScore(exact / max(1, len(truth)), max(0.0, 1.0 - errors / chars), len(truth))


# ---- running the models in onnxruntime ------------------------------------------------------------

def ort_session(path: str | Path, threads: int = 0) -> ort.InferenceSession:
    """onnxruntime CPU session; threads=0 lets onnxruntime choose."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def run_batched(sess: ort.InferenceSession, x: np.ndarray, batch: int = 16) -> np.ndarray:
    """First output of `sess` on `x`, fed in batches."""
    name = sess.get_inputs()[0].name
    return np.concatenate([sess.run(None, {name: x[i:i + batch]})[0] for i in range(0, len(x), batch)])


def rec_score(path: str | Path, x: np.ndarray, truth: Sequence[str], dictionary: Sequence[str],
              threads: int = 0) -> OcrScore:
    """Exact-line and character accuracy of the recognizer file at `path` on inputs `x`."""
    probs = run_batched(ort_session(path, threads), x)
    return score_lines(ctc_greedy_decode(probs, dictionary), truth)


def cls_accuracy(path: str | Path, x: np.ndarray, labels: np.ndarray, threads: int = 0) -> float:
    """Share of samples whose argmax (0 = upright, 1 = rotated 180) matches `labels`."""
    probs = run_batched(ort_session(path, threads), x)
    return float((probs.argmax(axis=1) == labels).mean())


def latency_ms(path: str | Path, x1: np.ndarray, repeats: int = 30, warmup: int = 3) -> float:
    """Median latency (ms) of one run on `x1` (batch 1), one thread, after warm-up."""
    sess = ort_session(path, threads=1)
    name = sess.get_inputs()[0].name
    for _ in range(warmup):
        sess.run(None, {name: x1})
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        sess.run(None, {name: x1})
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)
