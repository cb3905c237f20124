"""Spatial sampling and detection: GridSample, AffineGrid, NonMaxSuppression, ImageDecoder."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from netquant.errors import UnsupportedOpError

from ._util import ints, opt, scalar
from .registry import OpContext, register_op

Tensor = torch.Tensor


# ---------------------------------------------------------------- spatial sampling
_GRID_MODES = {"bilinear": "bilinear", "linear": "bilinear", "nearest": "nearest", "bicubic": "bicubic",
               "cubic": "bicubic"}


@register_op("GridSample")
def grid_sample(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x, grid = inputs[0], inputs[1]
    mode = attrs.get("mode", "linear" if ctx.opset >= 20 else "bilinear")
    pad = attrs.get("padding_mode", "zeros")
    if mode not in _GRID_MODES or pad not in ("zeros", "border", "reflection"):
        raise UnsupportedOpError(ctx.unsupported(f"mode '{mode}' / padding_mode '{pad}'"))
    m = _GRID_MODES[mode]
    if x.dim() == 5 and m == "bicubic":
        raise UnsupportedOpError(ctx.unsupported("cubic mode on volumetric (5-D) input"))
    return [F.grid_sample(x, grid.to(x.dtype), mode=m, padding_mode=pad,
                          align_corners=bool(attrs.get("align_corners", 0)))]


@register_op("AffineGrid")
def affine_grid(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    theta, size = inputs[0], ints(inputs[1])
    return [F.affine_grid(theta, size, align_corners=bool(attrs.get("align_corners", 0)))]


@register_op("NonMaxSuppression")
def non_max_suppression(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """Greedy per-(batch, class) NMS; returns int64 [num_selected, 3] = (batch, class, box)."""
    device = inputs[0].device
    boxes, scores = inputs[0].detach().cpu(), inputs[1].detach().cpu()  # greedy selection runs on the CPU
    max_out = int(scalar(opt(inputs, 2), 0))
    iou_thr = float(scalar(opt(inputs, 3), 0.0))
    score_thr = opt(inputs, 4)
    if boxes.shape[1] == 0 or max_out <= 0:
        return [torch.zeros((0, 3), dtype=torch.int64, device=device)]
    b = boxes.double()
    if attrs.get("center_point_box", 0):
        cx, cy, w, h = b.unbind(-1)
        y1, x1, y2, x2 = cy - h / 2, cx - w / 2, cy + h / 2, cx + w / 2
    else:
        ya, xa, yb, xb = b.unbind(-1)
        y1, y2 = torch.minimum(ya, yb), torch.maximum(ya, yb)
        x1, x2 = torch.minimum(xa, xb), torch.maximum(xa, xb)
    area = (y2 - y1) * (x2 - x1)
    selected = []
    for bi in range(scores.shape[0]):
        iy1 = torch.maximum(y1[bi, :, None], y1[bi, None, :])
        ix1 = torch.maximum(x1[bi, :, None], x1[bi, None, :])
        iy2 = torch.minimum(y2[bi, :, None], y2[bi, None, :])
        ix2 = torch.minimum(x2[bi, :, None], x2[bi, None, :])
        inter = (iy2 - iy1).clamp(min=0) * (ix2 - ix1).clamp(min=0)
        union = area[bi, :, None] + area[bi, None, :] - inter
        iou = torch.where(union > 0, inter / union, torch.zeros_like(inter))
        for ci in range(scores.shape[1]):
            sc = scores[bi, ci].double()
            order = torch.sort(sc, descending=True, stable=True).indices
            if score_thr is not None:
                order = order[sc[order] > float(scalar(score_thr))]
            keep: list[int] = []
            suppressed = torch.zeros(sc.shape[0], dtype=torch.bool)
            for idx in order.tolist():
                if len(keep) >= max_out:
                    break
                if suppressed[idx]:
                    continue
                keep.append(idx)
                suppressed |= iou[idx] > iou_thr
            selected += [[bi, ci, k] for k in keep]
    if not selected:
        return [torch.zeros((0, 3), dtype=torch.int64, device=device)]
    return [torch.tensor(selected, dtype=torch.int64, device=device)]


@register_op("ImageDecoder")
def image_decoder(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """Decode an encoded image (uint8 bytes) with Pillow into HWC uint8 (RGB, BGR or Grayscale)."""
    import io

    import numpy as np
    from PIL import Image

    fmt = attrs.get("pixel_format", "RGB")
    img = Image.open(io.BytesIO(inputs[0].detach().cpu().numpy().tobytes()))
    if fmt == "RGB":
        arr = np.array(img.convert("RGB"))
    elif fmt == "BGR":
        arr = np.array(img.convert("RGB"))[:, :, ::-1]
    elif fmt == "Grayscale":
        arr = np.array(img.convert("L"))[:, :, None]
    else:
        raise UnsupportedOpError(ctx.unsupported(f"pixel_format '{fmt}'"))
    return [torch.from_numpy(np.ascontiguousarray(arr)).to(inputs[0].device)]
