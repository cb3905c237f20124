"""ncnn's .bin weight file: where each layer's arrays lie, reading them, and rewriting the file.

The .bin has no index: each layer's load_model reads its arrays in turn (ncnn src/modelbin.cpp). ModelBin::load(w, 0)
reads a 4-byte tag first: 0 = float32 (w * 4 bytes), 0x01306B47 = float16 (w * 2 bytes, padded to 4),
0x000D4B38 = int8 (w bytes, padded to 4), 0x0002C056 = float32; another non-zero tag = 256 float32 codebook values
plus w uint8 indices (padded to 4). ModelBin::load(w, 1) reads w float32 values, no tag.
LAYOUTS gives each layer type's arrays (from its load_model); layers not listed read nothing, and the walk checks
that the arrays end exactly at the end of the file.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from netquant.errors import ExportError
from netquant.export.ncnn.param import NcnnLayer, NcnnParam

TAG_FLOAT32 = 0x00000000
TAG_FLOAT16 = 0x01306B47
TAG_INT8 = 0x000D4B38
TAG_FLOAT32_RAW = 0x0002C056


@dataclass(frozen=True)
class ArraySpec:
    """One array a layer loads: its name, element count and whether it starts with a tag (ModelBin type 0)."""

    name: str
    count: int
    tagged: bool


@dataclass(frozen=True)
class Segment:
    """One array as it lies in the file."""

    layer: str
    layer_type: str
    name: str
    count: int
    tagged: bool
    offset: int
    nbytes: int


def _align4(n: int) -> int:
    return (n + 3) // 4 * 4


def _p(layer: NcnnLayer, key: int, default: int = 0) -> int:
    return layer.int_param(key, default)


def _conv(layer: NcnnLayer) -> list[ArraySpec]:
    """Convolution(1D/3D), ConvolutionDepthWise(1D/3D), Deconvolution*: weight, bias, int8 scales."""
    if _p(layer, 19):  # dynamic_weight: weights come from a second input blob
        return []
    out = [ArraySpec("weight", _p(layer, 6), True)]
    num_output = _p(layer, 0)
    if _p(layer, 5):
        out.append(ArraySpec("bias", num_output, False))
    term = _p(layer, 8)
    if term:
        if layer.type.startswith("ConvolutionDepthWise"):
            group = _p(layer, 7, 1)
            out.append(ArraySpec("weight_scales", group if term in (1, 101) else 1, False))
        else:
            out.append(ArraySpec("weight_scales", num_output, False))
        out.append(ArraySpec("bottom_scales", 1, False))
        if term > 100:
            out.append(ArraySpec("top_scales", 1, False))
    return out


def _innerproduct(layer: NcnnLayer) -> list[ArraySpec]:
    out = [ArraySpec("weight", _p(layer, 2), True)]
    if _p(layer, 1):
        out.append(ArraySpec("bias", _p(layer, 0), False))
    if _p(layer, 8):
        out += [ArraySpec("weight_scales", _p(layer, 0), False), ArraySpec("bottom_scales", 1, False)]
    return out


def _gemm(layer: NcnnLayer) -> list[ArraySpec]:
    m, n, k = _p(layer, 7), _p(layer, 8), _p(layer, 9)
    out = []
    if _p(layer, 4):
        out.append(ArraySpec("A", m * k, True))
    if _p(layer, 5):
        out.append(ArraySpec("B", n * k, True))
    broadcast = _p(layer, 10)
    if _p(layer, 6) and broadcast != -1:
        out.append(ArraySpec("C", {0: 1, 1: m, 2: m, 3: m * n, 4: n}[broadcast], True))
    if _p(layer, 18):
        if _p(layer, 4):
            out.append(ArraySpec("A_scales", m, False))
        if _p(layer, 5):
            out.append(ArraySpec("B_scale", 1, False))
    return out


def _mha(layer: NcnnLayer) -> list[ArraySpec]:
    embed = _p(layer, 0)
    qdim = _p(layer, 2) // max(1, embed)
    kdim, vdim = _p(layer, 3, embed), _p(layer, 4, embed)
    out = [ArraySpec("q_weight", embed * qdim, True), ArraySpec("q_bias", embed, False),
           ArraySpec("k_weight", embed * kdim, True), ArraySpec("k_bias", embed, False),
           ArraySpec("v_weight", embed * vdim, True), ArraySpec("v_bias", embed, False),
           ArraySpec("out_weight", qdim * embed, True), ArraySpec("out_bias", qdim, False)]
    if _p(layer, 18):
        out += [ArraySpec("q_scales", embed, False), ArraySpec("k_scales", embed, False),
                ArraySpec("v_scales", embed, False), ArraySpec("out_scale", 1, False)]
    return out


def _affine(count_key: int, affine_key: int, arrays: tuple[str, ...] = ("gamma", "beta")) -> Callable[
        [NcnnLayer], list[ArraySpec]]:
    def specs(layer: NcnnLayer) -> list[ArraySpec]:
        if not _p(layer, affine_key, 1):
            return []
        return [ArraySpec(a, _p(layer, count_key), False) for a in arrays]
    return specs


def _memorydata(layer: NcnnLayer) -> list[ArraySpec]:
    w, h, d, c = _p(layer, 0), _p(layer, 1), _p(layer, 11), _p(layer, 2)
    count = max(w, 1) * max(h, 1) * max(d, 1) * max(c, 1)
    return [ArraySpec("data", count, _p(layer, 21, 1) == 0)]


def _scale(layer: NcnnLayer) -> list[ArraySpec]:
    size = _p(layer, 0)
    out = [] if size == -233 else [ArraySpec("scale", size, False)]
    if _p(layer, 1):
        out.append(ArraySpec("bias", abs(size), False))
    return out


def _embed(layer: NcnnLayer) -> list[ArraySpec]:
    out = [ArraySpec("weight", _p(layer, 3), True)]
    if _p(layer, 2):
        out.append(ArraySpec("bias", _p(layer, 0), False))
    if _p(layer, 18):
        out.append(ArraySpec("weight_scale", 1, False))
    return out


def _batchnorm(layer: NcnnLayer) -> list[ArraySpec]:
    c = _p(layer, 0)
    return [ArraySpec(a, c, False) for a in ("slope", "mean", "var", "bias")]


LAYOUTS: dict[str, Callable[[NcnnLayer], list[ArraySpec]]] = {
    **{t: _conv for t in ("Convolution", "Convolution1D", "Convolution3D", "ConvolutionDepthWise",
                          "ConvolutionDepthWise1D", "ConvolutionDepthWise3D", "Deconvolution", "Deconvolution1D",
                          "Deconvolution3D", "DeconvolutionDepthWise", "DeconvolutionDepthWise1D",
                          "DeconvolutionDepthWise3D")},
    "InnerProduct": _innerproduct,
    "Gemm": _gemm,
    "MultiHeadAttention": _mha,
    "BatchNorm": _batchnorm,
    "Scale": _scale,
    "Bias": lambda layer: [ArraySpec("bias", _p(layer, 0), False)],
    "PReLU": lambda layer: [ArraySpec("slope", _p(layer, 0), False)],
    "LayerNorm": _affine(0, 2),
    "GroupNorm": _affine(1, 3),
    "InstanceNorm": _affine(0, 2),
    "RMSNorm": _affine(0, 2, ("gamma",)),
    "MemoryData": _memorydata,
    "Embed": _embed,
}
KNOWN_DYNAMIC = {"RNN", "LSTM", "GRU"}  # weights depend on params this module does not model


def layer_arrays(layer: NcnnLayer) -> list[ArraySpec]:
    """The arrays `layer` loads from the .bin, in order (ExportError for recurrent layers)."""
    if layer.type in KNOWN_DYNAMIC:
        raise ExportError(f"ncnn layer '{layer.name}' ({layer.type}): its weight layout is not modelled; "
                          "netquant's ncnn export handles convolution / fully-connected models")
    fn = LAYOUTS.get(layer.type)
    return fn(layer) if fn is not None else []


def _tagged_size(data: bytes, offset: int, count: int, where: str) -> int:
    if offset + 4 > len(data):
        raise ExportError(f"{where}: the .bin ends before its tag")
    tag = struct.unpack_from("<I", data, offset)[0]
    if tag == TAG_FLOAT16:
        return 4 + _align4(2 * count)
    if tag == TAG_INT8:
        return 4 + _align4(count)
    if tag in (TAG_FLOAT32, TAG_FLOAT32_RAW):
        return 4 + 4 * count
    if sum(data[offset:offset + 4]) != 0:  # codebook-quantized
        return 4 + 256 * 4 + _align4(count)
    return 4 + 4 * count


def walk(param: NcnnParam, data: bytes, where: str = "ncnn model") -> list[Segment]:
    """Every array of every layer with its place in `data`; ExportError unless they cover the file exactly."""
    segments = []
    offset = 0
    for layer in param.layers:
        for spec in layer_arrays(layer):
            label = f"{where}: layer '{layer.name}' ({layer.type}) array '{spec.name}'"
            nbytes = _tagged_size(data, offset, spec.count, label) if spec.tagged else 4 * spec.count
            if offset + nbytes > len(data):
                raise ExportError(f"{label} runs past the end of the .bin ({offset + nbytes} > {len(data)} bytes)")
            segments.append(Segment(layer.name, layer.type, spec.name, spec.count, spec.tagged, offset, nbytes))
            offset += nbytes
    if offset != len(data):
        unknown = sorted({la.type for la in param.layers if la.type not in LAYOUTS})
        raise ExportError(f"{where}: the layers' arrays take {offset} bytes but the .bin has {len(data)}; a layer "
                          f"type with weights is not modelled (types without a layout here: {', '.join(unknown)})")
    return segments


def decode(segment: Segment, data: bytes) -> np.ndarray:
    """The array's values: float32 for float tags, int8 for the int8 tag."""
    o, n = segment.offset, segment.count
    if not segment.tagged:
        return np.frombuffer(data, "<f4", n, o).copy()
    tag = struct.unpack_from("<I", data, o)[0]
    if tag == TAG_FLOAT16:
        return np.frombuffer(data, "<f2", n, o + 4).astype(np.float32)
    if tag == TAG_INT8:
        return np.frombuffer(data, np.int8, n, o + 4).copy()
    if tag in (TAG_FLOAT32, TAG_FLOAT32_RAW) or sum(data[o:o + 4]) == 0:
        return np.frombuffer(data, "<f4", n, o + 4).copy()
    table = np.frombuffer(data, "<f4", 256, o + 4)
    return table[np.frombuffer(data, np.uint8, n, o + 4 + 1024)].astype(np.float32)


def encode_int8(values: np.ndarray) -> bytes:
    """A tagged int8 array (ModelBin type 0): the int8 tag, the values, zero padding to 4 bytes."""
    raw = np.ascontiguousarray(values, dtype=np.int8).tobytes()
    return struct.pack("<I", TAG_INT8) + raw + b"\0" * (_align4(len(raw)) - len(raw))


def encode_float32(values: np.ndarray) -> bytes:
    """An untagged float32 array (ModelBin type 1)."""
    return np.ascontiguousarray(values, dtype="<f4").tobytes()
