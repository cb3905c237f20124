"""netquant.export.ncnn: ncnn int8 models (.param + .bin) and ncnn's int8 calibration table, validated in ncnn.

Needs the optional engine: `pip install netquant[ncnn]` (ncnn + pnnx).
"""

from netquant.export.ncnn.export import NcnnExportReport, export_ncnn, int8_layers_of
from netquant.export.ncnn.int8 import Int8Layer, ncnn_scale
from netquant.export.ncnn.modelbin import decode, walk
from netquant.export.ncnn.param import NcnnParam, parse_param, read_param
from netquant.export.ncnn.table import parse_table, table_text

__all__ = [
    "Int8Layer",
    "NcnnExportReport",
    "NcnnParam",
    "decode",
    "export_ncnn",
    "int8_layers_of",
    "ncnn_scale",
    "parse_param",
    "parse_table",
    "read_param",
    "table_text",
    "walk",
]
