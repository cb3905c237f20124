"""Recurrent ops: RNN, GRU, LSTM (forward / reverse / bidirectional, sequence_lens, layout, clip,
custom activations, peepholes, input_forget, linear_before_reset).

The input projection X @ W^T + Wb of all time steps is one matmul; only the recurrence loops over time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from netquant.errors import UnsupportedOpError

from ._util import opt
from .registry import OpContext, register_op

Tensor = torch.Tensor
Act = Callable[[Tensor], Tensor]

_TAKES = {"Affine": 2, "LeakyRelu": 1, "ThresholdedRelu": 1, "ScaledTanh": 2, "HardSigmoid": 2, "Elu": 1}
_DEFAULTS = {"LeakyRelu": (0.01,), "ThresholdedRelu": (1.0,), "HardSigmoid": (0.2, 0.5), "Elu": (1.0,),
             "ScaledTanh": (1.0, 1.0), "Affine": (1.0, 0.0)}


def _make_act(name: str, a: float | None, b: float | None, ctx: OpContext) -> Act:
    key = name.lower()
    if key == "sigmoid":
        return torch.sigmoid
    if key == "tanh":
        return torch.tanh
    if key == "relu":
        return torch.relu
    if key == "softsign":
        return F.softsign
    if key == "softplus":
        return F.softplus
    if key == "leakyrelu":
        return lambda x: F.leaky_relu(x, a)
    if key == "thresholdedrelu":
        return lambda x: torch.where(x > a, x, torch.zeros_like(x))
    if key == "hardsigmoid":
        return lambda x: torch.clamp(a * x + b, 0, 1)
    if key == "elu":
        return lambda x: F.elu(x, a)
    if key == "scaledtanh":
        return lambda x: a * torch.tanh(b * x)
    if key == "affine":
        return lambda x: a * x + b
    raise UnsupportedOpError(ctx.unsupported(f"activation '{name}'"))


def _activations(attrs: dict[str, Any], defaults: list[str], num_dir: int, ctx: OpContext) -> list[list[Act]]:
    names = list(attrs.get("activations", defaults * num_dir))
    if len(names) == len(defaults) and num_dir == 2:
        names = names * 2
    alphas = list(attrs.get("activation_alpha", []))
    betas = list(attrs.get("activation_beta", []))
    acts: list[Act] = []
    ai = bi = 0
    canon = {k.lower(): k for k in _TAKES}
    for n in names:
        key = canon.get(n.lower(), n)
        a = b = None
        d = _DEFAULTS.get(key, ())
        if _TAKES.get(key, 0) >= 1:
            a = alphas[ai] if ai < len(alphas) else d[0]
            ai += 1
        if _TAKES.get(key, 0) >= 2:
            b = betas[bi] if bi < len(betas) else d[1]
            bi += 1
        acts.append(_make_act(n, a, b, ctx))
    k = len(defaults)
    return [acts[i * k:(i + 1) * k] for i in range(num_dir)]


def _reverse_by_length(x: Tensor, lens: Tensor | None) -> Tensor:
    """Reverse each sequence (time-major [T, B, ...]) within its own length."""
    if lens is None:
        return x.flip(0)
    t = x.shape[0]
    pos = torch.arange(t, device=x.device).reshape(t, 1)
    L = lens.to(torch.int64).reshape(1, -1).to(x.device)
    src = torch.where(pos < L, L - 1 - pos, pos)
    return torch.gather(x, 0, src.reshape(t, -1, *([1] * (x.dim() - 2))).expand_as(x))


class _Spec:
    def __init__(self, inputs: list[Tensor | None], attrs: dict[str, Any], gates: int, ctx: OpContext) -> None:
        self.x, self.w, self.r = inputs[0], inputs[1], inputs[2]
        self.b, self.lens = opt(inputs, 3), opt(inputs, 4)
        self.h0 = opt(inputs, 5)
        self.layout = attrs.get("layout", 0)
        if self.layout:
            self.x = self.x.transpose(0, 1)
            if self.h0 is not None:
                self.h0 = self.h0.transpose(0, 1)
        self.direction = attrs.get("direction", "forward")
        if self.direction not in ("forward", "reverse", "bidirectional"):
            raise UnsupportedOpError(ctx.unsupported(f"direction '{self.direction}'"))
        self.num_dir = 2 if self.direction == "bidirectional" else 1
        self.hidden = attrs.get("hidden_size", self.r.shape[-1])
        self.clip = attrs.get("clip")
        self.gates = gates
        t, b = self.x.shape[0], self.x.shape[1]
        self.T, self.B = t, b
        if self.lens is not None and bool((self.lens.to(torch.int64) >= t).all()):
            self.lens = None

    def bias(self, d: int) -> tuple[Tensor, Tensor]:
        n = self.gates * self.hidden
        if self.b is None:
            z = torch.zeros(n, dtype=self.x.dtype, device=self.x.device)
            return z, z
        return self.b[d, :n], self.b[d, n:]

    def init_h(self, d: int) -> Tensor:
        if self.h0 is None:
            return torch.zeros(self.B, self.hidden, dtype=self.x.dtype, device=self.x.device)
        return self.h0[d]

    def seq_in(self, d: int) -> Tensor:
        x = self.x
        if d == 1 or self.direction == "reverse":
            x = _reverse_by_length(x, self.lens)
        wb, _ = self.bias(d)
        return torch.matmul(x, self.w[d].t()) + wb  # (T, B, G*H)

    def step_mask(self, t: int) -> Tensor | None:
        if self.lens is None:
            return None
        return (t < self.lens.to(torch.int64).to(self.x.device)).reshape(-1, 1)

    def clipped(self, g: Tensor) -> Tensor:
        return g if self.clip is None else torch.clamp(g, -self.clip, self.clip)

    def finish(self, ys: list[Tensor], d: int) -> Tensor:
        y = torch.stack(ys)
        if d == 1 or self.direction == "reverse":
            y = _reverse_by_length(y, self.lens)
        return y

    def outputs(self, ys: list[Tensor], hs: list[Tensor], extra: list[list[Tensor]]) -> list[Tensor]:
        y = torch.stack(ys, dim=1)  # (T, D, B, H)
        hh = torch.stack(hs)  # (D, B, H)
        extras = [torch.stack(e) for e in extra]
        if self.layout:
            y = y.permute(2, 0, 1, 3)
            hh = hh.transpose(0, 1)
            extras = [e.transpose(0, 1) for e in extras]
        return [y, hh, *extras]


def _masked(mask: Tensor | None, new: Tensor, old: Tensor) -> Tensor:
    return new if mask is None else torch.where(mask, new, old)


def _out(mask: Tensor | None, h: Tensor) -> Tensor:
    return h if mask is None else torch.where(mask, h, torch.zeros_like(h))


@register_op("RNN")
def rnn(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """H_t = f(X_t W^T + H_{t-1} R^T + Wb + Rb)."""
    s = _Spec(inputs, attrs, 1, ctx)
    acts = _activations(attrs, ["Tanh"], s.num_dir, ctx)
    ys_all, hs = [], []
    for d in range(s.num_dir):
        f = acts[d][0]
        xw = s.seq_in(d)
        _, rb = s.bias(d)
        r = s.r[d].t()
        h = s.init_h(d)
        ys = []
        for t in range(s.T):
            m = s.step_mask(t)
            hn = f(s.clipped(xw[t] + h @ r + rb))
            h = _masked(m, hn, h)
            ys.append(_out(m, hn))
        ys_all.append(s.finish(ys, d))
        hs.append(h)
    return s.outputs(ys_all, hs, [])


@register_op("GRU")
def gru(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """z, r = f(.); h~ = g(X W_h + (r * H) R_h + b)  (or r * (H R_h + Rb_h) with linear_before_reset);
    H = (1 - z) * h~ + z * H_{t-1}.  Gate order z, r, h."""
    s = _Spec(inputs, attrs, 3, ctx)
    acts = _activations(attrs, ["Sigmoid", "Tanh"], s.num_dir, ctx)
    lbr = attrs.get("linear_before_reset", 0)
    hid = s.hidden
    ys_all, hs = [], []
    for d in range(s.num_dir):
        f, g = acts[d]
        xw = s.seq_in(d)
        _, rb = s.bias(d)
        r = s.r[d]
        r_zr, r_h = r[: 2 * hid].t(), r[2 * hid:].t()
        rb_zr, rb_h = rb[: 2 * hid], rb[2 * hid:]
        h = s.init_h(d)
        ys = []
        for t in range(s.T):
            m = s.step_mask(t)
            xt = xw[t]
            zr = f(s.clipped(xt[:, : 2 * hid] + h @ r_zr + rb_zr))
            z, rr = zr[:, :hid], zr[:, hid:]
            if lbr:
                hc = g(s.clipped(xt[:, 2 * hid:] + rr * (h @ r_h + rb_h)))
            else:
                hc = g(s.clipped(xt[:, 2 * hid:] + (rr * h) @ r_h + rb_h))
            hn = (1 - z) * hc + z * h
            h = _masked(m, hn, h)
            ys.append(_out(m, hn))
        ys_all.append(s.finish(ys, d))
        hs.append(h)
    return s.outputs(ys_all, hs, [])


@register_op("LSTM")
def lstm(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """Gate order i, o, f, c; optional peepholes P = [p_i, p_o, p_f]:
    i = f(. + p_i * C), f = f(. + p_f * C), c~ = g(.), C' = f * C + i * c~, o = f(. + p_o * C'), H = o * h(C')."""
    s = _Spec(inputs, attrs, 4, ctx)
    c0, p = opt(inputs, 6), opt(inputs, 7)
    if c0 is not None and s.layout:
        c0 = c0.transpose(0, 1)
    acts = _activations(attrs, ["Sigmoid", "Tanh", "Tanh"], s.num_dir, ctx)
    couple = attrs.get("input_forget", 0)
    hid = s.hidden
    ys_all, hs, cs = [], [], []
    for d in range(s.num_dir):
        f, g, hact = acts[d]
        xw = s.seq_in(d)
        _, rb = s.bias(d)
        r = s.r[d].t()
        h = s.init_h(d)
        c = c0[d] if c0 is not None else torch.zeros_like(h)
        pi = po = pf = None
        if p is not None:
            pi, po, pf = p[d, :hid], p[d, hid:2 * hid], p[d, 2 * hid:]
        ys = []
        for t in range(s.T):
            m = s.step_mask(t)
            gates = xw[t] + h @ r + rb
            gi, go, gf, gc = gates.split(hid, dim=1)
            if pi is not None:
                gi = gi + pi * c
                gf = gf + pf * c
            i = f(s.clipped(gi))
            fg = 1 - i if couple else f(s.clipped(gf))
            cn = fg * c + i * g(s.clipped(gc))
            if po is not None:
                go = go + po * cn
            o = f(s.clipped(go))
            hn = o * hact(cn)
            h = _masked(m, hn, h)
            c = _masked(m, cn, c)
            ys.append(_out(m, hn))
        ys_all.append(s.finish(ys, d))
        hs.append(h)
        cs.append(c)
    return s.outputs(ys_all, hs, [cs])
