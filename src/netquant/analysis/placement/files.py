"""Re-applying a placement file (placement_from): checked against the model, platform and CPU target."""

from __future__ import annotations

import os
from pathlib import Path

from netquant.analysis.attention import rewrite_from_dict
from netquant.analysis.placement.budget import WideFactory, wide_graph
from netquant.analysis.placement.inputs import model_hash
from netquant.analysis.placement.ranges import reapply_clipped_ranges
from netquant.analysis.placement.records import Placement
from netquant.analysis.regions import find_regions, keep_float
from netquant.analysis.wider import widen
from netquant.errors import ConfigError
from netquant.passes.quant_graph import QuantizedGraph


def apply_placement_file(qgraph: QuantizedGraph, path: str | os.PathLike[str],
                         wide: WideFactory | None = None, digest: str | None = None) -> Placement:
    """Keep in float (run in the wider format) the regions a placement file says, after checking it was made for this
    model and platform. digest: the model's hash where `qgraph` is the model quantized again with the file's repair
    (analysis.placement.repair; default: model_hash(qgraph))."""
    placement = Placement.load(path)
    digest = model_hash(qgraph) if digest is None else digest
    if placement.model_sha256 != digest:
        raise ConfigError(f"placement file '{path}' was made for another model (sha256 {placement.model_sha256[:12]}"
                          f"..., this model after clean-up: {digest[:12]}...); measure again (drop placement_from / "
                          "--placement-from) or use the same model and clean-up settings")
    if placement.platform != qgraph.platform.name:
        raise ConfigError(f"placement file '{path}' is for platform '{placement.platform}', not "
                          f"'{qgraph.platform.name}'")
    target = str(qgraph.platform.cpu_target)
    if placement.target != target:
        raise ConfigError(f"placement file '{path}' was measured for CPU target '{placement.target}', this run's target "
                          f"is '{target}' (--target): int8 speed and weights differ between targets; give --target "
                          f"{placement.target} or measure again (drop --placement-from)")
    regions = {r.anchor: r for r in find_regions(qgraph)}
    missing = [a for a in placement.float_anchors() + placement.wider_anchors() + placement.dynamic_anchors()
               + placement.weight_only_anchors() if a not in regions]
    if missing:
        raise ConfigError(f"placement file '{path}' keeps region(s) {', '.join(missing[:5])} in float, weight-only, "
                          "dynamic or the wider format, but this quantized graph has no such region (other quantization settings?); measure "
                          "again")
    if placement.wider_anchors():
        twin = wide_graph(qgraph, wide, f"placement file '{path}'")
        widen(qgraph, twin, [regions[a] for a in placement.wider_anchors()])
    reapply_clipped_ranges(qgraph, placement.measured)
    keep_float(qgraph, [regions[a] for a in placement.weight_only_anchors()], weights=False)
    keep_float(qgraph, [regions[a] for a in placement.float_anchors()])
    qgraph.dynamic_ops = set(placement.dynamic_anchors())
    qgraph.attention_rewrite = rewrite_from_dict(placement.measured.get("attention"), f"placement file '{path}'")
    placement.note = (placement.note + " " if placement.note else "") + f"re-applied from {Path(path).name}"
    return placement

