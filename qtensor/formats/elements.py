"""Element codecs shared by every format: E2M1 (FP4), E4M3, UE8M0, powers of two.

Every function here is exact and elementwise; the format modules compose them in the order
docs/formats.md fixes. Nothing here reads a block or a scale.
"""

from __future__ import annotations

import torch

FLT_MAX = torch.finfo(torch.float32).max
E4M3_MAX = 448.0

# Values of the 16 E2M1 codes; bit 3 is the sign, so code 8 is -0.
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_SIGNED = _E2M1_VALUES + tuple(-v for v in _E2M1_VALUES)

# Round-to-nearest-even decision points for |v|: '>' where the tie goes down to the even code,
# '>=' where it goes up (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4).
_E2M1_UP_STRICT = (0.25, 1.25, 2.5, 5.0)
_E2M1_UP_INCLUSIVE = (0.75, 1.75, 3.5)


def f32_from_bits(bits: int) -> torch.Tensor:
    """A 0-d fp32 tensor with the given IEEE bit pattern (avoids double rounding of constants)."""
    return torch.tensor(bits, dtype=torch.int32).view(torch.float32)


# r(1/6) in fp32, bits 0x3E2AAAAB (docs/formats.md, NVFP4 step 4). A Python float holding that
# exact fp32 value (a module-level tensor would be a real tensor inside torch.compile's
# fake-tensor tracing, which refuses it; `fp32 tensor * float` rounds the float to fp32 first,
# exactly).
RECIP_6 = f32_from_bits(0x3E2AAAAB).item()


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to E2M1 codes (uint8 in 0..15), nearest-even, saturating at +-6.

    The sign bit follows the input's sign bit, so -0.0 and negatives that round to zero give
    code 8, as the hardware cast does. NaN gives code 7 (+6), also as the hardware does.
    """
    a = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for t in _E2M1_UP_STRICT:
        code += (a > t).to(torch.uint8)
    for t in _E2M1_UP_INCLUSIVE:
        code += (a >= t).to(torch.uint8)
    nan = torch.isnan(v)
    sign = (torch.signbit(v) & ~nan).to(torch.uint8) << 3
    return torch.where(nan, torch.full_like(code, 7), code | sign)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of E2M1 codes (uint8 in 0..15)."""
    # Built per call (on codes' device) rather than kept as a module-level tensor: under
    # torch.compile such a tensor is a real one among fake ones; this one becomes a graph constant.
    table = torch.tensor(_E2M1_SIGNED, dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] bytes; element 2j in the low nibble."""
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] codes."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def e4m3(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 to float8_e4m3fn, nearest-even, saturating at +-448; NaN stays NaN."""
    return v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def pow2_f32(e: torch.Tensor) -> torch.Tensor:
    """Exact fp32 2**e for integer e in [-127, 127] (2**-127 is the subnormal 0x00400000)."""
    e = e.to(torch.int32)
    normal = ((e + 127).clamp(min=1) << 23).view(torch.float32)
    # 2**-127 as a fill value (exact in fp32): no host-to-device copy, so this runs inside a
    # CUDA graph capture.
    return torch.where(e >= -126, normal, torch.full_like(normal, 2.0**-127))


def f32_exponent_bits(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(biased exponent field, mantissa field) of fp32 values, as int32."""
    bits = v.to(torch.float32).contiguous().view(torch.int32)
    return (bits >> 23) & 0xFF, bits & 0x7FFFFF


def fdiv(num: torch.Tensor | float, den: torch.Tensor | float) -> torch.Tensor:
    """Correctly rounded fp32 division.

    `scalar / tensor` in torch is `reciprocal(tensor) * scalar`, and CUDA divides by a CPU
    scalar as a multiply by its reciprocal: both round twice and differ from r(a / b) in about
    one case in ten. Making both sides fp32 tensors on one device keeps a true division.
    """
    like = num if isinstance(num, torch.Tensor) else den
    if not isinstance(num, torch.Tensor):
        num = torch.tensor(num, dtype=torch.float32, device=like.device)
    if not isinstance(den, torch.Tensor):
        den = torch.tensor(den, dtype=torch.float32, device=like.device)
    return torch.div(num, den)
