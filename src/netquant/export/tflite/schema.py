"""The TFLite flatbuffer schema (object API) that ai-edge-litert ships, imported on demand."""

from __future__ import annotations

from types import ModuleType

from netquant.errors import ExportError

INSTALL_HINT = "pip install 'netquant[tflite]' (ai-edge-litert and flatbuffers)"


def schema() -> ModuleType:
    """ai_edge_litert.schema_py_generated; ExportError naming the extra to install when it is missing."""
    try:
        import flatbuffers  # noqa: F401
        from ai_edge_litert import schema_py_generated
    except ImportError as exc:
        raise ExportError(f"writing a .tflite file needs the TFLite schema and LiteRT to check the file: "
                          f"{INSTALL_HINT}; ({exc})") from exc
    return schema_py_generated


def interpreter_class() -> type:
    """ai_edge_litert.interpreter.Interpreter (ExportError when missing)."""
    try:
        from ai_edge_litert.interpreter import Interpreter
    except ImportError as exc:
        raise ExportError(f"validating a .tflite file needs LiteRT: {INSTALL_HINT}; ({exc})") from exc
    return Interpreter


def litert_version() -> str:
    try:
        from importlib.metadata import version

        return version("ai-edge-litert")
    except Exception:  # pragma: no cover - metadata missing
        return "?"
