"""FP32 throughput and peak memory: netquant's torch executor vs onnxruntime, same thread count.

Models: PP-OCRv4 recognizer (rapidocr 1.4.4 wheel) and light ResNet-50 (onnx/backend/test/data/light, batch
dimension made dynamic with the Graph API).  Batches 1 and 16.  Executor variants:
  - "as loaded":  Executor(load_onnx(model))
  - "calib graph": after fold_batchnorm + fold_conv_affine + cleanup, the graph PTQ calibrates
Throughput is measured in one process with the engines interleaved round by round (median latency);
peak memory is the peak RSS of a fresh subprocess per (engine, model, batch) doing setup + 3 runs.

    python benchmarks/executor.py [--threads 2] [--rounds 5] [--quiet]
"""

from __future__ import annotations

import os

# OpenMP worker threads must not busy-wait between ops: the engines alternate on the same cores
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import platform
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from rich.console import Console

from netquant.api.zoo import light_model_path, ppocr_model_path
from netquant.atomic import write_text_atomic
from netquant.graph import Executor, Graph, load_onnx, to_onnx
from netquant.graph.edit import cleanup, fold_batchnorm, fold_conv_affine
from netquant.platforms.targets import host_info

OUT = Path(__file__).parent / "results" / "executor.md"
MODELS = {"ppocrv4_rec": (3, 48, 320), "resnet50_light": (3, 224, 224)}
ENGINES = ("ort", "netquant", "netquant_calib", "netquant_hooked")


def load_model(name: str) -> Graph:
    if name == "ppocrv4_rec":
        return load_onnx(ppocr_model_path("rec"), infer_shapes=False)
    graph = load_onnx(light_model_path("resnet50")[0], infer_shapes=False)
    # the light model is exported for batch 1: make the batch dimension dynamic
    graph.inputs[0].shape = ("N", *graph.inputs[0].shape[1:])
    graph.outputs[0].shape = ("N", *graph.outputs[0].shape[1:])
    reshape = next(n for n in graph.nodes if n.op_type == "Reshape")
    graph.initializers[reshape.inputs[1]] = torch.tensor([-1, 2048])
    for name_ in list(graph.value_info):
        graph.value_info.pop(name_)
    graph.declared_value_info.clear()
    return graph


def calib_graph(graph: Graph) -> Graph:
    g = graph.copy()
    fold_batchnorm(g)
    fold_conv_affine(g)
    cleanup(g)
    return g


class Runner:
    def __init__(self, engine: str, model: str, threads: int) -> None:
        torch.set_num_threads(threads)
        graph = load_model(model)
        self.input_name = graph.inputs[0].name
        if engine == "ort":
            so = ort.SessionOptions()
            so.intra_op_num_threads = threads
            so.inter_op_num_threads = 1
            so.log_severity_level = 3
            # ORT's pool spins between runs by default, which would steal the cores from the next engine
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
            self.sess = ort.InferenceSession(to_onnx(graph).SerializeToString(), so,
                                             providers=["CPUExecutionProvider"])
            self.run = lambda x: self.sess.run(None, {self.input_name: x})
        else:
            ex = Executor(calib_graph(graph) if engine != "netquant" else graph)
            if engine == "netquant_hooked":  # what calibration pays: hooks see every op (no in-place path)
                ex.add_pre_hook(lambda node, inputs: None)
                ex.add_post_hook(lambda node, outputs: None)
            self.run = lambda x: ex.run({self.input_name: torch.from_numpy(x)})


def make_input(model: str, batch: int) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((batch, *MODELS[model])).astype(np.float32)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def peak_memory_child(engine: str, model: str, batch: int, threads: int) -> None:
    """Prints the RSS before inference and its peak while running 3 inferences (sampled every 1 ms)."""
    runner = Runner(engine, model, threads)
    x = make_input(model, batch)
    before = _rss_mb()
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_mb())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    for _ in range(3):
        runner.run(x)
    done.set()
    sampler.join()
    print(json.dumps({"before_mb": before, "peak_mb": max(peak[0], _rss_mb())}))


def peak_memory(engine: str, model: str, batch: int, threads: int) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", engine, model, str(batch), "--threads", str(threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"memory probe {engine}/{model}/{batch} failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def throughput(runners: dict[str, Runner], x: np.ndarray, rounds: int) -> dict[str, float]:
    """images / s from the median latency; engines interleaved so machine load hits all alike."""
    for r in runners.values():
        r.run(x)
    times: dict[str, list[float]] = {e: [] for e in runners}
    for _ in range(rounds):
        for engine, r in runners.items():
            t0 = time.perf_counter()
            r.run(x)
            times[engine].append(time.perf_counter() - t0)
    return {e: x.shape[0] / float(np.median(t)) for e, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--child", nargs=3, metavar=("ENGINE", "MODEL", "BATCH"))
    args = parser.parse_args(argv)
    if args.child:
        peak_memory_child(args.child[0], args.child[1], int(args.child[2]), args.threads)
        return 0
    console = Console(stderr=True, quiet=args.quiet)
    torch.set_num_threads(args.threads)
    rows = []
    with console.status("benchmarking") as status:
        for model in MODELS:
            runners = {e: Runner(e, model, args.threads) for e in ENGINES}
            for batch in args.batches:
                status.update(f"{model} batch {batch}: throughput")
                tput = throughput(runners, make_input(model, batch), args.rounds if batch > 1 else 3 * args.rounds)
                status.update(f"{model} batch {batch}: peak memory")
                mem = {e: peak_memory(e, model, batch, args.threads) for e in ENGINES}
                rows.append((model, batch, tput, mem))
                console.log(f"{model} b{batch}: " + ", ".join(f"{e} {tput[e]:.1f} img/s" for e in ENGINES))
    lines = [
        "# Executor FP32 throughput vs onnxruntime",
        "",
        host_info().markdown(),
        f"Generated by `benchmarks/executor.py --threads {args.threads} --rounds {args.rounds}`: torch "
        f"{torch.__version__} vs onnxruntime {ort.__version__} (CPUExecutionProvider, ORT_ENABLE_ALL), both "
        f"with {args.threads} intra-op threads, python {platform.python_version()}, {os.cpu_count()}-core "
        "machine shared with other jobs (absolute numbers are noisy; engines are interleaved round by round "
        "so the ratios are comparable).",
        "",
        "- **netquant**: `Executor(load_onnx(model))`, the graph as loaded (every ONNX node runs, hooks can "
        "attach to each); ORT fuses Conv+BN+activation on its own.",
        "- **netquant calib**: the same after `fold_batchnorm`, `fold_conv_affine` and `cleanup` (the graph "
        "PTQ calibrates; BN folding is standard before quantization).",
        "- **hooked**: the calib graph with a pre and a post hook on every op that only return None (the "
        "situation of a calibration run: observers see each tensor, so the in-place fast path is off).",
        "- ratio = netquant throughput / onnxruntime throughput (target >= 0.5 at batch 16).",
        "- Both engines' worker threads are set not to busy-wait between calls (OMP_WAIT_POLICY=PASSIVE, "
        "ORT `session.intra_op.allow_spinning=0`), otherwise the spinning pool of one engine steals the "
        "cores of the other when they alternate.",
        "- memory: a fresh process per engine sets the model up, then runs 3 inferences while RSS is sampled "
        "every 1 ms; 'peak' is the process peak RSS during inference (includes the python / torch / "
        "onnxruntime runtimes and the weights), '+act' the growth over the RSS just before the first "
        "inference (activations, workspaces, ORT's arena).",
        "",
        "| model | batch | ORT img/s | netquant img/s | ratio | calib img/s | ratio | hooked img/s | ratio | "
        "peak MB (+act) ORT | netquant | calib | hooked |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for model, batch, t, m in rows:
        lines.append(f"| {model} | {batch} | {t['ort']:.1f} | {t['netquant']:.1f} | "
                     f"{t['netquant'] / t['ort']:.2f}x | {t['netquant_calib']:.1f} | "
                     f"{t['netquant_calib'] / t['ort']:.2f}x | {t['netquant_hooked']:.1f} | "
                     f"{t['netquant_hooked'] / t['ort']:.2f}x | "
                     + " | ".join(f"{m[e]['peak_mb']:.0f} (+{m[e]['peak_mb'] - m[e]['before_mb']:.0f})"
                                  for e in ENGINES) + " |")
    text = "\n".join(lines) + "\n"
    OUT.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(OUT, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
