"""Numeric ai.onnx.ml ops and TfIdfVectorizer (integer n-grams; string inputs are out of scope)."""

from __future__ import annotations

from typing import Any

import torch

from netquant.errors import UnsupportedOpError

from ._util import floats, ints
from .registry import OpContext, register_op

Tensor = torch.Tensor
ML = "ai.onnx.ml"

_LEQ, _LT, _GTE, _GT, _EQ, _NEQ, _MEMBER = range(7)


@register_op("TreeEnsemble", domain=ML)
def tree_ensemble(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """Evaluate every tree for all rows at once (one vectorised step per tree level), then aggregate the
    leaf weights per target (0 average, 1 sum, 2 min, 3 max)."""
    x = inputs[0]
    if attrs.get("post_transform", 0) != 0:
        raise UnsupportedOpError(ctx.unsupported(f"post_transform={attrs['post_transform']}"))
    dev = x.device
    feat = torch.tensor(ints(attrs["nodes_featureids"]), device=dev)
    modes = torch.as_tensor(attrs["nodes_modes"]).to(torch.int64).reshape(-1).to(dev)
    splits = torch.as_tensor(attrs["nodes_splits"]).reshape(-1).to(dev, torch.float64)
    t_ids, f_ids = (torch.tensor(ints(attrs[k]), device=dev) for k in ("nodes_truenodeids", "nodes_falsenodeids"))
    t_leaf, f_leaf = (torch.tensor(ints(attrs[k]), device=dev).bool() for k in ("nodes_trueleafs",
                                                                                 "nodes_falseleafs"))
    missing = torch.tensor(ints(attrs.get("nodes_missing_value_tracks_true", [0] * len(feat))), device=dev).bool()
    leaf_w = torch.as_tensor(attrs["leaf_weights"]).reshape(-1).to(dev, torch.float64)
    leaf_t = torch.tensor(ints(attrs["leaf_targetids"]), device=dev)
    n_targets = attrs["n_targets"]
    # set-membership nodes: members listed in node order, each set terminated by NaN
    members = torch.full((len(feat), 1), float("nan"), dtype=torch.float64, device=dev)
    if "membership_values" in attrs:
        vals = floats(attrs["membership_values"])
        sets, cur = [], []
        for v in vals:
            if v != v:
                sets.append(cur)
                cur = []
            else:
                cur.append(v)
        width = max([len(s) for s in sets] + [1])
        members = torch.full((len(feat), width), float("nan"), dtype=torch.float64, device=dev)
        member_nodes = [i for i, m in enumerate(modes.tolist()) if m == _MEMBER]
        for node, s in zip(member_nodes, sets):
            members[node, : len(s)] = torch.tensor(s, dtype=torch.float64)
    xd = x.to(torch.float64)
    rows = torch.arange(x.shape[0], device=dev)
    agg = attrs.get("aggregate_function", 1)
    roots = ints(attrs["tree_roots"])
    per_tree = []
    for root in roots:
        if bool(t_leaf[root]) and bool(f_leaf[root]) and int(t_ids[root]) == int(f_ids[root]):
            leaf = torch.full_like(rows, root)
        else:
            node = torch.full_like(rows, root)
            done = torch.zeros_like(rows, dtype=torch.bool)
            leaf = torch.zeros_like(rows)
            for _ in range(len(feat) + 1):
                if bool(done.all()):
                    break
                v = xd[rows, feat[node]]
                s = splits[node]
                m = modes[node]
                cond = torch.stack([v <= s, v < s, v >= s, v > s, v == s, v != s,
                                    (v.unsqueeze(1) == members[node]).any(1)], 1).gather(1, m.unsqueeze(1))[:, 0]
                cond = cond | (missing[node] & torch.isnan(v))
                nxt = torch.where(cond, t_ids[node], f_ids[node])
                is_leaf = torch.where(cond, t_leaf[node], f_leaf[node])
                leaf = torch.where(~done & is_leaf, nxt, leaf)
                done = done | is_leaf
                node = torch.where(done, node, nxt)
        per_tree.append(leaf)
    leaves = torch.stack(per_tree, 1)  # (rows, trees)
    w, t = leaf_w[leaves], leaf_t[leaves]
    if agg in (0, 1):
        out = torch.zeros(x.shape[0], n_targets, dtype=torch.float64, device=dev).scatter_add_(1, t, w)
        if agg == 0:
            out = out / len(roots)
    elif agg in (2, 3):
        fill = float("inf") if agg == 2 else -float("inf")
        out = torch.full((x.shape[0], n_targets), fill, dtype=torch.float64, device=dev)
        out = out.scatter_reduce(1, t, w, "amin" if agg == 2 else "amax", include_self=True)
        info = torch.finfo(x.dtype)
        out = torch.where(torch.isinf(out), torch.full_like(out, info.max if agg == 2 else info.min), out)
    else:
        raise UnsupportedOpError(ctx.unsupported(f"aggregate_function={agg}"))
    return [out.to(x.dtype)]


@register_op("Binarizer", domain=ML)
def binarizer(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x = inputs[0]
    return [(x > attrs.get("threshold", 0.0)).to(x.dtype)]


@register_op("ArrayFeatureExtractor", domain=ML)
def array_feature_extractor(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x, idx = inputs[0], inputs[1].to(torch.int64).reshape(-1)
    out = torch.index_select(x, x.dim() - 1, idx)
    return [out.reshape(1, -1) if x.dim() == 1 else out]


@register_op("TfIdfVectorizer")
def tfidf_vectorizer(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """Count the pool's n-grams (min..max length, items up to max_skip_count apart) per row of integer
    tokens; mode TF (counts), IDF (presence * weight) or TFIDF (count * weight)."""
    x = inputs[0]
    if "pool_int64s" not in attrs:
        raise UnsupportedOpError(ctx.unsupported("string n-gram pools"))
    pool = ints(attrs["pool_int64s"])
    counts = ints(attrs["ngram_counts"]) + [len(pool)]
    indexes = ints(attrs["ngram_indexes"])
    lo, hi, skip = attrs["min_gram_length"], attrs["max_gram_length"], attrs["max_skip_count"]
    mode = attrs.get("mode", "TF")
    table: dict[tuple[int, ...], int] = {}
    k = 0
    for n in range(1, len(counts)):
        start, end = counts[n - 1], counts[n]
        for j in range(start, end, n):
            table[tuple(pool[j:j + n])] = indexes[k]
            k += 1
    width = max(indexes) + 1
    rows = x.reshape(1, -1) if x.dim() == 1 else x.reshape(x.shape[0], -1)
    out = torch.zeros(rows.shape[0], width, dtype=torch.float32)
    for r, row in enumerate(rows.tolist()):
        for n in range(lo, hi + 1):
            for s in range(0, (skip if n > 1 else 0) + 1):
                step = s + 1
                for i in range(len(row) - (n - 1) * step):
                    key = tuple(row[i + step * j] for j in range(n))
                    if key in table:
                        out[r, table[key]] += 1
    if mode in ("IDF", "TFIDF"):
        weights = torch.tensor(floats(attrs["weights"]), dtype=torch.float32) if "weights" in attrs else \
            torch.ones(width)
        out = (out > 0).float() * weights if mode == "IDF" else out * weights
    elif mode != "TF":
        raise UnsupportedOpError(ctx.unsupported(f"mode '{mode}'"))
    return [(out[0] if x.dim() == 1 else out).to(x.device)]
