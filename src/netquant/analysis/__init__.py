"""Quantization analysis: per-layer error between the FP32 and the fake-quantized model."""

from netquant.analysis.layer_error import LayerError, cosine, layer_errors, snr_db
from netquant.analysis.plot import check_plot_target, plot_layer_errors
from netquant.analysis.report import markdown_table, rich_table, saturation_markdown, worst
from netquant.analysis.saturation import SaturationRow, saturation_report

__all__ = ["LayerError", "SaturationRow", "saturation_report", "check_plot_target", "cosine", "layer_errors", "markdown_table", "plot_layer_errors",
           "rich_table", "saturation_markdown", "snr_db", "worst"]
