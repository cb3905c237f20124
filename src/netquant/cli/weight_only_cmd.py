"""`netquant quantize LLM.onnx --weight-only int4 --block-size 128 --algorithm awq --calib text.txt -o out.onnx`."""

from __future__ import annotations

from pathlib import Path

import onnx
from rich.console import Console

from netquant.errors import ConfigError
from netquant.outputs import OutputPlan, model_files

WEIGHT_ONLY_BITS = {"int4": 4, "int8": 8}


def run_weight_only(console: Console, model: Path, output: Path, weight_only: str, block_size: int, algorithm: str,
                    asymmetric: bool, fmt: str, calib: str, tokenizer: Path | None, seq_len: int,
                    num_calib: int | None, act_order: bool, exclude: tuple[str, ...], seed: int,
                    max_loss: float | None = None, embeddings: bool = True, accuracy_level: int = 0,
                    head_bits: int = 8) -> None:
    """Plan the outputs (never an input), quantize, print what was written and the check against FP32."""
    from netquant.api.weight_only import quantize_weights
    from netquant.data.tokens import decoder_feeds, random_windows

    bits = WEIGHT_ONLY_BITS.get(weight_only.lower())
    if bits is None:
        raise ConfigError(f"--weight-only {weight_only}: use int4 or int8")
    data_file = output.with_name(output.name + ".data")
    inputs = [*model_files(model), *([Path(calib)] if calib != "random" else []),
              *([tokenizer] if tokenizer is not None else [])]
    OutputPlan.create([("-o", output, "weight-only model"), ("-o .data", data_file, "external data")], inputs=inputs)
    feeds = None
    calib_path: str | None = calib
    if calib == "random":
        console.print("warning: --calib random gives random token ids: data-aware algorithms and the reported "
                      "agreement describe random text", style="yellow")
        feeds = decoder_feeds(onnx.load_model(str(model), load_external_data=False),
                              random_windows(model, num_calib or 8, seq_len, seed))
        calib_path = None
    with console.status("weight-only quantization") as status:
        result = quantize_weights(model, output, bits=bits, block_size=block_size, symmetric=not asymmetric,
                                  algorithm=algorithm, format=fmt, act_order=act_order, exclude=exclude,
                                  calib=calib_path, tokenizer=tokenizer, seq_len=seq_len, num_calib=num_calib or 32,
                                  feeds=feeds, max_loss=max_loss, embeddings=embeddings,
                                  accuracy_level=accuracy_level, head_bits=head_bits,
                                  progress=lambda m: status.update(m))
    mb = 1 << 20
    wide = sum(r.bits == 8 for r in result.layers) if bits == 4 and result.mixed is None else 0
    console.print(f"{weight_only} {algorithm} block {block_size}: {len(result.layers)} weights quantized"
                  + (f" ({wide} in int8: output layer / embeddings, --head-bits)" if wide else "")
                  + (f", {len(result.skipped)} excluded" if result.skipped else "")
                  + f"; {result.source_bytes / mb:.1f} MB -> {result.output_bytes / mb:.1f} MB in {result.seconds:.1f} s")
    if result.mixed is not None:
        m = result.mixed
        console.print(f"mixed int4 / int8: {m.int8_layers} of {len(result.layers)} layers int8, output loss "
                      f"{m.loss:.5f} {'within' if m.met else 'NOT within (all int8)'} --max-loss {m.max_loss}")
    for name, cos in result.cosine.items():
        console.print(f"onnxruntime output '{name}' vs FP32 on calibration windows: cosine {cos:.5f}")
    console.print(f"wrote {', '.join(str(f) for f in result.files)}")
