"""Quantization analysis: per-layer error between the FP32 and the fake-quantized model."""

from netquant.analysis.layer_error import LayerError, cosine, layer_errors, snr_db
from netquant.analysis.plot import check_plot_target, plot_layer_errors
from netquant.analysis.report import markdown_table, rich_table, worst

__all__ = ["LayerError", "check_plot_target", "cosine", "layer_errors", "markdown_table", "plot_layer_errors",
           "rich_table", "snr_db", "worst"]
