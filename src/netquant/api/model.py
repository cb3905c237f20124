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
    markdown_table,
    plot_layer_errors,
    rich_table,
    saturation_markdown,
    saturation_report,
    snr_db,
    worst,
)
from netquant.analysis.html_report import (
    EngineFacts,
    HostFacts,
    ModelFacts,
    PlatformFacts,
    ReportData,
    file_sha256,
    write_html_report,
)
from netquant.api.float_result import (
    FloatGroup,
    FloatPolicy,
    Int8Share,
    check_float_result,
    float_groups,
    int8_share,
)
from netquant.atomic import write_text_atomic
from netquant.core.int_kernels import Accumulation
from netquant.errors import ConfigError, ExportError
from netquant.export.fidelity import DEFAULT_MIN_COSINE, EngineComparison
from netquant.export.formats import ExportKind, companions, writer
from netquant.outputs import OutputPlan, absolute, model_files
from netquant.passes.calib_data import CalibrationData
from netquant.passes.progress import make_progress
from netquant.passes.quant_graph import QuantizedGraph
from netquant.platforms.threads import thread_scope

if TYPE_CHECKING:
    from netquant.analysis.placement import Placement


MODEL_FILES = (ExportKind.QDQ, ExportKind.OPENVINO_IR, ExportKind.TFLITE, ExportKind.NCNN)


class QuantizedModel:
    """A calibrated model: run it (fake-quant), evaluate it, export it, report per-layer error.

    progress: exports show a progress line while they write and check the file (quantize_onnx sets it unless
    quiet)."""

    progress: bool = False

    def __init__(self, qgraph: QuantizedGraph, source: str = "", timings: dict[str, float] | None = None,
                 calib_data: CalibrationData | None = None, placement: Placement | None = None,
                 min_cosine: float | None = None, float_policy: FloatPolicy | None = None,
                 inputs: Sequence[str | Path] | None = None) -> None:
        self.qgraph = qgraph
        self.source = source
        if inputs is None:  # the source model file and its external data, when `source` is a file
            inputs = model_files(source) if source and Path(source).is_file() else ()
        # every file the run read, absolute now: export refuses to write any of them, even after os.chdir
        self.input_files: tuple[Path, ...] = tuple(dict.fromkeys(absolute(p) for p in inputs))
        self.timings = dict(timings or {})
        self._calib_data = calib_data
        self.placement = placement  # analysis.placement: each region's INT8 / float decision and its measurements
        self.threads: int | None = None  # intra-op threads quantization ran with (platforms.threads); export reuses it
        self.rank = 0  # torch.distributed rank of a distributed=True run (only rank 0 writes files)
        self.last_export: tuple[Path, Any] | None = None  # (path, exporter's report) of the latest export
        # exports are refused below this output cosine vs FP32 in their engine (None: fidelity.DEFAULT_MIN_COSINE)
        self.min_cosine = DEFAULT_MIN_COSINE if min_cosine is None else min_cosine
        self.vs_fp32: list[EngineComparison] = []  # each validated model export: the file in its engine vs FP32
        self.float_policy = float_policy if float_policy is not None else FloatPolicy()  # api.float_result

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
        share = self.int8_share()
        return {"platform": self.platform.name, "ops": len(graph.nodes), "quantized_ops": len(quantized),
                "quantized_by_type": dict(sorted(types.items())), "timings_s": dict(self.timings),
                "cleanup": dataclasses.asdict(self.qgraph.cleanup),
                "calibration": dataclasses.asdict(self.qgraph.calibration),
                "placement": self.placement.summary() if self.placement is not None else None,
                "int8_regions": {"int8": share.int8, "total": share.total, "fraction": share.fraction,
                                 "float_file": share.int8 == 0},
                "float_reasons": [dataclasses.asdict(g) for g in self.float_groups()],
                "vs_fp32": [c.as_dict() for c in self.vs_fp32],
                "warnings": list(self.warnings)}

    def check_float(self, where: str) -> Int8Share:
        """FloatResultError naming `where` when this result is float and its float_policy does not allow it."""
        return check_float_result(self.qgraph, self.placement, self.float_policy, where)

    def int8_share(self) -> Int8Share:
        """Regions running in INT8 (or the platform's wider format) out of all quantizable regions."""
        return int8_share(self.qgraph, self.placement)

    def float_groups(self) -> list[FloatGroup]:
        """Why regions stay float, grouped by reason and kind of op (api.float_result)."""
        return float_groups(self.qgraph, self.placement)

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

    def report(self, path: str | Path, data: Iterable[Any] | None = None, *, max_batches: int = 1,
               title: str | None = None, export: Any = None, output: str | Path | None = None) -> Path:
        """Write a report of this model by the path's suffix: .html one self-contained page (model, CPU, engine
        validation, FP32 vs INT8, placement, per-layer SNR / cosine chart, saturation), .md the markdown tables
        (markdown_report), .png the per-layer plot (plot_report; needs matplotlib).

        data / max_batches: the batches of the per-layer and saturation tables (default: the first calibration batch).
        export / output: an exporter's report and the file it wrote (default: this model's latest export()).
        The model file is never overwritten (ExportError); the file is written whole or not at all.
        """
        suffix = Path(path).suffix.lower()
        if suffix not in (".html", ".htm", ".png", ".md"):
            raise ConfigError(f"report '{path}': unknown extension '{suffix or '(none)'}'; use .html for the "
                              "report page, .md for the markdown tables or .png for the per-layer plot")
        source = Path(self.source) if self.source and Path(self.source).is_file() else None
        OutputPlan.create([("report path", path, "report")], inputs=model_files(source) if source else (),
                          error=ExportError)
        default_title = f"per-layer quantization error: {source.name if source else self.graph.name} on " \
                        f"{self.platform.name}"
        if suffix == ".png":
            self.plot_report(path, data, max_batches=max_batches, title=title or default_title)
            return Path(path)
        if suffix == ".md":
            return write_text_atomic(path, self.markdown_report(title or default_title, data, max_batches),
                                     "per-layer report")
        if export is None and self.last_export is not None:
            output, export = self.last_export
        return write_html_report(self._report_data(data, max_batches, title, export, output), path)

    def markdown_report(self, title: str, data: Iterable[Any] | None = None, max_batches: int = 1) -> str:
        """The .md report: the written files vs FP32 in their engines, per-layer SNR / cosine table, placement decisions,
        int16 pair saturation."""
        batches = self._batches(data, max_batches)
        text = f"# {title}\n\n"
        for c in self.vs_fp32:  # each written file in its engine (export.fidelity)
            text += f"## FP32 vs INT8 in {c.engine}\n\n" + c.markdown() + "\n"
        text += ("## Per layer\n\nFP32 vs fake-quant output of every op on the first calibration batch; "
                 "SNR dB = 10 log10(sum x^2 / sum (x - x_q)^2).\n\n" + markdown_table(layer_errors(self.qgraph, batches)))
        if self.placement is not None:
            timed = any(r.int8_ms is not None for r in self.placement.regions) or \
                "source_fp32_wall_ms" in self.placement.measured
            how = ("Measured in onnxruntime on this machine (batch 1, one thread, per-node medians; each region's time "
                   "includes its Q/DQ and layout glue). A region stays float when it runs slower in INT8 or when the "
                   "accuracy budget needs it." if timed else
                   "Speed is not measured for this platform's engine here: a region leaves the platform's format only "
                   "when the accuracy budget needs it, for the platform's wider integer format first where it has one "
                   "(decision 'wider'), else float.")
            own = self.platform.format_label()
            wider = self.platform.wider is not None
            text += (f"\n## Placement: {own + ', wider integer' if wider else own} or float per region\n\n" + how
                     + "\n\n" + self.placement.markdown())
        if self.platform.cpu_target is not None:
            text += ("\n## int16 pair saturation on x86 CPUs without VNNI\n\nPer int8-kernel op, on the first "
                     "calibration batch: weight pairs whose products can overflow onnxruntime's int16 pair sums with "
                     "full-range int8 weights (`--target x86-vnni`) and with this file's weights (CPU target "
                     f"'{self.platform.cpu_target.value}'), the share of outputs full-range weights change there, and "
                     "the signal/saturation ratio.\n\n" + saturation_markdown(saturation_report(self.qgraph, batches)))
        return text

    def _report_data(self, data: Iterable[Any] | None, max_batches: int, title: str | None, export: Any,
                     output: str | Path | None) -> ReportData:
        from netquant.platforms.targets import host_info, kernel_family

        source = Path(self.source) if self.source and Path(self.source).is_file() else None
        summary = self.summary()
        batches = self._batches(data, max_batches)
        platform = self.platform
        info = host_info()
        return ReportData(
            title=title or f"netquant report: {source.name if source else self.graph.name} on {platform.name}",
            model=ModelFacts(path=str(source.resolve()) if source else (self.source or self.graph.name),
                             sha256=file_sha256(source) if source else None, ops=summary["ops"],
                             quantized_ops=summary["quantized_ops"], quantized_by_type=summary["quantized_by_type"]),
            host=HostFacts(cpu=info.cpu.describe(), target=info.target.value,
                           kernel_family=f"{info.accumulation.value}: {kernel_family(info.accumulation, info.cpu)}"),
            platform=PlatformFacts(name=platform.name, scheme=platform.scheme(),
                                   cpu_target=platform.cpu_target.value if platform.cpu_target else None,
                                   weight_scheme=platform.weight_scheme.value if platform.weight_scheme else None,
                                   wider=platform.wider.label if platform.wider else None),
            summary=summary, layers=layer_errors(self.qgraph, batches),
            saturation=saturation_report(self.qgraph, batches) if platform.cpu_target is not None else None,
            engine=EngineFacts.from_export(export, output) if export is not None else None)

    # ---- export ----------------------------------------------------------------------------
    def export(self, path: str | Path, format: ExportKind | str | None = None, *, overwrite: bool = False,
               **kwargs: Any) -> Any:
        """Write the model (ExportKind): ONNX QDQ, quant-params JSON, TensorRT calibration cache, OpenVINO IR,
        TFLite or ncnn. Default: the format the path's suffix asks for (ExportKind.for_path: .onnx ONNX QDQ, .xml
        OpenVINO IR, .tflite TFLite, .param ncnn, .json, .cache; another suffix needs `format`); companion files
        (.bin, .table) go beside it unless given as keywords. ExportError before writing when a path is one of the
        files the quantization read (input_files), or a companion nobody named exists (unless overwrite=True).
        Model files: FloatResultError when no region runs in INT8 (allow_float=True writes it anyway), ExportError when
        an output is below min_fp32_cosine vs FP32 in the engine (default: quantize_onnx's min_cosine); the comparison
        is kept in self.vs_fp32 and summary()["vs_fp32"].
        tensorrt_int8's ONNX QDQ file comes with its calibration cache, as the CLI's: trt_cache= its path (default the
        path with suffix .cache; False: none). On ranks other than 0 of a distributed run nothing is written (None
        is returned)."""
        if self.rank != 0:
            return None
        if format is None:
            fmt = ExportKind.for_path(path)
        else:
            try:
                fmt = ExportKind(format)
            except ValueError:
                raise ConfigError(f"unknown export format '{format}'; choose one of "
                                  f"{', '.join(f.value for f in ExportKind)}") from None
        path = absolute(path)
        cache = self._trt_cache(path, fmt, kwargs.pop("trt_cache", None))
        for c in companions(fmt):
            if kwargs.get(c.keyword) is not None:
                kwargs[c.keyword] = absolute(kwargs[c.keyword])
        planned = [("export path", path, f"{fmt.value} file")]
        planned += [(c.what, kwargs.get(c.keyword) or c.default_path(path), c.what, kwargs.get(c.keyword) is not None)
                    for c in companions(fmt)]
        planned += [("trt_cache", absolute(cache), "TensorRT calibration cache", False)] if cache is not None else []
        OutputPlan.create(planned, inputs=self.input_files, error=ExportError, overwrite=overwrite,
                          overwrite_hint="overwrite=True")
        with make_progress(not self.progress) as shown, shown.stage(f"export: {Path(path).name}"), \
                thread_scope(self.threads):  # validation in the engine: the threads quantization chose
            report = self.write(fmt, path, **kwargs)
        if cache is not None:
            self.export(cache, format=ExportKind.TENSORRT_CACHE, overwrite=True)  # planned (and checked) above
        return report

    def write(self, fmt: ExportKind, path: str | Path, **kwargs: Any) -> Any:
        """The writer of `fmt` without export's output checks (the CLI stages its files itself). Model files: refused
        when the result is float (api.float_result; allow_float=True accepts it), or below min_fp32_cosine (default
        self.min_cosine) vs FP32 in their engine; their comparison is kept in self.vs_fp32. The quant-params JSON
        carries the comparisons made so far."""
        allow = kwargs.pop("allow_float", None)
        if fmt in MODEL_FILES:
            policy = self.float_policy if allow is None else dataclasses.replace(self.float_policy, allow_float=allow)
            check_float_result(self.qgraph, self.placement, policy, f"{self.source or self.graph.name} -> {path}")
            kwargs.setdefault("min_fp32_cosine", self.min_cosine)
        elif fmt is ExportKind.JSON:
            kwargs.setdefault("vs_fp32", [c.as_dict() for c in self.vs_fp32])
        report = writer(fmt)(self.qgraph, path, **kwargs)
        self.last_export = (Path(path), report)
        comparison = getattr(report, "vs_fp32", None)
        if comparison is not None:
            self.vs_fp32.append(comparison)
        return report

    def _trt_cache(self, path: str | Path, format: ExportKind | str | None, given: str | Path | bool | None
                   ) -> Path | None:
        """Where an ONNX export for tensorrt_int8 writes its calibration cache (None: no cache)."""
        if given is False or self.platform.name != "tensorrt_int8" or format not in (None, ExportKind.QDQ, "qdq") \
                or ExportKind.for_path(path) is not ExportKind.QDQ:
            return None
        cache = Path(path).with_suffix(".cache") if given in (None, True) else Path(given)
        return None if cache == Path(path) else cache

    def __repr__(self) -> str:
        return (f"QuantizedModel({self.source or self.graph.name!r}, platform={self.platform.name}, "
                f"{len(self.quantized_ops())}/{len(self.graph.nodes)} ops quantized)")
