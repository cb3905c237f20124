"""Decoders for netquant's side exports (quant-params JSON, TensorRT calibration cache) and the
torch.ao reference for min/max activation params; tests compare decoded values, never raw text."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.ao.quantization.observer import MinMaxObserver


def read_params_json(path: Path) -> dict[str, Any]:
    """The parsed quant-params JSON, checked to be netquant's format 1."""
    data = json.loads(Path(path).read_text())
    assert data["format"] == "netquant-quant-params/1"
    return data


def json_record(data: dict[str, Any], node: str, place: str) -> dict[str, Any]:
    """The one config record of `node` at `place` ("input:0", "output:0", ...)."""
    found = [r for r in data["configs"] if r["node"] == node and r["place"] == place]
    assert len(found) == 1, f"{len(found)} records for {node} {place}"
    return found[0]


def read_trt_cache(path: Path) -> tuple[str, dict[str, float]]:
    """(header, {tensor: scale}) with each scale decoded from its 8 hex digits of big-endian float32."""
    header, *lines = Path(path).read_text().splitlines()
    scales: dict[str, float] = {}
    for line in lines:
        name, hexval = line.rsplit(": ", 1)
        assert len(hexval) == 8 and name not in scales
        scales[name] = struct.unpack(">f", bytes.fromhex(hexval))[0]
    return header, scales


def symmetric_int8_scale(scale: float, zero_point: int, qmin: int, qmax: int) -> float:
    """amax / 127 of the real range [(qmin - z) s, (qmax - z) s] in float64; the cache holds it in
    float32, so compare with a relative tolerance of a few float32 ulps (1e-6)."""
    amax = max(abs((qmin - zero_point) * scale), abs((qmax - zero_point) * scale))
    return amax / 127.0


def torch_minmax_uint8(x: np.ndarray) -> tuple[float, int]:
    """(scale, zero point) torch.ao's MinMaxObserver (quint8, per-tensor affine) picks for `x`."""
    obs = MinMaxObserver(dtype=torch.quint8, qscheme=torch.per_tensor_affine)
    obs(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)))
    scale, zp = obs.calculate_qparams()
    return float(scale), int(zp)
