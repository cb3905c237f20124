"""Decoders for netquant's side exports (quant-params JSON, TensorRT calibration cache) and the
torch.ao reference for min/max activation params; tests compare decoded values, never raw text."""

from __future__ import annotations

import json
import math
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


def round_outward(v: float, bits: int = 8) -> float:
    """`v` rounded away from zero to `bits` significant bits: netquant's rule for activation ranges
    (v = m 2^e, m in [0.5, 1) -> sign(v) ceil(m 2^bits) 2^(e - bits); hand-checked in tests/passes)."""
    if v == 0:
        return 0.0
    m, e = math.frexp(abs(v))
    return math.copysign(math.ldexp(math.ceil(math.ldexp(m, bits)), e - bits), v)


def torch_minmax_params(x: np.ndarray, dtype: torch.dtype) -> tuple[float, int]:
    """(scale, zero point) torch.ao's MinMaxObserver (per-tensor affine, `dtype` quint8 or qint8) picks
    for the range of `x` rounded outward to 8 significant bits."""
    lo, hi = round_outward(float(x.min())), round_outward(float(x.max()))
    obs = MinMaxObserver(dtype=dtype, qscheme=torch.per_tensor_affine)
    obs(torch.tensor([lo, hi], dtype=torch.float32))
    scale, zp = obs.calculate_qparams()
    return float(scale), int(zp)
