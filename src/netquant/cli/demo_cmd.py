"""`netquant demo`: quantize the PP-OCRv4 text recognizer that ships in the rapidocr-onnxruntime wheel,
on text lines netquant renders itself, and compare FP32 and INT8 accuracy and latency in onnxruntime."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from netquant.cli.common import friendly_errors, quantize_quietly, warn

CALIB_SEED, EVAL_SEED = 1000, 2000


@click.command()
@click.option("--platform", "platform_name", default="onnxruntime_int8", show_default=True)
@click.option("--calib-lines", type=click.IntRange(min=1), default=128, show_default=True,
              help="Rendered text lines used for calibration.")
@click.option("--eval-lines", type=click.IntRange(min=1), default=400, show_default=True,
              help="Other rendered lines used for evaluation.")
@click.option("--output-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep the INT8 model here (default: a temporary folder).")
@click.option("--quiet", "-q", is_flag=True, help="Only the result table.")
@friendly_errors
def demo(platform_name: str, calib_lines: int, eval_lines: int, output_dir: Path | None, quiet: bool) -> None:
    """Quantize PP-OCRv4's recognizer and print FP32 vs INT8 accuracy and latency."""
    import netquant
    from netquant.api import zoo
    from netquant.data.ocr import latency_ms, rec_batch, rec_score
    from netquant.data.text_render import make_text_lines
    from netquant.export import export_qdq
    from netquant.platforms.targets import host_info, kernel_family

    console = Console(stderr=True, quiet=quiet)
    with console.status("fetching the PP-OCRv4 recognizer (rapidocr-onnxruntime 1.4.4 wheel)"):
        fp32 = zoo.ppocr_model_path("rec")
        dictionary = zoo.ppocr_rec_dictionary()
    with console.status(f"rendering {calib_lines} + {eval_lines} text lines"):
        calib = rec_batch(make_text_lines(calib_lines, seed=CALIB_SEED))
        lines = make_text_lines(eval_lines, seed=EVAL_SEED)
        x, truth = rec_batch(lines), [line.text for line in lines]
    with tempfile.TemporaryDirectory(prefix="netquant_demo_") as tmp:
        folder = output_dir or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        out = folder / "ppocrv4_rec_int8.onnx"
        t = time.perf_counter()
        qmodel, messages = quantize_quietly(netquant.quantize_onnx, str(fp32), {"x": calib}, platform=platform_name,
                                            batch_size=8, quiet=quiet)
        report = export_qdq(qmodel.qgraph, out)  # validated on the first calibration batches
        seconds = time.perf_counter() - t
        for w in messages:
            warn(console, w)
        with console.status("evaluating FP32 and INT8 in onnxruntime"):
            s32, s8 = rec_score(fp32, x, truth, dictionary), rec_score(out, x, truth, dictionary)
            l32, l8 = latency_ms(fp32, x[:1]), latency_ms(out, x[:1])
        table = Table(title=f"PP-OCRv4 recognizer, {eval_lines} rendered lines, platform {qmodel.platform.name}")
        for col in ("model", "exact lines %", "characters %", "latency ms (batch 1, 1 thread)", "file MB"):
            table.add_column(col, justify="right")
        table.add_row("FP32", f"{100 * s32.line_acc:.1f}", f"{100 * s32.char_acc:.2f}", f"{l32:.1f}",
                      f"{fp32.stat().st_size / 1e6:.2f}")
        table.add_row("INT8 (netquant)", f"{100 * s8.line_acc:.1f}", f"{100 * s8.char_acc:.2f}", f"{l8:.1f}",
                      f"{out.stat().st_size / 1e6:.2f}")
        Console().print(table)
        kernels = ", ".join(f"{k} x{v}" for k, v in (report.int8_kernels or {}).items()) or "none"
        host = host_info(ort_threads=1)
        Console().print(f"measured on {host.cpu.describe()}; int8 kernels here: "
                        f"{kernel_family(host.accumulation, host.cpu)}; the file's CPU target: "
                        f"{report.cpu_target or 'n/a'} ({qmodel.platform.weight_scheme.value if qmodel.platform.weight_scheme else 'platform'} weights)",
                        highlight=False, soft_wrap=True)
        Console().print(f"INT8 vs FP32: {100 * (s8.line_acc - s32.line_acc):+.1f} points exact lines, "
                        f"{l32 / l8:.2f}x speed; quantized in {seconds:.1f}s; onnxruntime int8 kernels: {kernels}",
                        highlight=False, soft_wrap=True)
        if output_dir is not None:
            Console().print(f"wrote {out}", highlight=False)
