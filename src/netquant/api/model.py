"""QuantizedModel: what quantize_onnx / quantize_torch return."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from netquant.analysis import (
    LayerError,
    SaturationRow,
    check_plot_target,
    cosine,
    layer_errors,
    plot_layer_errors,
    rich_table,
    saturation_report,
    snr_db,
    worst,
)
from netquant.core.int_kernels import Accumulation
from netquant.errors import ConfigError, ExportError
from netquant.export.formats import ExportKind, companions, writer
from netquant.outputs import OutputPlan, absolute, model_files
from netquant.passes.calib_data import CalibrationData
from netquant.passes.quant_graph import QuantizedGraph

if TYPE_CHECKING:
    from netquant.api.placement import Placement


class QuantizedModel:
    """A calibrated model: run it (fake-quant), evaluate it, export it, report per-layer error."""

    def __init__(self, qgraph: QuantizedGraph, source: str = "", timings: dict[str, float] | None = None,
                 calib_data: CalibrationData | None = None, placement: Placement | None = None,
                 inputs: Sequence[str | Path] | None = None) -> None:
        self.qgraph = qgraph
        self.source = source
        if inputs is None:  # the source model file and its external data, when `source` is a file
            inputs = model_files(source) if source and Path(source).is_file() else ()
        # every file the run read, absolute now: export refuses to write any of them, even after os.chdir
        self.input_files: tuple[Path, ...] = tuple(dict.fromkeys(absolute(p) for p in inputs))
        self.timings = dict(timings or {})
        self._calib_data = calib_data
        self.placement = placement  # api.placement: each region's INT8 / float decision and its measurements

    # ---- facts -----------------------------------------------------------------------------
    @property
    def graph(self) -> Any:
        return self.qgraph.graph

    @property
    def platform(self) -> Any:
        return self.qgraph.platform

    @property
    def warnings(self) -> list[str]:
        return self.qgraph.warnings

    def quantized_ops(self) -> list[str]:
        return self.qgraph.quantized_ops()

    def summary(self) -> dict[str, Any]:
        """Counts and timings of this quantization run (timings_s: wall seconds per pass and in total)."""
        types: dict[str, int] = {}
        graph = self.qgraph.graph
        quantized = set(self.quantized_ops())
        for n in graph.nodes:
            if n.name in quantized:
                types[n.op_type] = types.get(n.op_type, 0) + 1
        return {"platform": self.platform.name, "ops": len(graph.nodes), "quantized_ops": len(quantized),
                "quantized_by_type": dict(sorted(types.items())), "timings_s": dict(self.timings),
                "cleanup": dataclasses.asdict(self.qgraph.cleanup),
                "calibration": dataclasses.asdict(self.qgraph.calibration),
                "placement": self.placement.summary() if self.placement is not None else None,
                "warnings": list(self.warnings)}

    def save_placement(self, path: str | Path) -> Path:
        """Write this model's placement file (JSON), re-applied with quantize_onnx(..., placement_from=path)."""
        if self.placement is None:
            raise ConfigError("this model has no placement (quantized with objective=None on a platform placement "
                              "does not measure); nothing to save")
        self._check_output(path, "placement file")
        return self.placement.save(absolute(path))

    def _check_output(self, path: str | Path, what: str) -> None:
        """ExportError before writing `path` when it is a file the quantization read (input_files), a folder, ..."""
        OutputPlan.create([(f"{what} path", absolute(path), what)], inputs=self.input_files, error=ExportError)

    # ---- running ---------------------------------------------------------------------------
    def run(self, inputs: Any, fake_quant: bool = True,
            accumulation: Accumulation | str = Accumulation.EXACT) -> dict[str, torch.Tensor]:
        """Outputs of the fake-quantized model (fake_quant=False: the cleaned-up FP32 model).

        accumulation: how the int8 kernels sum u8 x s8 products: 'exact' (VNNI, ARM64, the ONNX semantics) or
        'pairwise_int16' (onnxruntime on x86 without VNNI); netquant.platforms.targets.host_accumulation()
        is this machine's.
        """
        return self.qgraph.run(inputs, fake_quant=fake_quant, accumulation=Accumulation(accumulation))

    def __call__(self, inputs: Any) -> dict[str, torch.Tensor]:
        return self.run(inputs)

    def evaluate(self, data: Iterable[Any], metric: Callable[[dict[str, torch.Tensor], Any], float] | None = None
                 ) -> dict[str, Any]:
        """Compare FP32 and fake-quant on `data`.

        Without `metric`: data are input batches; returns per-output SNR (dB) and cosine.
        With `metric(outputs, target) -> float`: data are (inputs, target) pairs; returns the mean
        metric for both models ({"fp32": .., "quantized": ..}).
        """
        fp_ex, q_ex = self.qgraph.executor(fake_quant=False), self.qgraph.executor(fake_quant=True)
        if metric is None:
            refs: dict[str, list[torch.Tensor]] = {}
            tests: dict[str, list[torch.Tensor]] = {}
            with torch.no_grad():
                for batch in data:
                    for k, v in fp_ex.run(batch).items():
                        refs.setdefault(k, []).append(v.reshape(-1).float())
                    for k, v in q_ex.run(batch).items():
                        tests.setdefault(k, []).append(v.reshape(-1).float())
            return {k: {"snr_db": snr_db(torch.cat(refs[k]), torch.cat(tests[k])),
                        "cosine": cosine(torch.cat(refs[k]), torch.cat(tests[k]))} for k in refs}
        totals = {"fp32": 0.0, "quantized": 0.0}
        n = 0
        with torch.no_grad():
            for batch, target in data:
                totals["fp32"] += float(metric(fp_ex.run(batch), target))
                totals["quantized"] += float(metric(q_ex.run(batch), target))
                n += 1
        if n == 0:
            raise ConfigError("evaluate needs at least one (inputs, target) pair")
        return {k: v / n for k, v in totals.items()}

    # ---- analysis --------------------------------------------------------------------------
    def layer_report(self, data: Iterable[Any] | None = None, max_batches: int = 1,
                     ops: Sequence[str] | None = None) -> list[LayerError]:
        """Per-op SNR / cosine between FP32 and fake-quant over the first `max_batches` batches.

        data: anything quantize_onnx accepts as calibration data (an array, a dict of arrays, an iterable
        of batches), validated against the model's inputs; default: the kept calibration data.
        """
        return layer_errors(self.qgraph, self._batches(data, max_batches), ops)

    def saturation_report(self, data: Iterable[Any] | None = None, max_batches: int = 1) -> list[SaturationRow]:
        """Per int8-kernel op: where full-range int8 weights would saturate the int16 pair sums of x86 CPUs without
        VNNI (overflow-prone pairs, share of outputs changed, signal/saturation dB), and whether this model's
        weights can (analysis.saturation). data: as layer_report."""
        return saturation_report(self.qgraph, self._batches(data, max_batches))

    def _batches(self, data: Iterable[Any] | None, max_batches: int) -> list[Any]:
        if data is None:
            if self._calib_data is None:
                raise ConfigError("this report needs data (no calibration data kept)")
            data = self._calib_data
        elif not isinstance(data, CalibrationData):
            data = CalibrationData(self.qgraph.graph, data, max_batches=max_batches)
        batches = []
        for i, b in enumerate(data):
            if i >= max_batches:
                break
            batches.append(b)
        return batches

    def print_report(self, data: Iterable[Any] | None = None, top: int = 15) -> list[LayerError]:
        from rich.console import Console

        errors = self.layer_report(data)
        Console().print(rich_table(worst(errors, top), title=f"{top} op outputs with the lowest SNR"))
        return errors

    def plot_report(self, path: str | Path, data: Iterable[Any] | None = None, *, max_batches: int = 1,
                    title: str | None = None, top: int | None = None) -> list[LayerError]:
        """Write the per-layer SNR / cosine plot (PNG, needs matplotlib) of layer_report(data); returns the errors."""
        check_plot_target(path)
        self._check_output(path, "plot")
        errors = self.layer_report(data, max_batches)
        plot_layer_errors(errors, path, top=top, title=title or f"per-layer quantization error: {self.graph.name} "
                                                                f"on {self.platform.name}")
        return errors

    # ---- export ----------------------------------------------------------------------------
    def export(self, path: str | Path, format: ExportKind | str | None = None, *, overwrite: bool = False,
               **kwargs: Any) -> Any:
        """Write the model (ExportKind): ONNX QDQ, quant-params JSON, TensorRT calibration cache, OpenVINO IR,
        TFLite or ncnn. Default: the format the path's suffix asks for (ExportKind.for_path: .onnx ONNX QDQ, .xml
        OpenVINO IR, .tflite TFLite, .param ncnn, .json, .cache; another suffix needs `format`); companion files
        (.bin, .table) go beside it unless given as keywords. ExportError before writing when a path is one of the
        files the quantization read (input_files), or a companion nobody named exists (unless overwrite=True)."""
        if format is None:
            fmt = ExportKind.for_path(path)
        else:
            try:
                fmt = ExportKind(format)
            except ValueError:
                raise ConfigError(f"unknown export format '{format}'; choose one of "
                                  f"{', '.join(f.value for f in ExportKind)}") from None
        path = absolute(path)
        for c in companions(fmt):
            if kwargs.get(c.keyword) is not None:
                kwargs[c.keyword] = absolute(kwargs[c.keyword])
        planned = [("export path", path, f"{fmt.value} file")]
        planned += [(c.what, kwargs.get(c.keyword) or c.default_path(path), c.what, kwargs.get(c.keyword) is not None)
                    for c in companions(fmt)]
        OutputPlan.create(planned, inputs=self.input_files, error=ExportError, overwrite=overwrite,
                          overwrite_hint="overwrite=True")
        return writer(fmt)(self.qgraph, path, **kwargs)

    def __repr__(self) -> str:
        return (f"QuantizedModel({self.source or self.graph.name!r}, platform={self.platform.name}, "
                f"{len(self.quantized_ops())}/{len(self.graph.nodes)} ops quantized)")
