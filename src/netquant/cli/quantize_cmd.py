"""`netquant quantize MODEL.onnx --platform NAME --calib PATH -o OUT.onnx`."""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.console import Console
from rich.table import Table

from netquant.cli.common import friendly_errors, quantize_quietly, warn
from netquant.data.calib import (
    ChannelOrder,
    ImageOptions,
    Layout,
    calibration_files,
    index_limits,
    load_calibration,
    model_inputs,
    sample_count,
    split_batches,
)
from netquant.errors import ConfigError
from netquant.export.fidelity import DEFAULT_MIN_COSINE
from netquant.outputs import OutputPlan, model_files
from netquant.passes.progress import make_progress

if TYPE_CHECKING:
    from netquant.api.model import QuantizedModel

REPORT_SUFFIXES = (".md", ".png", ".html", ".htm")


def _floats(text: str | None, what: str) -> tuple[float, ...] | None:
    if text is None:
        return None
    try:
        values = tuple(float(v) for v in text.replace(" ", "").split(",") if v)
    except ValueError:
        raise ConfigError(f"--{what} must be comma-separated numbers like 0.485,0.456,0.406; got '{text}'") from None
    if not all(math.isfinite(v) for v in values):
        raise ConfigError(f"--{what} '{text}' contains NaN or Inf; give finite numbers like 0.485,0.456,0.406")
    return values


def _check_report_path(path: Path | None) -> None:
    """Before calibrating: the --report extension is known (and matplotlib is there for .png)."""
    if path is None:
        return
    if path.suffix.lower() not in REPORT_SUFFIXES:
        raise ConfigError(f"--report '{path}': unknown extension '{path.suffix or '(none)'}'; use .md for a "
                          "markdown table, .png for a plot or .html for the full report page")
    if path.suffix.lower() == ".png":
        from netquant.analysis import check_plot_target

        check_plot_target(path)


def write_layer_report(qmodel: QuantizedModel, path: Path, title: str, export: object = None,
                       output: Path | None = None) -> Path:
    """--report: .md per-layer SNR / cosine table (FP32 vs fake-quant, first calibration batch) with placement and
    saturation, .png plot, .html the whole report page with the export's engine results (QuantizedModel.report)."""
    if path.suffix.lower() in (".html", ".htm"):
        return qmodel.report(path, export=export, output=output)
    return qmodel.report(path, title=title)


def _placement_line(qmodel: QuantizedModel) -> str:
    """One line for the summary: regions in INT8 / float (saying 'float' where none is INT8), the measured latency,
    and why regions stay float, grouped."""
    from netquant.api.float_result import float_words

    p = qmodel.placement
    if p is None:
        return ""
    n8 = sum(r.decision == "int8" for r in p.regions)
    wide = sum(r.decision == "wider" for r in p.regions)
    float_file = qmodel.int8_share().int8 == 0
    m = p.measured
    times = (f"; measured here {m['fp32_ms']:.2f} ms FP32 -> {m['placed_ms']:.2f} ms placed "
             f"(all INT8 {m['all_int8_ms']:.2f} ms)") if "placed_ms" in m else ""
    why = float_words(qmodel.float_groups())
    return (f"{p.objective}: {n8} of {len(p.regions)} regions in {qmodel.platform.format_label()}"
            + (f", {wide} in the wider format ({qmodel.platform.wider.label})" if wide and qmodel.platform.wider else "")
            + (": the file runs in float (no INT8 region; any speed-up is graph clean-up's)" if float_file else "")
            + times + (f"; repaired before floating: {p.kept_repair()}" if p.kept_repair() else "")
            + (f"; float because {why}" if why else "")
            + (f"; {p.note}" if p.note else "") + " (details: --report x.md)")


@dataclass
class RunFacts:
    """What the summary table shows."""

    model: Path
    output: Path
    platform: str
    samples: int
    ops_total: int
    ops_quantized: int
    by_type: dict[str, int]
    int8_kernels: dict[str, int] | None
    runtime_qdq: int | None
    fp32_bytes: int
    int8_bytes: int
    opset: str
    cosine: dict[str, float]
    seconds: dict[str, float]
    validated_with: str = ""
    reference_only: bool = False  # the target engine does not run here (TensorRT, QNN, ...)
    cpu_target: str | None = None
    engine: str = "onnxruntime"
    engine_layers: str = ""  # heavy runtime layers running int8 in the engine that validated the file (OpenVINO)
    placement: str = ""
    vs_fp32: str = ""  # the file in its engine vs the FP32 model (export.fidelity.EngineComparison.line)
    extra_files: list[Path] = field(default_factory=list)
    threads: int | None = None  # torch / onnxruntime intra-op threads of the run (platforms.threads)


def host_target() -> str:
    from netquant.platforms.targets import host_info

    return host_info().target.value


def _size(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def summary_table(f: RunFacts) -> Table:
    t = Table(title=f"netquant: {f.model.name} -> {f.output.name}", show_header=False)
    t.add_column("what", style="bold")
    t.add_column("value", overflow="fold")
    t.add_row("platform", f.platform)
    t.add_row("calibration samples", str(f.samples))
    by_type = ", ".join(f"{k} {v}" for k, v in f.by_type.items())
    t.add_row("ops quantized", f"{f.ops_quantized} / {f.ops_total}" + (f" ({by_type})" if by_type else ""))
    kernels = f.int8_kernels
    if kernels is not None or f.engine_layers:  # int8 kernels of the engine that ran the file (none: reference)
        t.add_row(f"int8 layers in {f.engine}" if f.engine_layers else f"int8 kernels in {f.engine}",
                  f.engine_layers or ", ".join(f"{k} x{v}" for k, v in (kernels or {}).items())
                  or f"none: {f.engine} runs this model in float")
    if f.runtime_qdq is not None:
        t.add_row("Q/DQ left at runtime", f"{f.runtime_qdq} (float ops between int8 kernels)")
    t.add_row("file size", f"{_size(f.fp32_bytes)} -> {_size(f.int8_bytes)} "
                           + (f"({f.fp32_bytes / max(1, f.int8_bytes):.1f}x smaller)" if f.int8_bytes <= f.fp32_bytes else
                              f"({f.int8_bytes / max(1, f.fp32_bytes):.1f}x larger: weights the source computes "
                              "at run time are stored as constants)"))
    t.add_row("opset", f.opset)
    if f.cpu_target:
        t.add_row("CPU target", f"{f.cpu_target} (this machine: {host_target()})")
    if f.placement:
        t.add_row("placement", f.placement)
    t.add_row("validated in", (f.validated_with or "-") + (f": {f.platform}'s engine does not run here, so the file "
                                                          "was checked in the Q/DQ reference semantics only"
                                                          if f.reference_only else ""))
    if f.vs_fp32:
        t.add_row("vs FP32", f.vs_fp32)
    t.add_row("agreement with fake-quant", ", ".join(f"{k}: cosine {v:.5f}" for k, v in f.cosine.items()) or "-")
    t.add_row("time", ", ".join(f"{k} {v:.1f}s" for k, v in f.seconds.items())
              + (f" ({f.threads} intra-op thread{'s' if f.threads != 1 else ''})" if f.threads else ""))
    for p in f.extra_files:
        t.add_row("also wrote", str(p))
    return t


@click.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--platform", "platform_name", default="onnxruntime_int8", show_default=True,
              help="Target platform (see `netquant platforms`).")
@click.option("--calib", required=True, help="Folder of images, .npy/.npz file or folder, or 'random'.")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Quantized ONNX (QDQ) file to write; a .xml path writes OpenVINO IR (.xml + .bin; needs "
                   "netquant[openvino]), a .tflite path a TFLite/LiteRT model (NHWC input; netquant[tflite]), a .param "
                   "path an ncnn int8 model (.param + .bin + ncnn's int8 .table beside it; needs netquant[ncnn]).")
@click.option("--num-calib", type=click.IntRange(min=1), default=None, help="Use at most this many samples.")
@click.option("--batch-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--observer", default=None, help="Activation observer (default: the platform's).")
@click.option("--weight-observer", default=None, help="Weight observer (default: the platform's).")
@click.option("--per-channel/--per-tensor", default=None, help="Weight granularity (default: the platform's).")
@click.option("--fp32-ops", multiple=True, help="Ops kept in float: op type, 'name:NODE', 'glob:*head*' "
              "or 're:...'; repeat or separate with commas.")
@click.option("--strict", is_flag=True, help="Fail on ops the platform cannot quantize (default: keep FP32, warn).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars or summary.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write every tensor's quantization params as JSON.")
@click.option("--trt-cache", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write a TensorRT calibration cache (tensorrt_int8: written anyway, default OUT.cache).")
@click.option("--report", "report_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the per-layer error (SNR dB, cosine of every op output vs FP32, first calibration "
                   "batch): layers.md = markdown table, layers.png = plot (needs netquant[plots]); report.html = one "
                   "self-contained page with the model, CPU, engine validation, FP32 vs INT8, placement, per-layer "
                   "chart and saturation table.")
@click.option("--opset", type=int, default=None, help="Opset of the exported model (default: max(13, model's)).")
@click.option("--height", type=click.IntRange(min=1), default=None, help="Image height (dynamic-shape models).")
@click.option("--width", type=click.IntRange(min=1), default=None, help="Image width (dynamic-shape models).")
@click.option("--mean", default="0", show_default=True,
              help="Per-channel mean of pixel/255 (one value: every channel).")
@click.option("--std", default="1", show_default=True, help="Per-channel std of pixel/255 (one value: every channel).")
@click.option("--channel-order", type=click.Choice(["rgb", "bgr"], case_sensitive=False), default="rgb",
              show_default=True)
@click.option("--layout", type=click.Choice(["nchw", "nhwc"], case_sensitive=False), default="nchw",
              show_default=True)
@click.option("--keep-aspect", is_flag=True, help="Resize images to the height, keep aspect, pad right.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for --calib random.")
@click.option("--target", default=None,
              help="CPUs the file will run on (onnxruntime_int8 / openvino_int8): any (default: every x86-64 and "
                   "ARM64 CPU), x86-no-vnni, x86-vnni, arm64, host (this machine; see `netquant doctor`).")
@click.option("--weight-scheme", default=None,
              help="int8 | int7 | uint8 | int8-pairs (default: the platform's choice for --target).")
@click.option("--objective", type=click.Choice(["latency", "balanced", "accuracy", "none"], case_sensitive=False),
              default="balanced", show_default=True,
              help="Automatic placement: each region runs in INT8 only where onnxruntime here runs it faster, then the "
                   "most sensitive regions stay float within --max-loss; 'none': the platform's rules only.")
@click.option("--max-loss", type=click.FloatRange(min=0.0), default=None,
              help="Accuracy budget of placement: 1 - output cosine vs FP32 (default: 0.02 balanced, 0.005 accuracy, "
                   "none for latency).")
@click.option("--effort", type=click.Choice(["fast", "default", "max"], case_sensitive=False), default="default",
              show_default=True,
              help="Repair before float: over --max-loss in INT8, placement first quantizes again with equalization, "
                   "then bias correction (default), also SmoothQuant and AdaRound (max), and floats only what "
                   "repair cannot fix; 'fast': no repair. A fixed amount of work per level, not a clock.")
@click.option("--placement", "placement_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the placement file (JSON: per-region decisions with their measurements).")
@click.option("--placement-from", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Re-apply a placement file instead of measuring (same model, platform and settings).")
@click.option("--nproc", type=click.IntRange(min=1), default=1, show_default=True,
              help="Calibrate in this many local processes (torch.distributed: gloo, with nccl beside it where CUDA is "
                   "there); rank 0 writes the files. "
                   "Under torchrun the ranks are torchrun's.")
@click.option("--threads", default="auto", show_default=True,
              help="Intra-op threads of torch and onnxruntime during the run: a count, or 'auto' (the CPUs this "
                   "process may use less those busy with other work; OMP_NUM_THREADS set: kept).")
@click.option("--weight-only", type=click.Choice(["int4", "int8"], case_sensitive=False), default=None,
              help="Weight-only quantization of MatMul / Gemm weights (LLMs): MatMulNBits or blocked DQ, "
                   "block-wise; --calib is then token ids (.npy), a text file with --tokenizer, or 'random'.")
@click.option("--block-size", type=int, default=128, show_default=True, help="Weight-only block size (16..256).")
@click.option("--algorithm", type=click.Choice(["rtn", "hqq", "awq", "gptq"], case_sensitive=False), default="rtn",
              show_default=True, help="Weight-only algorithm.")
@click.option("--asymmetric", is_flag=True, help="Weight-only: asymmetric blocks with zero points.")
@click.option("--wo-format", type=click.Choice(["matmulnbits", "dq"], case_sensitive=False), default="matmulnbits",
              show_default=True, help="Weight-only file form: com.microsoft.MatMulNBits (onnxruntime) or opset-21 "
                                      "blocked DequantizeLinear (other engines).")
@click.option("--tokenizer", type=click.Path(exists=True, path_type=Path), default=None,
              help="Weight-only: folder with tokenizer.json for a text --calib file.")
@click.option("--seq-len", type=click.IntRange(min=1), default=128, show_default=True,
              help="Weight-only: tokens per calibration window.")
@click.option("--act-order", is_flag=True, help="Weight-only GPTQ: quantize columns by descending Hessian diagonal.")
@click.option("--embeddings/--no-embeddings", default=True, show_default=True,
              help="Weight-only: also the token-embedding tables (per-row blocks).")
@click.option("--head-bits", type=click.Choice(["8", "4"]), default="8", show_default=True,
              help="Weight-only int4: bits of the output layer (lm_head) and embedding tables (8: NNCF's default "
                   "backup precision; 4: like the other layers).")
@click.option("--accuracy-level", type=click.IntRange(0, 4), default=0, show_default=True,
              help="Weight-only MatMulNBits: 0 float compute, 4 int8 activations (faster CPU kernels).")
@click.option("--min-cosine", type=float, default=None,
              help="Refuse the file when an output, run in its engine, has a cosine vs the FP32 model below this "
                   f"(default {DEFAULT_MIN_COSINE}: a catastrophic loss; -1: never).")
@click.option("--allow-float", is_flag=True,
              help="Write the file even when no region runs in INT8 (or fewer than --min-int8-fraction); otherwise "
                   "such a run exits non-zero with the measured trade-off (--objective latency allows it too).")
@click.option("--min-int8-fraction", type=click.FloatRange(min=0.0, max=1.0), default=None,
              help="Share of regions that must run in INT8 (default: at least one).")
@click.option("--overwrite", is_flag=True,
              help="Replace existing companion files written beside -o (OpenVINO / ncnn .bin, ncnn .table); "
                   "without it an existing one is refused, as it may belong to another model.")
@friendly_errors
def quantize(model: Path, platform_name: str, calib: str, output: Path, num_calib: int | None, batch_size: int,
             observer: str | None, weight_observer: str | None, per_channel: bool | None, fp32_ops: tuple[str, ...],
             strict: bool, quiet: bool, json_path: Path | None, trt_cache: Path | None, report_path: Path | None,
             opset: int | None, height: int | None, width: int | None, mean: str, std: str, channel_order: str, layout: str,
             keep_aspect: bool, seed: int, target: str | None, weight_scheme: str | None, objective: str,
             max_loss: float | None, placement_path: Path | None, placement_from: Path | None,
             weight_only: str | None = None, block_size: int = 128, algorithm: str = "rtn", asymmetric: bool = False,
             wo_format: str = "matmulnbits", tokenizer: Path | None = None, seq_len: int = 128,
             act_order: bool = False, embeddings: bool = True, accuracy_level: int = 0, threads: str = "auto",
             nproc: int = 1, min_cosine: float | None = None, allow_float: bool = False,
             min_int8_fraction: float | None = None, overwrite: bool = False, effort: str = "default",
             head_bits: str = "8") -> None:
    """Quantize MODEL.onnx for a platform and write a validated QDQ model."""
    import netquant
    from netquant.cli.distributed import local_group, torchrun_rank
    from netquant.platforms.threads import thread_scope

    click_ctx = click.get_current_context()
    if nproc > 1 and "LOCAL_WORLD_SIZE" not in os.environ:  # --threads auto shares the CPUs among the processes
        os.environ["LOCAL_WORLD_SIZE"] = str(nproc)
        click_ctx.call_on_close(lambda: os.environ.pop("LOCAL_WORLD_SIZE", None))
    # torch's threads for the whole command (quantization and export validation), restored when it ends
    n_threads = click_ctx.with_resource(thread_scope(threads))
    from netquant.export import export_trt_calibration_cache
    from netquant.export.formats import ExportKind, companions
    from netquant.export.opset import check_opset_request
    from netquant.platforms import Validation, get_platform

    console = Console(stderr=True, quiet=quiet)
    t0 = time.perf_counter()
    if weight_only is not None:
        from netquant.cli.weight_only_cmd import run_weight_only

        exclude = tuple(s.strip() for op in fp32_ops for s in op.split(",") if s.strip())
        return run_weight_only(console, model, output, weight_only, block_size, algorithm.lower(), asymmetric,
                               wo_format.lower(), calib, tokenizer, seq_len, num_calib, act_order, exclude, seed,
                               max_loss, embeddings, accuracy_level, int(head_bits))
    platform = get_platform(platform_name)  # unknown names: ConfigError listing the valid ones
    _check_report_path(report_path)
    check_opset_request(opset, "--opset")
    kind = ExportKind.for_path(output, models_only=True, option="-o")
    if kind is ExportKind.TFLITE and (platform.activation.is_float
                                      or (platform.activation.bits, platform.activation.signed) != (8, True)):
        raise ConfigError(f"-o {output}: a .tflite file needs int8 activations; platform '{platform.name}' uses "
                          f"{platform.activation.describe()}. Use --platform tflite_int8")
    beside = companions(kind)
    cache_named = trt_cache is not None
    if trt_cache is None and platform.name == "tensorrt_int8":
        trt_cache = output.with_suffix(".cache")  # TensorRT's implicit-quantization input: the main artifact
    plan = OutputPlan.create(
        [("-o", output, {ExportKind.OPENVINO_IR: "OpenVINO IR", ExportKind.NCNN: "ncnn param",
                         ExportKind.TFLITE: "TFLite model"}.get(kind, "ONNX model")),
         *[(f"-o {c.suffix}", c.default_path(output), c.what, False) for c in beside],
         ("--json", json_path, "quant-params JSON"),
         ("--trt-cache", trt_cache, "TensorRT calibration cache", cache_named),
         ("--report", report_path, "per-layer report"),
         ("--placement", placement_path, "placement file")],
        inputs=[*model_files(model), *calibration_files(calib),
                *([placement_from] if placement_from is not None else [])], overwrite=overwrite)
    inputs = model_inputs(model)
    opts = ImageOptions(height=height, width=width, mean=_floats(mean, "mean") or (0.0,),
                        std=_floats(std, "std") or (1.0,), channel_order=ChannelOrder(channel_order.lower()),
                        layout=Layout(layout.lower()), keep_aspect_pad=keep_aspect)
    if calib == "random":
        warn(console, "--calib random is a smoke test: calibration and the reported agreement describe random "
                      "inputs, not your data")
        if (height is None or width is None) and any(
                inp.shape and any(not isinstance(d, int) or d <= 0 for d in inp.shape[1:]) for inp in inputs):
            warn(console, "random calibration data fills the model's dynamic dims with 32; give --height / "
                          "--width if the model needs another image size")
    with console.status("loading calibration data"):
        data = load_calibration(calib, inputs, image_options=opts, limit=num_calib, seed=seed,
                                index_limits=index_limits(model) if calib == "random" else None)
    samples = sample_count(data)
    t_data = time.perf_counter()
    settings = {"batch_size": batch_size, "strict": strict, "quiet": quiet,
                "force_fp32": tuple(s.strip() for op in fp32_ops for s in op.split(",") if s.strip())}
    if observer:
        settings["activation_observer"] = observer
    if weight_observer:
        settings["weight_observer"] = weight_observer
    if per_channel is not None:
        settings["per_channel"] = per_channel
    if target is not None:
        settings["target"] = target
    if weight_scheme is not None:
        settings["weight_scheme"] = weight_scheme
    settings["objective"] = None if objective.lower() == "none" else objective.lower()
    if max_loss is not None:
        settings["max_loss"] = max_loss
    if effort.lower() != "default":
        settings["effort"] = effort.lower()
    if placement_from is not None:
        settings["placement_from"] = str(placement_from)
    if min_cosine is not None:
        settings["min_cosine"] = min_cosine
    if min_int8_fraction is not None:
        settings["min_int8_fraction"] = min_int8_fraction
    settings["allow_float"] = allow_float
    batches = split_batches(data, inputs, batch_size)
    rank = torchrun_rank()
    if rank is not None or nproc > 1:
        settings["distributed"] = True
    if rank:  # torchrun's other ranks: no progress bars of their own
        settings["quiet"] = True
    with local_group(nproc, str(model), batches, {**settings, "platform": platform.name}) if nproc > 1 and \
            rank is None else contextlib.nullcontext():
        qmodel, messages = quantize_quietly(netquant.quantize_onnx, str(model), batches, platform=platform,
                                            threads=n_threads, **settings)
    if rank:  # torchrun's other ranks: calibrated their share, rank 0 writes
        return
    for w in messages:
        warn(console, w)
    t_quant = time.perf_counter()
    extra = [p for p in (json_path, trt_cache, report_path, placement_path) if p is not None]
    in_ort = platform.validation is Validation.ONNXRUNTIME  # onnxruntime's int8 kernels matter for its files only
    qmodel.check_float(f"{model} -> {output}")  # no float file under an INT8 name unless asked (--allow-float)
    with plan.staged() as stage:
        engine = platform.validation_engine if kind is ExportKind.QDQ else kind.engine
        with make_progress(quiet, console) as progress, progress.stage(f"export: {output.name}, checked in {engine}"):
            # the first calibration batch validates the export (no random batch for dynamic shapes)
            sample = None if qmodel.qgraph.validation_batches else batches[0]
            # companions (.bin, .table) are written by the exporter at their staging paths, with the main file
            staged = {c.keyword: stage.write(f"-o {c.suffix}", lambda p: p) for c in beside}
            options = ({"opset": opset, "check_kernels": in_ort} if kind is ExportKind.QDQ
                       else {"opset": opset} if kind is ExportKind.OPENVINO_IR else {})
            report = stage.write("-o", lambda p: qmodel.write(kind, p, sample=sample, **staged, **options))
            extra += [c.default_path(output) for c in beside]
        if json_path is not None:
            stage.write("--json", lambda p: qmodel.write(ExportKind.JSON, p))
        if trt_cache is not None:
            stage.write("--trt-cache", lambda p: export_trt_calibration_cache(qmodel.qgraph, p))
        if placement_path is not None:
            stage.write("--placement", lambda p: qmodel.save_placement(p))
        if report_path is not None:
            with console.status(f"writing per-layer report {report_path}"):
                title = f"per-layer quantization error: {model.name} on {platform.name}"
                stage.write("--report", lambda p: write_layer_report(qmodel, p, title, export=report, output=output))
    t_end = time.perf_counter()
    summary = qmodel.summary()
    facts = RunFacts(
        model=model, output=output, platform=platform.name, samples=samples, ops_total=summary["ops"],
        ops_quantized=summary["quantized_ops"], by_type=summary["quantized_by_type"],
        int8_kernels=report.int8_kernels, runtime_qdq=report.runtime_qdq,
        fp32_bytes=sum(f.stat().st_size for f in model_files(model)), int8_bytes=report.size_bytes,
        engine=kind.engine,
        opset=f"{report.source_opset} -> {report.opset}" if report.opset_upgraded else str(report.opset),
        cosine=report.output_cosine, validated_with=report.validated_with,
        reference_only=getattr(report, "reference_only", False), cpu_target=report.cpu_target,
        engine_layers="" if kind is not ExportKind.OPENVINO_IR or report.int8_layers is None else (
            f"{sum(report.int8_layers.values())} / {report.heavy_layers} heavy layers ("
            + (", ".join(f"{k} x{v}" for k, v in report.int8_layers.items()) or "none") + ")"),
        seconds={"data": t_data - t0, "calibration": t_quant - t_data, "export": t_end - t_quant,
                 "total": t_end - t0},
        extra_files=extra, placement=_placement_line(qmodel), threads=n_threads,
        vs_fp32=report.vs_fp32.line(float_file=qmodel.int8_share().int8 == 0) if report.vs_fp32 is not None else "")
    for w in report.warnings:
        warn(console, w)
    if not quiet:
        Console().print(summary_table(facts))
