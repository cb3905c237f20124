"""The engines' difference by magnitude (passes.calib_noise), hand-checked on exactly representable values."""

from __future__ import annotations

import torch

from netquant.passes.calib_noise import Kept, NoiseProfile


def test_noise_by_magnitude_by_hand() -> None:
    ex = torch.tensor([2.0 ** -10, -1.0, 48.0, 0.5])
    ort = torch.tensor([2.0 ** -10, -1.0 + 2.0 ** -20, 48.0 + 2.0 ** -12, 0.5])
    p = NoiseProfile.measure(ort, Kept.of(ex))
    assert p is not None and p.top == 48.0
    assert p.at(0.01) == 0.0  # 2^-10 and 0.5 (magnitudes below 1) agree
    assert p.at(2.0) == 2.0 ** -20  # -1.0 and 0.5: the small end of a [-1, 48] tensor keeps its own small noise
    assert p.at(48.0) == 2.0 ** -12
    assert p.at(96.0) == 2.0 ** -12 * 2  # beyond the largest magnitude measured (48): in proportion
    # one more compared extremum (another first batch): magnitude 0.75, difference 2^-16
    q = p.with_point(0.75, 2.0 ** -16)
    assert q.at(2.0) == 2.0 ** -16 and q.at(48.0) == 2.0 ** -12
    # magnitudes go by power-of-two buckets: 0.01 shares [2^-7, 1) with 0.75, 2^-10 has [2^-10, 2^-9) alone
    assert q.at(0.01) == 2.0 ** -16 and q.at(0.001) == 0.0
    # different sizes are not comparable
    assert NoiseProfile.measure(ort[:3], Kept.of(ex)) is None


def test_kept_elements_are_evenly_strided(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr("netquant.passes.calib_noise.KEEP_ELEMENTS", 4)
    x = torch.arange(10, dtype=torch.float32)
    k = Kept.of(x)
    assert k.numel == 10 and k.step == 3 and k.values.tolist() == [0.0, 3.0, 6.0, 9.0]
    ort = x.clone()
    ort[3] += 0.5  # a kept element: seen
    ort[4] += 8.0  # not kept: the profile compares the same strided elements only
    p = NoiseProfile.measure(ort, k)
    assert p is not None and p.at(9.0) == 0.5
