"""The summary names the platform's own format (issue 19: academic_int4 read "0 of 3 regions in INT8, 3 in the wider
format (int8 (W8A8))")."""

from __future__ import annotations

from netquant.api import quantize_onnx
from netquant.cli.quantize_cmd import _placement_line
from netquant.platforms import get_platform
from tests.helpers.placement_models import conv_stack, stack_batches


def test_format_labels() -> None:
    labels = {n: get_platform(n).format_label() for n in ("onnxruntime_int8", "academic_int4", "fp8_e4m3")}
    assert labels == {"onnxruntime_int8": "INT8", "academic_int4": "int4 (W4A4)", "fp8_e4m3": "fp8 (W8A8)"}


def test_a_4_bit_platform_counts_its_regions_in_int4_not_int8() -> None:
    def q(max_loss: float):
        return quantize_onnx(conv_stack(), stack_batches(), "academic_int4", quiet=True, placement_time_s=30.0,
                             max_loss=max_loss)

    qm = q(q(1.0).placement.measured["loss_all_int8"])  # a budget the wider format meets (as tests/api/test_placement)
    p = qm.placement
    wide = sum(r.decision == "wider" for r in p.regions)
    own = sum(r.decision == "int8" for r in p.regions)  # (the decision value of the platform's own format)
    assert wide > 0
    line = _placement_line(qm)
    assert line.startswith(f"balanced: {own} of {len(p.regions)} regions in int4 (W4A4), {wide} in the wider "
                           "format (int8 (W8A8))")
    assert "in INT8" not in line
