"""One exception hierarchy for every layer of netquant.

Every message names the file, op, tensor or setting at fault and says what to do.
"""

from __future__ import annotations


class NetquantError(Exception):
    """Base of every error netquant raises on purpose."""


class ConfigError(NetquantError, ValueError):
    """A spec, setting, platform or rule is invalid or inconsistent."""


class DataError(NetquantError, ValueError):
    """Input data is unusable: NaN/Inf, wrong shape or dtype, empty set."""


class CalibrationError(DataError):
    """Calibration cannot produce params (no data seen, empty calibration set)."""


class ModelError(NetquantError):
    """A model file or graph is malformed: bad protobuf, missing initializer, cycle."""


class UnsupportedOpError(ModelError, NotImplementedError):
    """An op type, attribute or opset is not supported; names op type, node and opset."""


class ExportError(NetquantError):
    """An export could not be produced or failed validation; no file was written."""


class FloatResultError(ExportError):
    """Quantization left no region (or too few) in INT8: the file would be the float model under an INT8 name."""
