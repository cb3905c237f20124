"""Choosing scale and zero point from an observed range.

CONTRACT (stub to be implemented by the core work):

@dataclass(frozen=True)
class QParams:
    scale: torch.Tensor        # float32; shape () per-tensor, (C,) per-channel, per-group: x.shape with dim axis -> n_groups
    zero_point: torch.Tensor   # int32 tensor (integer value), same shape as scale; 0 for FP8 and symmetric-signed

def choose_qparams(min_val: Tensor | float, max_val: Tensor | float, spec: QuantSpec) -> QParams
    affine:    s = (max - min) / (qmax - qmin), z = clamp(round(qmin - min / s), qmin, qmax)
               (range first extended to include 0: min = min(min, 0), max = max(max, 0))
    symmetric: amax = max(|min|, |max|); signed: s = amax / ((qmax - qmin) / 2), z = 0
               unsigned symmetric: z = midpoint (qmin + qmax + 1) // 2  (torch.ao's quint8 symmetric convention)
    fp8:       s = amax / fp_max, z = 0
    power-of-two: s = 2^ceil(log2(s))
    zero range: s = eps (float32 eps, torch.ao convention), never 0 / NaN / Inf
    NaN or Inf in min/max: DataError naming the problem.
"""
