"""Weight-only LLM benchmark: netquant int4 / int8 (RTN, HQQ, AWQ, GPTQ) vs onnxruntime's matmul_nbits_quantizer.

Part 1 (accuracy): a Llama-style byte-level decoder (GQA, rotary, SwiGLU; about 9.4M parameters) trained here on CPU on
the Python standard library's source text (the .py files that ship with this Python; 95% train / last 5% held out,
seeded, cached in $NETQUANT_CACHE/llm). It is written as the GroupQueryAttention graph onnxruntime's LLM builders
produce (`netquant.api.zoo_decoder`), checked against the torch model, then quantized; held-out bits per byte and
perplexity are measured in onnxruntime for FP32, each netquant setting and each peer setting.

Part 2 (size and speed): a random-init Llama-style model of about 1B parameters written with external data (> 2 GB):
netquant int4 RTN quantization time and peak RSS (a child process), file sizes, and decode tokens/s at batch 1 in
onnxruntime (1 and 2 threads) for FP32 and int4.

    python benchmarks/llm.py                  # both parts
    python benchmarks/llm.py --part accuracy  # or size
    python benchmarks/llm.py --only-time      # only the quantization-time table (netquant vs ORT), printed
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from netquant.api.weight_only import quantize_weights_onnx
from netquant.api.zoo import cache_dir
from netquant.api.zoo_decoder import (
    DecoderConfig,
    decode_feeds,
    random_weights,
    rope_caches,
    write_decoder_onnx,
)
from netquant.passes.weight_only import WeightAlgorithm, WeightOnlyConfig

SMALL = DecoderConfig(vocab=256, dim=320, layers=9, heads=10, kv_heads=5, hidden=864, max_positions=512)
BIG = DecoderConfig(vocab=32000, dim=2048, layers=20, heads=32, kv_heads=8, hidden=5632, max_positions=2048)
SEQ = 128
TRAIN_STEPS = 1100
BATCH = 8
SEED = 0
SLOW_PEER_S = 20.0  # time table: a peer run slower than this is not repeated


# ----------------------------------------------------------------------------------------------- the torch model
class RMSNorm(torch.nn.Module):
    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, D]; non-interleaved halves (onnxruntime's rotary_interleaved=0)."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([c * x1 - s * x2, s * x1 + c * x2], dim=-1)


class Layer(torch.nn.Module):
    def __init__(self, c: DecoderConfig) -> None:
        super().__init__()
        self.c = c
        kv = c.kv_heads * c.head_dim
        self.attn_norm, self.mlp_norm = RMSNorm(c.dim, c.eps), RMSNorm(c.dim, c.eps)
        self.q, self.o = torch.nn.Linear(c.dim, c.dim, bias=False), torch.nn.Linear(c.dim, c.dim, bias=False)
        self.k, self.v = torch.nn.Linear(c.dim, kv, bias=False), torch.nn.Linear(c.dim, kv, bias=False)
        self.gate = torch.nn.Linear(c.dim, c.hidden, bias=False)
        self.up = torch.nn.Linear(c.dim, c.hidden, bias=False)
        self.down = torch.nn.Linear(c.hidden, c.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c = self.c
        b, s, _ = x.shape
        h = self.attn_norm(x)
        q = rotate(self.q(h).view(b, s, c.heads, c.head_dim), cos, sin).transpose(1, 2)
        k = rotate(self.k(h).view(b, s, c.kv_heads, c.head_dim), cos, sin).transpose(1, 2)
        v = self.v(h).view(b, s, c.kv_heads, c.head_dim).transpose(1, 2)
        rep = c.heads // c.kv_heads
        att = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
        x = x + self.o(att.transpose(1, 2).reshape(b, s, c.dim))
        h = self.mlp_norm(x)
        return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


class Decoder(torch.nn.Module):
    def __init__(self, c: DecoderConfig) -> None:
        super().__init__()
        self.c = c
        self.embed = torch.nn.Embedding(c.vocab, c.dim)
        self.layers = torch.nn.ModuleList(Layer(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.dim, c.eps)
        self.lm_head = torch.nn.Linear(c.dim, c.vocab, bias=False)
        cos, sin = rope_caches(c)
        self.register_buffer("cos", torch.from_numpy(cos), persistent=False)
        self.register_buffer("sin", torch.from_numpy(sin), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        s = ids.shape[1]
        for layer in self.layers:
            x = layer(x, self.cos[:s], self.sin[:s])
        return self.lm_head(self.norm(x))

    def onnx_weights(self) -> dict[str, np.ndarray]:
        """Weights by zoo_decoder name, MatMul weights as [in, out]."""
        out = {"embed.weight": self.embed.weight, "norm.weight": self.norm.weight, "lm_head.weight": self.lm_head.weight.t()}
        for i, layer in enumerate(self.layers):
            for name in ("q", "k", "v", "o", "gate", "up", "down"):
                out[f"layers.{i}.{name}.weight"] = getattr(layer, name).weight.t()
            out[f"layers.{i}.attn_norm.weight"] = layer.attn_norm.weight
            out[f"layers.{i}.mlp_norm.weight"] = layer.mlp_norm.weight
        return {k: v.detach().contiguous().numpy().astype(np.float32) for k, v in out.items()}


# ---------------------------------------------------------------------------------------------------- data
def corpus() -> tuple[np.ndarray, np.ndarray, str]:
    """Bytes of the standard library's .py files (sorted paths): (train, held-out, description)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py"))
    data = b"\n".join(p.read_bytes() for p in files)
    arr = np.frombuffer(data, dtype=np.uint8).astype(np.int64)
    cut = int(len(arr) * 0.95)
    return arr[:cut], arr[cut:], f"{len(files)} .py files of {root} ({len(arr) / 1e6:.1f} MB)"


def train(workdir: Path) -> tuple[Decoder, dict]:
    cached = workdir / f"decoder_{SMALL.dim}x{SMALL.layers}_steps{TRAIN_STEPS}_seed{SEED}.pt"
    model = Decoder(SMALL)
    if cached.is_file():
        state = torch.load(cached)
        model.load_state_dict(state["model"])
        return model.eval(), state["info"]
    torch.manual_seed(SEED)
    torch.set_num_threads(1)  # one thread: steady on a shared 2-core machine (two oversubscribe under load)
    model = Decoder(SMALL)
    train_ids, _, what = corpus()
    rng = np.random.default_rng(SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 30) * 0.5 * (1 + math.cos(math.pi * min(s, TRAIN_STEPS) / TRAIN_STEPS)))
    t0 = time.perf_counter()
    for step in range(TRAIN_STEPS):
        starts = rng.integers(0, len(train_ids) - SEQ - 1, size=BATCH)
        batch = torch.from_numpy(np.stack([train_ids[s:s + SEQ + 1] for s in starts]))
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, SMALL.vocab), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 25 == 0:
            print(f"step {step} loss {loss.item():.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    info = {"train_seconds": time.perf_counter() - t0, "steps": TRAIN_STEPS, "batch": BATCH, "seq": SEQ,
            "corpus": what, "parameters": sum(p.numel() for p in model.parameters()), "final_loss": loss.item(),
            "threads": torch.get_num_threads()}
    torch.save({"model": model.state_dict(), "info": info}, cached)
    return model.eval(), info


# ---------------------------------------------------------------------------------------------------- evaluation
def windows(ids: np.ndarray, count: int, seed: int) -> np.ndarray:
    starts = np.random.default_rng(seed).integers(0, len(ids) - SEQ - 1, size=count)
    return np.stack([ids[s:s + SEQ + 1] for s in starts])


def bits_per_byte(path: Path, evals: np.ndarray, threads: int = 2) -> float:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    total, n = 0.0, 0
    for w in evals:
        logits = session.run(["logits"], decode_feeds(SMALL, w[None, :-1]))[0][0]
        logp = logits - logits.max(-1, keepdims=True)
        logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
        total -= float(logp[np.arange(SEQ), w[1:]].sum())
        n += SEQ
    return total / n / math.log(2)


def calib_feeds(train_ids: np.ndarray, count: int = 32) -> list[dict[str, np.ndarray]]:
    return [decode_feeds(SMALL, w[None, :-1]) for w in windows(train_ids, count, seed=7)]


def ort_peer(src: Path, out: Path, block: int, algo: str) -> float:
    """onnxruntime's matmul_nbits_quantizer (default RTN, or HQQ); returns seconds."""
    import onnx
    from onnxruntime.quantization import matmul_nbits_quantizer as mnq

    t0 = time.perf_counter()
    model = onnx.load(str(src))
    cfg = mnq.HQQWeightOnlyQuantConfig(block_size=block, bits=4) if algo == "hqq" else \
        mnq.DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=True, accuracy_level=None)
    q = mnq.MatMulNBitsQuantizer(model, algo_config=cfg)
    q.process()
    q.model.save_model_to_file(str(out), use_external_data_format=True)
    return time.perf_counter() - t0


def nncf_peer(src: Path, out: Path, block: int, mode: str, feeds: list[dict[str, np.ndarray]] | None) -> float:
    """NNCF compress_weights on the ONNX model (its defaults: embedding and lm_head kept int8_asym as backup);
    `feeds` turns on its data-aware AWQ + scale estimation. Returns seconds."""
    import nncf
    import onnx

    t0 = time.perf_counter()
    model = onnx.load(str(src))
    kwargs = {"mode": getattr(nncf.CompressWeightsMode, mode), "group_size": block, "ratio": 1.0}
    if feeds is not None:
        kwargs.update(dataset=nncf.Dataset(feeds), awq=True, scale_estimation=True)
    q = nncf.compress_weights(model, **kwargs)
    onnx.save(q, str(out), save_as_external_data=True, location=out.name + ".data")
    return time.perf_counter() - t0


def _peer_row(rows: list[str], label: str, block: int, run, out: Path, evals: np.ndarray, fp32: float) -> None:
    for stale in (out, out.with_name(out.name + ".data")):  # onnx appends external data to an existing file
        stale.unlink(missing_ok=True)
    try:
        secs = run()
        bpb = bits_per_byte(out, evals)
        rows.append(f"| {label} | {block} | {bpb:.4f} | {2 ** bpb:.4f} | {2 ** bpb - 2 ** fp32:+.4f} | {_mb(out)} | "
                    f"{secs:.1f} |")
    except Exception as exc:  # a peer that fails is reported, not hidden
        msg = " ".join(f"{type(exc).__name__}: {exc}".split())[:120].replace("|", "/")
        rows.append(f"| {label} | {block} | failed: {msg} | | | | |")
    print(rows[-1], flush=True)


def part_accuracy(workdir: Path, rows: list[str]) -> None:
    from netquant.platforms.threads import thread_scope

    model, info = train(workdir)
    with thread_scope("auto") as threads:  # netquant's thread policy; the peers run under the same count
        src = _accuracy_rows(workdir, rows, model, info, threads)
    _time_rows(src, workdir, rows)


def _accuracy_rows(workdir: Path, rows: list[str], model: Decoder, info: dict, threads: int) -> Path:
    train_ids, held, what = corpus()
    src = workdir / "small_fp32.onnx"
    weights = model.onnx_weights()
    write_decoder_onnx(src, SMALL, lambda name, shape: weights[name])
    evals = windows(held, 64, seed=11)
    import onnxruntime as ort

    ref = model(torch.from_numpy(evals[:1, :-1])).detach().numpy()
    got = ort.InferenceSession(str(src)).run(["logits"], decode_feeds(SMALL, evals[:1, :-1]))[0]
    assert np.abs(ref - got).max() < 1e-3, "the ONNX graph does not match the torch model"
    fp32 = bits_per_byte(src, evals)
    feeds = calib_feeds(train_ids)
    rows += [f"Model: Llama-style byte-level decoder, {info['parameters'] / 1e6:.1f}M parameters ({SMALL.layers} layers, "
             f"d {SMALL.dim}, {SMALL.heads} heads / {SMALL.kv_heads} KV heads, SwiGLU {SMALL.hidden}), trained "
             f"{info['steps']} steps x {info['batch']} x {info['seq']} bytes in {info['train_seconds'] / 60:.1f} min "
             f"({info['threads']} threads) on {info['corpus']}; held-out: last 5%, 64 windows of {SEQ} bytes; "
             "calibration: 32 training windows. Symmetric int4 blocks (HQQ: asymmetric, with per-block zero points); netquant's default keeps lm_head and the "
             "embedding table in int8 (head_bits=8, like NNCF's default backup precision; the 'like ORT' rows quantize "
             "lm_head in int4 and keep the embedding float, as ORT's quantizer does); peers with their defaults. Every "
             f"quantizer (netquant and peers) runs with {threads} torch / onnxruntime thread(s) (netquant's thread "
             "policy on this load), one after the other in this run."
             " The 'quantize s' column is one call each on a loaded host (noisy: "
             "one call per row); the alternated medians after the table are the time comparison.", "",
             "| setting | block | bits/byte | perplexity (per byte) | delta ppl vs FP32 | file MB | quantize s |",
             "|---|---|---|---|---|---|---|",
             f"| FP32 | - | {fp32:.4f} | {2 ** fp32:.4f} | - | {_mb(src)} | - |"]
    settings = [(8, 128, "rtn", {})] + [(4, b, a, {}) for b in (32, 128) for a in ("rtn", "hqq", "awq", "gptq")]
    settings += [(4, b, a, {"head_bits": 4, "embeddings": False}) for b in (32, 128) for a in ("rtn", "hqq")]
    settings += [(4, 128, "gptq", {"max_loss": 2e-4})]
    for bits, block, algo, extra in settings:
        tag = "".join(f"_{k}" for k in extra)
        out = workdir / f"small_int{bits}_{algo}_b{block}{tag}.onnx"
        r = quantize_weights_onnx(src, out, WeightOnlyConfig(bits, block, True, WeightAlgorithm(algo), **extra), feeds)
        bpb = bits_per_byte(out, evals)
        label = f"netquant int{bits} {algo}" + (" lm_head int4, embedding float (like ORT)" if "head_bits" in extra
                                                else "") + (
            f" + mixed int8 (max_loss {extra['max_loss']}: {r.mixed.int8_layers} of {len(r.layers)} layers int8)"
            if r.mixed is not None else "")
        rows.append(f"| {label} | {block} | {bpb:.4f} | {2 ** bpb:.4f} | "
                    f"{2 ** bpb - 2 ** fp32:+.4f} | {_mb(out)} | {r.seconds:.1f} |")
        print(rows[-1], flush=True)
    for block in (32, 128):
        for algo in ("rtn", "hqq"):
            out = workdir / f"small_ort_{algo}_b{block}.onnx"
            _peer_row(rows, f"ORT matmul_nbits_quantizer int4 {algo}", block,
                      lambda out=out, block=block, algo=algo: ort_peer(src, out, block, algo), out, evals, fp32)
        for mode in ("INT4_SYM", "INT4_ASYM"):
            out = workdir / f"small_nncf_{mode}_b{block}.onnx"
            _peer_row(rows, f"NNCF compress_weights {mode} (data-free; embedding, lm_head int8)", block,
                      lambda out=out, block=block, mode=mode: nncf_peer(src, out, block, mode, None), out, evals, fp32)
        out = workdir / f"small_nncf_awq_b{block}.onnx"
        _peer_row(rows, "NNCF compress_weights INT4_SYM + AWQ + scale estimation", block,
                  lambda out=out, block=block: nncf_peer(src, out, block, "INT4_SYM", feeds), out, evals, fp32)
    rows.append("")
    return src


def _time_rows(src: Path, workdir: Path, rows: list[str], reps: int = 3) -> None:
    """Quantization time, netquant vs ORT's quantizer, run alternately (same load): median of `reps` each, quiet
    (netquant's thread count for both, as measured at the start) and busy (one spinning process per core; both with
    their defaults: netquant measures the load per call, ORT uses its own threads)."""
    from netquant.platforms.threads import thread_scope

    load = os.getloadavg()[0]
    with thread_scope("auto") as threads:
        quiet = _timings(src, workdir, reps, threads)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(2.0)  # the spinners run before the first measurement
        busy_load = os.getloadavg()[0]
        busy = _timings(src, workdir, reps, None)
        busy_end = os.getloadavg()[0]
    finally:
        for proc in spinners:
            proc.terminate()
        for proc in spinners:
            proc.wait()
    rows += [f"Quantization time, netquant and ORT run alternately ({reps} times each; median wall seconds of the whole "
             "call: netquant = load + quantize + write + validation in onnxruntime, ORT = load + quantize + save). "
             f"Quiet: both with netquant's thread count ({threads}), load average {load:.1f} (other jobs). Busy: one "
             f"spinning process per core ({os.cpu_count()}) started first, load average {busy_load:.1f} at the start, "
             f"{busy_end:.1f} at the end; default settings, no thread variables: netquant's 'auto' measures the load "
             "per call (its probe is in the time), ORT uses its defaults (its HQQ runs torch with one thread per core). "
             f"A setting whose ORT run took over {SLOW_PEER_S:.0f} s was run once (rounds in brackets).", "",
             "| algorithm | block | quiet: netquant s | quiet: ORT matmul_nbits_quantizer s | busy: netquant s | "
             "busy: ORT s |", "|---|---|---|---|---|---|"]
    for key in quiet:
        (q_ours, q_peer, q_n), (b_ours, b_peer, b_n) = quiet[key], busy[key]
        rows.append(f"| {key[0]} | {key[1]} | {q_ours:.2f} | {q_peer:.2f}{'' if q_n == reps else f' ({q_n})'} | "
                    f"{b_ours:.2f} | {b_peer:.2f}{'' if b_n == reps else f' ({b_n})'} |")
        print(rows[-1], flush=True)
    rows.append("")


def _timings(src: Path, workdir: Path, reps: int, threads: int | None
             ) -> dict[tuple[str, int], tuple[float, float, int]]:
    """(netquant, ORT median wall seconds, rounds) per (algorithm, block), the two alternated; `threads` None:
    defaults. A peer slower than SLOW_PEER_S gets one round."""
    found = {}
    out = workdir / "time_q.onnx"
    for block in (32, 128):
        for algo in ("rtn", "hqq"):
            ours, peer = [], []
            for _ in range(reps):
                if peer and peer[-1] > SLOW_PEER_S:  # one round of a peer this slow is enough
                    break
                t0 = time.perf_counter()
                quantize_weights_onnx(src, out, WeightOnlyConfig(4, block, True, WeightAlgorithm(algo)),
                                      threads=threads if threads is not None else "auto")
                ours.append(time.perf_counter() - t0)
                for stale in (out, out.with_name(out.name + ".data")):
                    stale.unlink(missing_ok=True)
                peer.append(ort_peer(src, out, block, algo))
                for stale in (out, out.with_name(out.name + ".data")):
                    stale.unlink(missing_ok=True)
            found[(algo, block)] = (sorted(ours)[len(ours) // 2], sorted(peer)[len(peer) // 2], len(ours))
            print(algo, block, threads, found[(algo, block)], flush=True)
    return found


def only_time(workdir: Path) -> None:
    """The quantization-time table alone (the trained decoder from the cache, or trained first), printed."""
    from netquant.platforms.targets import host_info

    workdir.mkdir(parents=True, exist_ok=True)
    model, _ = train(workdir)
    src = workdir / "small_fp32.onnx"
    weights = model.onnx_weights()
    write_decoder_onnx(src, SMALL, lambda name, shape: weights[name])
    rows = [f"Run {time.strftime('%Y-%m-%d %H:%M')}, load average {os.getloadavg()[0]:.1f} at the start.", ""]
    _time_rows(src, workdir, rows)
    rows.append(f"Load average at the end: {os.getloadavg()[0]:.1f}.")
    print("\n".join([host_info(ort_threads=2).markdown(), *rows]))


def _mb(path: Path) -> str:
    data = path.with_name(path.name + ".data")
    size = path.stat().st_size + (data.stat().st_size if data.is_file() else 0)
    return f"{size / 1e6:.2f}"


# ---------------------------------------------------------------------------------------------------- size / speed
def decode_rates(paths: list[Path], config: DecoderConfig, threads: int, rounds: int = 3) -> list[float]:
    """Decode tokens/s at batch 1 of each model (16-token prompt, then 16 tokens timed), the models alternated per round
    (the same load for each), median of `rounds`; one session per model, made once."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    sessions = [ort.InferenceSession(str(p), opts, providers=["CPUExecutionProvider"]) for p in paths]
    rates: list[list[float]] = [[] for _ in paths]
    for _ in range(rounds):
        for i, session in enumerate(sessions):
            rates[i].append(_decode_rate(session, config))
    return [sorted(r)[len(r) // 2] for r in rates]


def _decode_rate(session: object, config: DecoderConfig, prompt: int = 16, new: int = 16) -> float:
    names = [o.name for o in session.get_outputs()]  # type: ignore[attr-defined]
    ids = np.random.default_rng(0).integers(0, config.vocab, size=(1, prompt))
    outs = session.run(names, decode_feeds(config, ids))  # type: ignore[attr-defined]
    past = outs[1:]
    nxt = np.array([[int(outs[0][0, -1].argmax())]])
    t0 = time.perf_counter()
    for _ in range(new):
        outs = session.run(names, decode_feeds(config, nxt, past))  # type: ignore[attr-defined]
        past = outs[1:]
        nxt = np.array([[int(outs[0][0, -1].argmax())]])
    return new / (time.perf_counter() - t0)


def _child_quantize(src: str, out: str, level: str) -> None:
    t0 = time.perf_counter()
    quantize_weights_onnx(src, out, WeightOnlyConfig(4, 128, True, WeightAlgorithm.RTN, accuracy_level=int(level)))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": time.perf_counter() - t0, "peak_rss": peak}))


def _child_ort(src: str, out: str) -> None:
    """onnxruntime's matmul_nbits_quantizer (RTN, block 128, symmetric) in its own process: seconds, peak RSS."""
    seconds = ort_peer(Path(src), Path(out), 128, "rtn")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": seconds, "peak_rss": peak}))


def part_size(workdir: Path, rows: list[str]) -> None:
    src = workdir / "big_fp32.onnx"
    if not src.is_file() or not src.with_name(src.name + ".data").is_file():
        t0 = time.perf_counter()
        write_decoder_onnx(src, BIG, random_weights(BIG, SEED))
        print(f"wrote {src} in {time.perf_counter() - t0:.0f} s", flush=True)
    out = workdir / "big_int4.onnx"
    fast = workdir / "big_int4_level4.onnx"
    peer = workdir / "big_int4_ort.onnx"
    stats = {}
    for path, level in ((out, 0), (fast, 4), (peer, "ort")):  # netquant, then ORT, one process each (peak RSS)
        flag = ["--child-ort", str(src), str(path)] if level == "ort" else \
            ["--child-quantize", str(src), str(path), str(level)]
        child = subprocess.run([sys.executable, __file__, *flag], check=True, capture_output=True, text=True)
        stats[level] = json.loads(child.stdout.strip().splitlines()[-1])
        print(level, stats[level], flush=True)
    fp32_bytes = sum(int(np.prod(s)) for _, s in BIG.weight_shapes()) * 4
    rows += [f"Model: random-init Llama-style decoder, {BIG.parameters() / 1e9:.2f}B parameters ({BIG.layers} layers, "
             f"d {BIG.dim}, {BIG.heads} / {BIG.kv_heads} heads, SwiGLU {BIG.hidden}, vocab {BIG.vocab}), "
             "GroupQueryAttention with KV cache, external data. Random weights: size and speed only.", "",
             "| what | FP32 | netquant int4 RTN, block 128 (accuracy_level 0: float compute) | same, accuracy_level 4 "
             "(int8 activations) | ORT matmul_nbits_quantizer int4 RTN, block 128 (its default accuracy level) |",
             "|---|---|---|---|---|",
             f"| file (model + data) MB | {_mb(src)} | {_mb(out)} | {_mb(fast)} | {_mb(peer)} |",
             "| quantization time s (netquant: quantize + validation in onnxruntime) | - | "
             + " | ".join(f"{stats[lv]['seconds']:.1f}" for lv in (0, 4, "ort")) + " |",
             f"| quantization peak RSS GB (FP32 weights {fp32_bytes / 1e9:.2f} GB) | - | "
             + " | ".join(f"{stats[lv]['peak_rss'] / 1e9:.2f} ({stats[lv]['peak_rss'] / fp32_bytes:.2f}x the FP32 "
                          "weight bytes)" for lv in (0, 4, "ort")) + " |"]
    for threads in (1, 2):
        fp, q4, q4f, q4o = decode_rates([src, out, fast, peer], BIG, threads)
        rows.append(f"| decode tokens/s, batch 1, {threads} thread(s) (median of 3 rounds, models alternated) | "
                    f"{fp:.2f} | {q4:.2f} ({q4 / fp:.2f}x) | "
                    f"{q4f:.2f} ({q4f / fp:.2f}x) | {q4o:.2f} ({q4o / fp:.2f}x) |")
        print(rows[-1], flush=True)
    rows.append("")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", choices=["accuracy", "size", "both"], default="both")
    parser.add_argument("--child-quantize", nargs=3)
    parser.add_argument("--child-ort", nargs=2)
    parser.add_argument("--only-time", action="store_true",
                        help="only the quantization-time table of the trained decoder (printed; results file unchanged)")
    args = parser.parse_args()
    if args.child_quantize:
        _child_quantize(*args.child_quantize)
        return
    if args.child_ort:
        _child_ort(*args.child_ort)
        return
    if args.only_time:
        only_time(cache_dir() / "llm")
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from netquant.platforms.targets import host_info
    from results_table import publish

    workdir = cache_dir() / "llm"
    workdir.mkdir(parents=True, exist_ok=True)
    for part in ("accuracy", "size"):
        if args.part not in (part, "both"):
            continue
        load = os.getloadavg()[0]
        rows = [f"## {'Accuracy: a trained decoder' if part == 'accuracy' else 'Size and speed: a 1B decoder'}", "",
                f"Run {time.strftime('%Y-%m-%d')}, load average {load:.1f} at the start "
                f"({'shared with other jobs' if load > 1.5 else 'quiet'}).", ""]
        if part == "accuracy":
            part_accuracy(workdir, rows)
        else:
            with tempfile.TemporaryDirectory(dir=workdir) as tmp:
                part_size(Path(tmp), rows)
        (workdir / f"rows_{part}.json").write_text(json.dumps(rows))
    sections = [line for part in ("accuracy", "size") if (workdir / f"rows_{part}.json").is_file()
                for line in json.loads((workdir / f"rows_{part}.json").read_text())]
    header = ["# Weight-only LLM quantization (`benchmarks/llm.py`)", "", host_info(ort_threads=2).markdown(),
              "Bits per byte in onnxruntime with 2 threads; decode at batch 1 with the thread counts given.", ""]
    publish(Path(__file__).parent / "results" / "llm.md", [*header, *sections])


if __name__ == "__main__":
    main()
