"""The quantization spec: what a quantized tensor looks like, independent of its data.

Integer formats map a real x to q = clamp(round(x / s) + z, qmin, qmax) and back by
x' = (q - z) * s.  Float formats (FP8) map x to cast_fp8(clamp(x / s, -fmax, fmax)) * s.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

import torch

from netquant.errors import ConfigError


class RoundingPolicy(enum.Enum):
    """How a real value between two integers is rounded (PPQ's seven policies)."""

    ROUND_HALF_EVEN = "round_half_even"  # banker's rounding; torch.round, ONNX, TensorRT
    ROUND_HALF_UP = "round_half_up"  # ties toward +inf: floor(x + 0.5)
    ROUND_HALF_DOWN = "round_half_down"  # ties toward -inf: ceil(x - 0.5)
    ROUND_HALF_TOWARDS_ZERO = "round_half_towards_zero"  # ties toward 0
    ROUND_HALF_FAR_FROM_ZERO = "round_half_far_from_zero"  # ties away from 0 (C round, ncnn)
    ROUND_TO_NEAR_INT = "round_to_near_int"  # sign(x) * floor(|x| + 0.5) (PPQ's definition)
    ROUND_UP = "round_up"  # ceil(x)


class Granularity(enum.Enum):
    """Which elements share one scale / zero point."""

    PER_TENSOR = "per_tensor"
    PER_CHANNEL = "per_channel"  # one pair per index along `axis`
    PER_GROUP = "per_group"  # blocks of `group_size` consecutive elements along `axis`


class ScaleConstraint(enum.Enum):
    """Allowed scale values."""

    FLOAT = "float"
    POWER_OF_TWO = "power_of_two"  # s = 2^k, k integer


class QuantFormat(enum.Enum):
    """Storage format of the quantized values."""

    INT = "int"
    FP8_E4M3 = "fp8_e4m3"  # torch.float8_e4m3fn, max 448, saturating
    FP8_E5M2 = "fp8_e5m2"  # torch.float8_e5m2, max 57344, saturating


FP8_MAX = {QuantFormat.FP8_E4M3: 448.0, QuantFormat.FP8_E5M2: 57344.0}
FP8_DTYPE = {QuantFormat.FP8_E4M3: torch.float8_e4m3fn, QuantFormat.FP8_E5M2: torch.float8_e5m2}


@dataclass(frozen=True)
class QuantSpec:
    """Bits, range, symmetry, granularity, scale constraint, rounding and format.

    Integer range: signed -> [-2^(b-1), 2^(b-1)-1] (narrow: lower bound +1);
    unsigned -> [0, 2^b-1] (narrow: upper bound -1); or explicit quant_min/quant_max.
    For FP8 formats `bits` is 8, the range is +-FP8_MAX and symmetric is required.
    """

    bits: int = 8
    signed: bool = True
    symmetric: bool = True
    narrow_range: bool = False
    granularity: Granularity = Granularity.PER_TENSOR
    axis: int | None = None
    group_size: int | None = None
    scale_constraint: ScaleConstraint = ScaleConstraint.FLOAT
    rounding: RoundingPolicy = RoundingPolicy.ROUND_HALF_EVEN
    fmt: QuantFormat = QuantFormat.INT
    quant_min: int | None = None
    quant_max: int | None = None

    def __post_init__(self) -> None:
        def bad(msg: str) -> ConfigError:
            return ConfigError(f"invalid QuantSpec({self.describe()}): {msg}")

        if not isinstance(self.bits, int) or isinstance(self.bits, bool):
            raise bad("bits must be an int")
        if self.fmt is not QuantFormat.INT:
            if self.bits != 8:
                raise bad(f"{self.fmt.value} is an 8-bit format; set bits=8")
            if not self.symmetric or not self.signed:
                raise bad(f"{self.fmt.value} is a signed symmetric format; set symmetric=True, signed=True")
            if self.quant_min is not None or self.quant_max is not None:
                raise bad("quant_min/quant_max do not apply to FP8 formats")
            if self.rounding is not RoundingPolicy.ROUND_HALF_EVEN:
                raise bad("FP8 casts round half to even; set rounding=RoundingPolicy.ROUND_HALF_EVEN")
            if self.narrow_range:
                raise bad("narrow_range applies to integer formats only")
        elif not (2 <= self.bits <= 16 or self.bits == 32):
            raise bad("bits must be between 2 and 16 (or 32 for int32 bias)")
        if (self.quant_min is None) != (self.quant_max is None):
            raise bad("give both quant_min and quant_max, or neither")
        if self.quant_min is not None:
            lo, hi = self._default_range()
            if not (lo <= self.quant_min < self.quant_max <= hi):
                raise bad(f"need {lo} <= quant_min < quant_max <= {hi} for {self.bits}-bit "
                          f"{'signed' if self.signed else 'unsigned'} storage")
        if self.granularity is Granularity.PER_TENSOR:
            if self.axis is not None or self.group_size is not None:
                raise bad("per-tensor specs take no axis or group_size")
        else:
            if self.axis is None:
                raise bad(f"{self.granularity.value} needs an axis")
            if self.granularity is Granularity.PER_CHANNEL and self.group_size is not None:
                raise bad("per-channel specs take no group_size; use Granularity.PER_GROUP")
            if self.granularity is Granularity.PER_GROUP and (self.group_size is None or self.group_size < 1):
                raise bad("per-group specs need group_size >= 1")
        if self.qmax - self.qmin < 1:
            raise bad("the integer range must hold at least two values")

    # ---- derived properties -------------------------------------------------
    def _default_range(self) -> tuple[int, int]:
        if self.signed:
            return -(2 ** (self.bits - 1)), 2 ** (self.bits - 1) - 1
        return 0, 2**self.bits - 1

    @property
    def qmin(self) -> int:
        if self.quant_min is not None:
            return self.quant_min
        lo, _ = self._default_range()
        return lo + 1 if (self.narrow_range and self.signed) else lo

    @property
    def qmax(self) -> int:
        if self.quant_max is not None:
            return self.quant_max
        _, hi = self._default_range()
        return hi - 1 if (self.narrow_range and not self.signed) else hi

    @property
    def is_float(self) -> bool:
        return self.fmt is not QuantFormat.INT

    @property
    def fp_max(self) -> float:
        """Largest finite value of the FP8 format (only for float formats)."""
        return FP8_MAX[self.fmt]

    @property
    def storage_dtype(self) -> torch.dtype:
        """Smallest torch dtype that holds [qmin, qmax]: uint8 for non-negative ranges that fit, else
        int8/int16/int32 (or the FP8 dtype)."""
        if self.is_float:
            return FP8_DTYPE[self.fmt]
        lo, hi = self.qmin, self.qmax
        order = (torch.int8, torch.int16, torch.int32) if lo < 0 else (torch.uint8, torch.int16, torch.int32)
        for dtype in order:
            info = torch.iinfo(dtype)
            if info.min <= lo and hi <= info.max:
                return dtype
        return torch.int32  # unreachable for bits <= 16

    def describe(self) -> str:
        kind = self.fmt.value if self.fmt is not QuantFormat.INT else (
            f"{'int' if self.signed else 'uint'}{self.bits}")
        parts = [kind, "sym" if self.symmetric else "affine", self.granularity.value]
        if self.axis is not None:
            parts.append(f"axis={self.axis}")
        if self.group_size is not None:
            parts.append(f"group={self.group_size}")
        if self.scale_constraint is ScaleConstraint.POWER_OF_TWO:
            parts.append("pow2")
        if self.narrow_range:
            parts.append("narrow")
        parts.append(self.rounding.name)
        return ", ".join(parts)

    def with_(self, **changes: object) -> QuantSpec:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    # ---- common presets -----------------------------------------------------
    @classmethod
    def int8(cls, **kw: object) -> QuantSpec:
        """Signed 8-bit symmetric per-tensor."""
        return cls(**{"bits": 8, "signed": True, "symmetric": True, **kw})

    @classmethod
    def uint8_affine(cls, **kw: object) -> QuantSpec:
        """Unsigned 8-bit affine per-tensor (ONNX Runtime / QNN activations)."""
        return cls(**{"bits": 8, "signed": False, "symmetric": False, **kw})

    @classmethod
    def int8_per_channel(cls, axis: int = 0, **kw: object) -> QuantSpec:
        """Signed 8-bit symmetric per-channel weights."""
        return cls(**{"bits": 8, "signed": True, "symmetric": True, "granularity": Granularity.PER_CHANNEL,
                      "axis": axis, **kw})

    @classmethod
    def int4_per_group(cls, group_size: int = 128, axis: int = 1, **kw: object) -> QuantSpec:
        """Signed 4-bit symmetric per-group weights (weight-only LLM style)."""
        return cls(**{"bits": 4, "signed": True, "symmetric": True, "granularity": Granularity.PER_GROUP,
                      "axis": axis, "group_size": group_size, **kw})

    @classmethod
    def fp8_e4m3(cls, **kw: object) -> QuantSpec:
        """FP8 E4M3 scaled, saturating."""
        return cls(**{"bits": 8, "fmt": QuantFormat.FP8_E4M3, **kw})

    @classmethod
    def fp8_e5m2(cls, **kw: object) -> QuantSpec:
        """FP8 E5M2 scaled, saturating."""
        return cls(**{"bits": 8, "fmt": QuantFormat.FP8_E5M2, **kw})
