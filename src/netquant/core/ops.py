"""Quantize, dequantize and fake-quantize with gradients.

CONTRACT (stub to be implemented by the core work):

class GradMode(enum.Enum): STE_CLIP (default: grad 1 inside [qmin,qmax] else 0), STE (grad 1 everywhere),
                          LSQ (learned step size: grads for scale (and zero point) with 1/sqrt(numel*qmax) scaling)

def round_with_policy(x: Tensor, policy: RoundingPolicy) -> Tensor
def quantize(x, scale, zero_point, spec) -> Tensor               # q = clamp(round(x/s) + z, qmin, qmax), dtype spec.storage_dtype
def dequantize(q, scale, zero_point, spec) -> Tensor             # x' = (q - z) * s, float32
def fake_quantize(x, scale, zero_point, spec, grad_mode=GradMode.STE_CLIP) -> Tensor   # differentiable
    scale/zero_point broadcast per spec.granularity/axis/group_size (see qparams.QParams shapes).
    With grad_mode=LSQ, scale (and zero_point if it requires grad and spec is affine) receive gradients.
def tensor_quant(x, amax, num_bits=8, unsigned=False, narrow_range=True) -> (q, scale)   # NVIDIA-style
def fake_tensor_quant(x, amax, num_bits=8, unsigned=False, narrow_range=True) -> Tensor
"""
