"""Target platforms: quantization schemes of real engines as data plus rules.

    from netquant.platforms import Platform, register_platform, get_platform
    my_npu = register_platform(Platform.create(
        "my_npu", quantizable=["Conv", "Gemm", "Add"], rounding=RoundingPolicy.ROUND_HALF_UP))
"""

from netquant.platforms.builtin import BUILTIN_PLATFORMS, register_builtin_platforms
from netquant.platforms.platform import (
    ExportFormat,
    OpRole,
    OpRule,
    OutputPolicy,
    Platform,
    Validation,
    WiderFormat,
    int32_bias_spec,
    known_op_types,
    standard_rule,
)
from netquant.platforms.registry import (
    ENTRY_POINT_GROUP,
    PlatformPluginWarning,
    get_platform,
    list_platforms,
    load_entry_point_platforms,
    register_platform,
    unregister_platform,
)

register_builtin_platforms()

__all__ = [
    "BUILTIN_PLATFORMS",
    "ENTRY_POINT_GROUP",
    "PlatformPluginWarning",
    "ExportFormat",
    "OpRole",
    "OpRule",
    "OutputPolicy",
    "Platform",
    "get_platform",
    "int32_bias_spec",
    "known_op_types",
    "list_platforms",
    "load_entry_point_platforms",
    "register_platform",
    "standard_rule",
    "unregister_platform",
    "Validation",
    "WiderFormat",
]
