"""netquant: quantize neural networks for real inference engines."""

from netquant.errors import (
    CalibrationError,
    ConfigError,
    DataError,
    ExportError,
    ModelError,
    NetquantError,
    UnsupportedOpError,
)

__version__ = "0.1.0"

__all__ = [
    "CalibrationError",
    "ConfigError",
    "DataError",
    "ExportError",
    "ModelError",
    "NetquantError",
    "UnsupportedOpError",
    "__version__",
]
