"""Trained transformers: netquant default vs onnxruntime quantize_dynamic / quantize_static and NNCF, task metric.

Model 1 (trained here): a transformers `BertModel` built from a config with masked mean pooling and a Linear head (4 layers, width 256, 4
heads of 64, ff 1024, word-level vocabulary of 8192 built from the data, seq 64) trained on CPU (one thread, seeded,
cached in $NETQUANT_CACHE/trained) to tell which of 12 Python standard-library packages a 64-token window of source
text comes from. Windows of each package's text before its 85% mark train it, non-overlapping windows after it are the
held-out test set (accuracy is the metric; top-1 agreement with FP32 is reported too). Exported with
`torch.onnx.export` (TorchScript, opset 17, dynamic batch / seq) and with the dynamo exporter.

Model 2 (ships in a wheel): see `netquant.api.zoo.wheel_transformer_path` and `--models`.

    python benchmarks/transformers_trained.py [--train-only] [--quick]

Writes benchmarks/results/transformers_trained.md and prints it.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import json
import math
import re
import sys
import sysconfig
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from netquant.api.zoo import cache_dir

SEED = 0
SEQ = 64
VOCAB = 8192
CLASSES = 12
LAYERS, DIM, HEADS, FF = 4, 256, 4, 1024
TRAIN_STEPS = 800
BATCH = 16
LR = 5e-4
SPLIT = 0.85
PAD, UNK, CLS, SEP = 0, 1, 2, 3
_SKIP = {"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__", "turtledemo", "ensurepip"}
_NOT_CODE = {"encodings", "pydoc_data"}  # codec tables and a help-text dump: not source code
_TOKEN = re.compile(r"[A-Za-z_]+|\d+|[^\sA-Za-z_\d]")
RESULTS = Path(__file__).parent / "results" / "transformers_trained.md"


@dataclass
class Corpus:
    """Token ids per class (before / after the SPLIT mark), the vocabulary and the class names."""
    names: list[str]
    train: list[np.ndarray]
    test: list[np.ndarray]
    vocab: dict[str, int]


def _package_texts() -> dict[str, str]:
    """Source text of every top-level stdlib package / module (tests and tools left out), files in sorted order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts: dict[str, list[str]] = {}
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if _SKIP & set(rel.parts) or rel.parts[0].startswith("test"):
            continue
        try:
            text = p.read_text(encoding="utf-8")
            ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        texts.setdefault(rel.parts[0].removesuffix(".py"), []).append(text)
    return {k: "\n".join(v) for k, v in texts.items()}


def corpus() -> Corpus:
    """The CLASSES largest stdlib packages by source size (ties by name), tokenized (lower-case words, numbers,
    punctuation); vocabulary: the VOCAB - 4 most frequent training tokens (ties by token) after PAD/UNK/CLS/SEP."""
    texts = _package_texts()
    names = sorted(sorted(set(texts) - _NOT_CODE), key=lambda k: -len(texts[k]))[:CLASSES]
    names.sort()
    toks = [_TOKEN.findall(texts[n].lower()) for n in names]
    cuts = [int(len(t) * SPLIT) for t in toks]
    counts = Counter(tok for t, c in zip(toks, cuts, strict=True) for tok in t[:c])
    common = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:VOCAB - 4]
    vocab = {tok: i + 4 for i, (tok, _) in enumerate(common)}
    ids = [np.array([vocab.get(tok, UNK) for tok in t], np.int64) for t in toks]
    return Corpus(names, [a[:c] for a, c in zip(ids, cuts, strict=True)],
                  [a[c:] for a, c in zip(ids, cuts, strict=True)], vocab)


def make_rows(windows: list[np.ndarray], seq: int = SEQ) -> dict[str, np.ndarray]:
    """[CLS] + window (+ [SEP]) padded to `seq`: input_ids, attention_mask, token_type_ids [n, seq] int64."""
    ids = np.zeros((len(windows), seq), np.int64)
    for i, w in enumerate(windows):
        row = np.concatenate([[CLS], w[:seq - 2], [SEP]])
        ids[i, :len(row)] = row
    mask = (ids != PAD).astype(np.int64)
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}


def sample_windows(c: Corpus, split: str, count: int, rng: np.random.Generator) -> tuple[list[np.ndarray], np.ndarray]:
    """`count` random windows (class uniform; length uniform in [SEQ // 4, SEQ - 2]) from `split`."""
    parts = c.train if split == "train" else c.test
    labels = rng.integers(0, len(parts), size=count)
    out = []
    for y in labels:
        n = int(rng.integers(SEQ // 4, SEQ - 1))
        s = int(rng.integers(0, len(parts[y]) - n))
        out.append(parts[y][s:s + n])
    return out, labels


def test_set(c: Corpus, per_class: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Held-out rows: `per_class` evenly spaced, non-overlapping full windows of each class's test text."""
    wins, labels = [], []
    for y, ids in enumerate(c.test):
        n = SEQ - 2
        starts = np.linspace(0, len(ids) - n, per_class).astype(int) if len(ids) >= n * per_class else \
            np.arange(0, len(ids) - n + 1, n)[:per_class]
        wins += [ids[s:s + n] for s in starts]
        labels += [y] * len(starts)
    return make_rows(wins), np.array(labels)


def bert_config():
    from transformers import BertConfig

    return BertConfig(vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      intermediate_size=FF, max_position_embeddings=SEQ, num_labels=CLASSES, type_vocab_size=2)


def classifier():
    """transformers BertModel (no pooler) + masked mean pooling + dropout + Linear: the sentence-transformers style
    classifier. forward(input_ids, attention_mask, token_type_ids, labels=None) -> (logits, loss or None). (The [CLS]
    pooler of BertForSequenceClassification sat at chance for 120 steps trained from scratch on one core; mean pooling
    learns within the budget.)"""
    import torch
    from transformers import BertModel

    class MeanPoolClassifier(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = BertModel(bert_config(), add_pooling_layer=False)
            self.dropout = torch.nn.Dropout(0.1)
            self.head = torch.nn.Linear(DIM, CLASSES)

        def forward(self, input_ids, attention_mask, token_type_ids, labels=None):
            h = self.bert(input_ids=input_ids, attention_mask=attention_mask,
                          token_type_ids=token_type_ids).last_hidden_state
            m = attention_mask[..., None].to(h.dtype)
            logits = self.head(self.dropout((h * m).sum(1) / m.sum(1).clamp(min=1.0)))
            loss = None if labels is None else torch.nn.functional.cross_entropy(logits, labels)
            return logits, loss

    return MeanPoolClassifier()


def _key() -> str:
    return f"bert_meanpool_{LAYERS}x{DIM}_v{VOCAB}_c{CLASSES}_s{TRAIN_STEPS}_b{BATCH}_seed{SEED}"


def train(c: Corpus, log: bool = True):
    """The trained classifier (cached state dict + info json in $NETQUANT_CACHE/trained), one torch thread."""
    import torch

    folder = cache_dir() / "trained"
    folder.mkdir(parents=True, exist_ok=True)
    weights, meta = folder / f"{_key()}.pt", folder / f"{_key()}.json"
    torch.manual_seed(SEED)
    model = classifier()
    if weights.is_file() and meta.is_file():
        model.load_state_dict(torch.load(weights))
        return model.eval(), json.loads(meta.read_text())
    torch.set_num_threads(1)
    rng = np.random.default_rng(SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    warm = TRAIN_STEPS // 10
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, TRAIN_STEPS) / TRAIN_STEPS)))
    model.train()
    t0 = time.perf_counter()
    recent: list[float] = []
    for step in range(TRAIN_STEPS):
        wins, labels = sample_windows(c, "train", BATCH, rng)
        rows = make_rows(wins, max(len(w) for w in wins) + 2)  # pad to the batch's longest: faster steps
        _, loss = model(**{k: torch.from_numpy(v) for k, v in rows.items()}, labels=torch.from_numpy(labels))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        recent = [*recent[-19:], loss.item()]
        if log and step % 20 == 0:
            print(f"step {step} loss (mean of 20) {np.mean(recent):.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    model.eval()
    info = {"train_seconds": round(time.perf_counter() - t0, 1), "steps": TRAIN_STEPS, "batch": BATCH,
            "final_loss": round(float(np.mean(recent)), 4), "parameters": sum(p.numel() for p in model.parameters()),
            "classes": c.names, "threads": 1}
    tmp = weights.with_suffix(".tmp")
    torch.save(model.state_dict(), tmp)
    tmp.replace(weights)
    meta.write_text(json.dumps(info))
    return model, info


# ---------------------------------------------------------------------------------------------------- export
class _Logits:
    """forward(input_ids, attention_mask, token_type_ids) -> logits: the wrapper transformers 5 models need."""

    def __new__(cls, model):
        import torch

        class Wrapped(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = model

            def forward(self, input_ids, attention_mask, token_type_ids):
                return self.model(input_ids, attention_mask, token_type_ids)[0]

        return Wrapped().eval()


NAMES = ["input_ids", "attention_mask", "token_type_ids"]


def export_onnx(model, form: str) -> Path:
    """The classifier as ONNX in the cache: form 'torchscript' (torch.onnx.export dynamo=False, opset 17) or 'dynamo'
    (dynamo=True, its default opset); dynamic batch and sequence axes."""
    import warnings

    import torch

    target = cache_dir() / "trained" / f"{_key()}_{form}.onnx"
    if target.exists():
        return target
    wrapped = _Logits(model)
    rows = make_rows([np.arange(4, 4 + SEQ - 2), np.arange(10, 40)])
    args = tuple(torch.from_numpy(rows[k]) for k in NAMES)
    tmp = target.with_suffix(".tmp.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if form == "torchscript":
            torch.onnx.export(wrapped, args, str(tmp), opset_version=17, input_names=NAMES, output_names=["logits"],
                              dynamic_axes={**{k: {0: "batch", 1: "seq"} for k in NAMES}, "logits": {0: "batch"}},
                              dynamo=False)
        else:
            batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq", max=SEQ)
            torch.onnx.export(wrapped, args, input_names=NAMES, output_names=["logits"], dynamo=True,
                              dynamic_shapes={k: {0: batch, 1: seq} for k in NAMES}).save(str(tmp))
    tmp.replace(target)
    return target


# ---------------------------------------------------------------------------------------------------- measuring
@functools.cache
def _peers():
    """benchmarks/transformer_encoders.py (its methods: netquant default, ORT dynamic / static, NNCF), loaded by
    path (benchmarks/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_transformers", Path(__file__).parent / "transformer_encoders.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_transformers"] = mod
    spec.loader.exec_module(mod)
    return mod


@dataclass
class Row:
    method: str
    path: Path | None
    quant_s: float | None = None
    note: str = ""
    metric: str = "-"
    agree: float | None = None
    ms: dict = None  # batch -> ms
    attention: dict | None = None


def _batches(feeds: dict[str, np.ndarray], size: int) -> list[dict[str, np.ndarray]]:
    n = len(next(iter(feeds.values())))
    return [{k: v[i:i + size] for k, v in feeds.items()} for i in range(0, n, size)]


def measure(name: str, src: Path, calib: list[dict], evals: dict[str, np.ndarray], score, timing: dict[int, dict],
            work: Path, rounds: int, per_round: int) -> list[Row]:
    """Quantize `src` with every method, then each file's metric (score(outputs) -> (text, predictions)), agreement
    of its predictions with FP32's, latency per batch size (interleaved), size and quantization time."""
    import warnings

    import onnxruntime as ort

    from netquant.analysis.timing import interleaved_ms

    peers = _peers()
    case = peers.Case(name, src, calib, {})
    rows = [Row("FP32", src, note="source file")]
    for label, fn in peers.methods():
        out = work / f"{abs(hash((name, label)))}.onnx"
        t = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                note = fn(case, out)
        except Exception as exc:  # noqa: BLE001 - a peer failing is a result to report
            rows.append(Row(label, None, note=f"failed: {type(exc).__name__}: {str(exc)[:160]}"))
            print(rows[-1].note, flush=True)
            continue
        rows.append(Row(label, out, time.perf_counter() - t, note))
        if label == "netquant default":
            rows[-1].attention = _LAST_ATTENTION.pop("measured", None)
        print(f"{name}: {label} {rows[-1].quant_s:.1f} s", flush=True)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    ok, sessions = [], []
    for r in rows:
        if r.path is None:
            continue
        try:
            sessions.append(ort.InferenceSession(str(r.path), so, providers=["CPUExecutionProvider"]))
            ok.append(r)
        except Exception as exc:  # noqa: BLE001 - a file onnxruntime rejects is a result
            r.note = "; ".join(filter(None, [r.note, f"onnxruntime cannot load the file: {str(exc)[:200]}"]))
    preds = []
    for r, sess in zip(ok, sessions, strict=True):
        outs = [sess.run(None, b)[0] for b in _batches(evals, 8)]
        r.metric, p = score(np.concatenate(outs))
        preds.append(p)
    for r, p in zip(ok, preds, strict=True):
        r.agree = float(np.mean([a == b for a, b in zip(p, preds[0], strict=True)]))
    for r in ok:
        r.ms = {}
    for batch, feeds in timing.items():
        ms = interleaved_ms([lambda s=s, f=feeds: s.run(None, f) for s in sessions], per_round=per_round,
                            rounds=rounds)
        for r, m in zip(ok, ms, strict=True):
            r.ms[batch] = m
        print(f"{name} batch {batch}: " + ", ".join(f"{r.method} {r.ms[batch]:.1f} ms" for r in ok), flush=True)
    return rows


_LAST_ATTENTION: dict = {}


def _netquant_default(case, out: Path) -> str:
    """peers.netquant_default, keeping the placement's attention measurements for the report."""
    import netquant

    qm = netquant.quantize_onnx(str(case.path), case.calib, quiet=True)
    qm.export(out)
    p = qm.placement
    if p is None:
        return ""
    _LAST_ATTENTION["measured"] = p.measured.get("attention")
    s = p.summary()
    kept = (p.measured.get("attention") or {}).get("kept") or ["none"]
    return (f"placement: {s['int8_regions']} int8 (static), {s['dynamic_regions']} dynamic, {s['float_regions']} "
            f"float regions; transformer ops kept int8 by measurement: {', '.join(kept)}")


@contextlib.contextmanager
def _own_netquant_method(peers):
    """peers.methods() with its netquant default replaced by _netquant_default (which keeps the attention tries)."""
    original = peers.methods
    peers.methods = lambda: [("netquant default", _netquant_default)] + \
        [m for m in original() if m[0] != "netquant default"]
    try:
        yield peers
    finally:
        peers.methods = original


def render_rows(title: str, rows: list[Row], metric_name: str, batches: list[int]) -> list[str]:
    head = ["method", metric_name, "top-1 agreement with FP32"] + [f"ms batch {b}" for b in batches] + \
        [f"speed batch {b}" for b in batches] + ["file MB", "quant s", "note"]
    lines = [f"## {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    fp32 = rows[0].ms or {}
    for r in rows:
        ms = r.ms or {}
        cells = [r.method, r.metric, "-" if r.agree is None else f"{r.agree:.4f}"] + \
            [f"{ms[b]:.2f}" if b in ms else "-" for b in batches] + \
            [f"{fp32[b] / ms[b]:.2f}x" if b in ms and b in fp32 else "-" for b in batches] + \
            ["-" if r.path is None else f"{r.path.stat().st_size / 1e6:.2f}",
             "-" if r.quant_s is None else f"{r.quant_s:.1f}", r.note.replace("|", "/")]
        lines.append("| " + " | ".join(cells) + " |")
    att = next((r.attention for r in rows if r.attention), None)
    if att:
        lines += ["", "netquant's transformer-op placement (analysis.attention), every try measured in this run "
                  "(batch 1 wall clock against the file as placed so far; loss = 1 - output cosine vs the source over "
                  "the kept calibration batches):", "",
                  "| kind | mode | nodes | current ms | try ms | current loss | try loss | kept | why |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for t in att["tries"]:
            lines.append(f"| {t['kind']} | {t['mode']} | {t['nodes']} | {t['current_ms']:.2f} | {t['ms']:.2f} | "
                         f"{_loss_cell(t['current_loss'])} | {_loss_cell(t['loss'])} | {'yes' if t['kept'] else 'no'} | "
                         f"{t['reason']} |")
    return lines + [""]


def _loss_cell(loss: float | None) -> str:
    return "-" if loss is None else f"{loss:.3g}"


def attention_study(src: Path, calib: list[dict], timing: dict[int, dict]) -> list[str]:
    """Every transformer-op try of analysis.attention without placement's time cap, on netquant's default export of
    `src`, timed at each batch of `timing` (the placement's own step stops at half its cap, see the tables above)."""
    import onnx

    import netquant
    from netquant.analysis.attention import choose_attention
    from netquant.export.onnx_qdq import build_qdq_model, fp32_onnx

    qm = netquant.quantize_onnx(str(src), calib, quiet=True)
    qm.qgraph.attention_rewrite = None
    base, fp32 = build_qdq_model(qm.qgraph)[0], fp32_onnx(qm.qgraph)
    lines = ["All of analysis.attention's tries on this model without placement's time cap (netquant's default export "
             "before the attention step; loss over 4 calibration samples):", "",
             "| batch | kind | mode | nodes | current ms | try ms | current loss | try loss | kept | why |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for batch, feeds in timing.items():
        result = choose_attention(base, onnx.load(str(src)), fp32, feeds, calib[:4], all_losses=True)
        for t in result.tries:
            lines.append(f"| {batch} | {t.kind} | {t.mode} | {t.nodes} | {t.current_ms:.2f} | {t.ms:.2f} | "
                         f"{t.current_loss:.3g} | {t.loss:.3g} | {'yes' if t.kept else 'no'} | {t.reason} |")
    return lines + [""]


def bert_case(args: argparse.Namespace, work: Path) -> list[tuple[str, list[Row], str]]:
    import torch

    c = corpus()
    model, info = train(c)
    rows, labels = test_set(c, args.per_class)
    calib_w, _ = sample_windows(c, "train", args.calib, np.random.default_rng(SEED + 7))
    calib_rows = make_rows(calib_w)
    calib = [{k: v[i:i + 1] for k, v in calib_rows.items()} for i in range(args.calib)]
    with torch.no_grad():
        ref = model(**{k: torch.from_numpy(v[:16]) for k, v in rows.items()})[0].numpy()
        acc_torch = float((np.concatenate([model(**{k: torch.from_numpy(v) for k, v in b.items()})[0].numpy()
                                           for b in _batches(rows, 32)]).argmax(1) == labels).mean())

    def score(logits: np.ndarray) -> tuple[str, list[int]]:
        pred = logits.argmax(1)
        return f"{(pred == labels).mean():.4f}", pred.tolist()

    timing = {1: {k: v[:1] for k, v in rows.items()}, 8: {k: v[:8] for k, v in rows.items()}}
    out = []
    peers = _peers()
    for form in args.forms:
        try:
            path = export_onnx(model, form)
        except Exception as exc:  # noqa: BLE001 - an exporter failing is a result
            out.append((f"{form} export", [Row("FP32", None, note=f"export failed: {type(exc).__name__}: "
                                                                   f"{str(exc)[:200]}")], ""))
            continue
        import onnxruntime as ort

        got = ort.InferenceSession(str(path)).run(None, {k: v[:16] for k, v in rows.items()})[0]
        diff = float(np.abs(got - ref).max())
        with _own_netquant_method(peers):
            res = measure(f"BERT classifier ({form})", path, calib, rows, score, timing, work, args.rounds,
                          args.repeats)
        title = (f"Trained BERT classifier (transformers BertModel + mean pooling), {form} export: which stdlib package a 64-token window "
                 f"comes from ({CLASSES} classes)")
        note = (f"{info['parameters'] / 1e6:.2f}M parameters ({LAYERS} layers, width {DIM}, {HEADS} heads, ff {FF}, "
                f"vocab {VOCAB}); trained {info['steps']} steps of batch {info['batch']} on one thread in "
                f"{info['train_seconds']:.0f} s (cached); torch accuracy {acc_torch:.4f} on {len(labels)} held-out "
                f"windows; ONNX vs torch max |logit diff| {diff:.2e}")
        if form == args.forms[0] and not args.quick:
            note += "\n\n" + "\n".join(attention_study(path, calib, timing))
        out.append((title, res, note))
    return out


def ocr_case(args: argparse.Namespace, work: Path) -> list[tuple[str, list[Row], str]]:
    from netquant.api import zoo
    from netquant.data.ocr import ctc_greedy_decode, rec_batch, score_lines
    from netquant.data.text_render import make_text_lines

    path = zoo.ppocr_v6_model_path("rec")
    words = zoo.ppocr_v6_rec_dictionary()
    calib_x = rec_batch(make_text_lines(args.calib, seed=1000))
    lines = make_text_lines(args.ocr_eval, seed=2000)
    x = rec_batch(lines)
    truth = [line.text for line in lines]

    def score(probs: np.ndarray) -> tuple[str, list[str]]:
        texts = ctc_greedy_decode(probs, words)
        s = score_lines(texts, truth)
        return f"{s.line_acc:.4f} / {s.char_acc:.4f}", texts

    import onnx

    name = onnx.load(str(path), load_external_data=False).graph.input[0].name
    calib = [{name: calib_x[i:i + 1]} for i in range(len(calib_x))]
    evals = {name: x}
    timing = {1: {name: x[:1]}, 8: {name: x[:8]}}
    with _own_netquant_method(_peers()) as peers:
        res = measure("PP-OCRv6 rec small", path, calib, evals, score, timing, work, args.rounds, args.repeats)
        del peers
    title = "PP-OCRv6 small recognizer from the rapidocr==3.10.0 wheel (conv backbone + transformer neck)"
    study = [] if args.quick else attention_study(path, calib, {1: timing[1]})
    note = (f"zoo.ppocr_v6_model_path('rec'); metric: exact lines / character accuracy on {len(lines)} rendered "
            f"lines (netquant.data.text_render, seed 2000; ground truth known); calibration: {args.calib} other lines")
    note += "".join("\n\n" + "\n".join(study) for _ in study[:1])
    return [(title, res, note)]


def main() -> int:
    import os
    import tempfile

    import onnxruntime as ort

    from netquant.atomic import write_text_atomic
    from netquant.platforms.targets import host_info

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train-only", action="store_true")
    ap.add_argument("--models", default="bert,ocr")
    ap.add_argument("--forms", default="torchscript,dynamo")
    ap.add_argument("--calib", type=int, default=32)
    ap.add_argument("--per-class", type=int, default=40)
    ap.add_argument("--ocr-eval", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--busy", action="store_true", help="a busy host: one spinning process per core (quant_time."
                    "busy_cores), started before the first model and stopped after the last")
    ap.add_argument("--quick", action="store_true", help="small sets, results not written")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    args.forms = args.forms.split(",")
    from quant_time import busy_cores  # (benchmarks/ is still on the path here)

    # keep benchmarks/ off the path: `import transformers` must be Hugging Face's, whatever files sit here
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    if args.train_only:
        c = corpus()
        print("classes:", c.names, flush=True)
        print(train(c)[1])
        return 0
    if args.quick:
        args.calib, args.per_class, args.ocr_eval, args.rounds, args.repeats = 8, 4, 16, 3, 2
    start, load0 = time.perf_counter(), os.getloadavg()
    sections = []
    with tempfile.TemporaryDirectory(prefix="netquant_trained_") as tmp, busy_cores(args.busy):
        if "bert" in args.models:
            sections += bert_case(args, Path(tmp))
        if "ocr" in args.models:
            sections += ocr_case(args, Path(tmp))
        load1 = os.getloadavg()
        lines = ["# Trained transformers: netquant default vs onnxruntime quantize_dynamic / quantize_static and NNCF",
                 "", host_info(ort_threads=1).markdown(),
                 f"onnxruntime {ort.__version__}; one run of `python benchmarks/transformers_trained.py"
                 f"{' --busy' if args.busy else ''}` ({time.perf_counter() - start:.0f} s; "
                 f"{'busy host: one spinning process per core started by the benchmark; ' if args.busy else ''}"
                 f"load average {load0[0]:.1f} at the start, {load1[0]:.1f} at the end; absolute times are noisy, "
                 "ratios within one table are the comparable numbers). Latency: one onnxruntime intra-op thread, every file of a table interleaved "
                 f"in {args.rounds} rounds of {args.repeats} runs, medians; speed = FP32 / method. Methods as in "
                 "benchmarks/transformer_encoders.py (netquant default = quantize_onnx, objective balanced, onnxruntime_int8; "
                 "ORT quantize_dynamic per-channel QInt8 weights; ORT quantize_static QDQ per-channel MinMax QUInt8 "
                 "activations after quant_pre_process; NNCF nncf.quantize model_type=TRANSFORMER); quant s includes "
                 "netquant's export with its validation.", ""]
        for title, rows, note in sections:
            metric = "exact lines / char acc" if "OCR" in title else "accuracy"
            lines += render_rows(title, rows, metric, [1, 8])[:2] + [note, ""] + render_rows(title, rows, metric,
                                                                                              [1, 8])[2:]
        text = "\n".join(lines)
    if not args.quick:
        write_text_atomic(args.out, text, "benchmark results")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
