"""ncnn's text .param format: read, edit, write.

Layout (ncnn src/net.cpp load_param): the magic line `7767517`, then `<layer count> <blob count>`, then one line per
layer: `<type> <name> <bottom count> <top count> <bottom blobs...> <top blobs...> <id>=<value>...`. A value is an int,
a float (has '.' or 'e'), a quoted string, or an array when the id is -23300 - k: `<-23300-k>=<n>,<v1>,...,<vn>`.
Values are kept as the text ncnn reads, so an unedited file is written back byte for byte (up to spacing).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from netquant.errors import ExportError

MAGIC = "7767517"
_TOKEN = re.compile(r'"[^"]*"|\S+')
_SAFE_NAME = re.compile(r"^[^\s\"=]{1,255}$")


@dataclass
class NcnnLayer:
    """One layer line: type, name, bottom and top blob names, and its params (id -> value text, in order)."""

    type: str
    name: str
    bottoms: list[str]
    tops: list[str]
    params: dict[int, str] = field(default_factory=dict)

    def int_param(self, key: int, default: int = 0) -> int:
        text = self.params.get(key)
        if text is None:
            return default
        try:
            return int(text)
        except ValueError:
            raise ExportError(f"ncnn layer '{self.name}' ({self.type}): param {key}={text} is not an integer") from None

    def float_param(self, key: int, default: float = 0.0) -> float:
        text = self.params.get(key)
        return default if text is None else float(text)

    def line(self) -> str:
        fields = [f"{self.type:<24}", f"{self.name:<24}", str(len(self.bottoms)), str(len(self.tops)),
                  *self.bottoms, *self.tops, *(f"{k}={v}" for k, v in self.params.items())]
        return " ".join(fields)


@dataclass
class NcnnParam:
    """A whole .param file."""

    layers: list[NcnnLayer]

    @property
    def blob_names(self) -> list[str]:
        """Every blob, each once, in the order layers produce them."""
        names: dict[str, None] = {}
        for layer in self.layers:
            for t in layer.tops:
                names[t] = None
        return list(names)

    def layer(self, name: str) -> NcnnLayer:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise ExportError(f"no ncnn layer named '{name}'")

    @property
    def input_blobs(self) -> list[str]:
        return [t for layer in self.layers if layer.type == "Input" for t in layer.tops]

    def output_blobs(self) -> list[str]:
        """Blobs no layer consumes (the net's outputs), in order."""
        used = {b for layer in self.layers for b in layer.bottoms}
        return [b for b in self.blob_names if b not in used]

    def rename_blob(self, old: str, new: str) -> None:
        if not _SAFE_NAME.match(new):
            raise ExportError(f"'{new}' cannot name an ncnn blob (spaces, quotes, '=' or over 255 characters)")
        if new in self.blob_names and new != old:
            raise ExportError(f"ncnn blob name '{new}' is taken")
        for layer in self.layers:
            layer.bottoms = [new if b == old else b for b in layer.bottoms]
            layer.tops = [new if t == old else t for t in layer.tops]

    def text(self) -> str:
        lines = [MAGIC, f"{len(self.layers)} {len(self.blob_names)}", *(layer.line() for layer in self.layers)]
        return "\n".join(lines) + "\n"


def can_name_blob(name: str) -> bool:
    """Whether `name` is a valid ncnn blob name (ncnn reads names with %255s)."""
    return bool(_SAFE_NAME.match(name))


def parse_param(text: str, where: str = "ncnn param") -> NcnnParam:
    """Parse .param text; ExportError naming the line when it is malformed."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines or lines[0] != MAGIC:
        raise ExportError(f"{where}: not an ncnn param file (first line must be {MAGIC})")
    try:
        layer_count, _blob_count = (int(v) for v in lines[1].split())
    except (IndexError, ValueError):
        raise ExportError(f"{where}: second line must be '<layer count> <blob count>'") from None
    layers = []
    for number, line in enumerate(lines[2:], start=3):
        tokens = _TOKEN.findall(line)
        try:
            ltype, name, nb, nt = tokens[0], tokens[1], int(tokens[2]), int(tokens[3])
            bottoms, tops = tokens[4:4 + nb], tokens[4 + nb:4 + nb + nt]
            params: dict[int, str] = {}
            for tok in tokens[4 + nb + nt:]:
                key, value = tok.split("=", 1)
                params[int(key)] = value
        except (IndexError, ValueError):
            raise ExportError(f"{where}: line {number} is not a layer line: {shlex.quote(line[:120])}") from None
        if len(bottoms) != nb or len(tops) != nt:
            raise ExportError(f"{where}: line {number} lists fewer blobs than it declares")
        layers.append(NcnnLayer(ltype, name, bottoms, tops, params))
    if len(layers) != layer_count:
        raise ExportError(f"{where}: declares {layer_count} layers but has {len(layers)}")
    return NcnnParam(layers)


def read_param(path: str | Path) -> NcnnParam:
    return parse_param(Path(path).read_text(encoding="utf-8"), str(path))
