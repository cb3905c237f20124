"""Automatic placement lives in netquant.analysis.placement (an algorithm, not an entry point); this module re-exports
its public names for code that imported them from here."""

from netquant.analysis.placement import (
    DECISIONS,
    DEFAULT_MAX_LOSS,
    DYNAMIC,
    FLOAT,
    INT8,
    MIN_WEIGHTS,
    WEIGHT_ONLY,
    WIDER,
    WIDER_SHARE,
    Placement,
    Reason,
    RegionDecision,
    applies,
    apply_placement_file,
    batch_axis,
    model_hash,
    place,
    search_placement,
    timed,
)

__all__ = ["DECISIONS", "DEFAULT_MAX_LOSS", "DYNAMIC", "FLOAT", "INT8", "MIN_WEIGHTS", "WEIGHT_ONLY", "WIDER", "WIDER_SHARE", "Placement",
           "Reason", "RegionDecision", "applies", "apply_placement_file", "batch_axis", "model_hash", "place",
           "search_placement", "timed"]
