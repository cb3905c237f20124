"""platforms.ort_probes: onnxruntime's fused SkipLayerNormalization timed against Add + LayerNormalization here."""

from __future__ import annotations

from netquant.platforms.ort_probes import SLOWER_MARGIN, SkipLayerNormProbe, skip_layer_norm_probe


def test_probe_times_both_forms_once_per_hidden_size() -> None:
    probe = skip_layer_norm_probe(64)
    assert probe.hidden == 64 and probe.fused_us > 0 and probe.apart_us > 0
    assert skip_layer_norm_probe(64) is probe  # measured once per process
    assert probe.fused_slower == (probe.fused_us > SLOWER_MARGIN * probe.apart_us)
    assert "SkipLayerNormalization" in probe.describe() and "[1, 128, 64]" in probe.describe()


def test_only_a_clear_margin_counts_as_slower() -> None:
    assert SkipLayerNormProbe(384, 255.0, 40.0).fused_slower  # measured on an AMD EPYC (AVX-512), onnxruntime 1.32
    assert not SkipLayerNormProbe(384, 45.0, 40.0).fused_slower  # within the noise margin
    assert not SkipLayerNormProbe(384, 30.0, 40.0).fused_slower
