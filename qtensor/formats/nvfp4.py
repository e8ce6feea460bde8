"""NVFP4: E2M1 codes, E4M3 scale per 16 elements (or 16x16 tile), fp32 global or per-row amax.

The pure-torch reference; the single source of truth for NVFP4 bytes (docs/formats.md gives the
math and why each rounding sits where it does). Kernels in csrc/ are tested bit for bit against
`quantize`.

Layout of the result: quantization runs along the last dim of a 2-D matrix X. Rowwise, X is the
input flattened to [M, K]; columnwise, X is its transpose [K, M] ("rows of the result are columns
of the input"). `qdata` is uint8 [R, C/2], `scale` float8_e4m3fn [R, C/16] (2-D tiles repeated on
their 16 rows), `amax` an fp32 scalar or, row-scaled, one value per result row [R].
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, NamedTuple

import torch

from qtensor.formats.elements import (
    E4M3_MAX,
    FLT_MAX,
    RECIP_6,
    e2m1_decode,
    e2m1_encode,
    e4m3,
    fdiv,
    pack_fp4,
    unpack_fp4,
)
from qtensor.formats.fields import check_field_types, either
from qtensor.formats.rht import apply_rht

BLOCK = 16
FourOverSix = Literal["mae", "mse"]
# The values each NVFP4Spec field may take (checkpoints and the tensors check against these).
E4M3_BOUNDS = (448, 256)
FOUROVERSIX_MODES = (None, "mae", "mse")


@dataclasses.dataclass(frozen=True)
class NVFP4Spec:
    """How to quantize one NVFP4 operand. Validated at construction."""

    # 16x16 tiles share one scale (weights); rowwise and columnwise bytes are then transposes.
    block_2d: bool = False
    # One amax per row (token) instead of one per tensor; excludes 2D, RHT and stochastic rounding.
    row_scaled: bool = False
    # Per-block choice between map-to-6 and map-to-4 by the given error (arXiv 2512.02010).
    fourover6: FourOverSix | None = None
    # E4M3 bound B of the two-level scale: 448, or 256 so a map-to-4 block can reach 384.
    e4m3_bound: int = 448
    # Random Hadamard transform on 16-runs; columnwise (wgrad) operands only.
    rht: bool = False
    # Stochastic rounding of the codes (gradients); bits come from a torch.Generator.
    stochastic_rounding: bool = False
    # Blocks along dim 0 of the (2-D) input instead of its last dim.
    columnwise: bool = False

    def __post_init__(self):
        check_field_types(self)
        if self.e4m3_bound not in E4M3_BOUNDS:
            raise ValueError(f"e4m3_bound must be {either(E4M3_BOUNDS)}; got {self.e4m3_bound!r}.")
        if self.fourover6 not in FOUROVERSIX_MODES:
            raise ValueError(
                f"fourover6 must be {either(FOUROVERSIX_MODES)}; got {self.fourover6!r}.")
        if self.fourover6 and (self.rht or self.stochastic_rounding):
            raise ValueError(
                "4over6 excludes RHT and stochastic rounding (its error is measured on the "
                "deterministic codes of the untransformed block); turn one of them off."
            )
        if self.row_scaled and (self.block_2d or self.rht or self.stochastic_rounding):
            raise ValueError(
                "row_scaled excludes block_2d, rht and stochastic_rounding (the per-row amax "
                "is defined for 1x16 blocks of untransformed, deterministically rounded rows)."
            )
        if self.rht and not self.columnwise:
            raise ValueError(
                "RHT applies only to columnwise (wgrad) operands, where both GEMM operands get "
                "the same transform; set columnwise=True or rht=False."
            )


class NVFP4Data(NamedTuple):
    qdata: torch.Tensor  # uint8 [R, C/2]
    scale: torch.Tensor  # float8_e4m3fn [R, C/16]
    amax: torch.Tensor  # fp32 [] or [R]


def check_shape(shape: torch.Size, spec: NVFP4Spec) -> None:
    """Raise if `shape` cannot be quantized with `spec`, naming the rule."""
    if len(shape) < 1 or any(s == 0 for s in shape):
        raise ValueError(f"NVFP4 needs a non-empty tensor; got shape {tuple(shape)}.")
    if shape[-1] % BLOCK:
        raise ValueError(
            f"NVFP4 needs the last dim divisible by {BLOCK}; got shape {tuple(shape)}. "
            "Pad the features or exclude this tensor."
        )
    rows = math.prod(shape[:-1])  # not Size.numel(): it specializes torch.compile's dynamic dims
    if (spec.columnwise or spec.block_2d) and rows % BLOCK:
        why = "columnwise blocks run along dim 0" if spec.columnwise else "2D tiles are 16x16"
        raise ValueError(
            f"NVFP4 {why}, so the flattened leading dims must be divisible by {BLOCK}; "
            f"got shape {tuple(shape)}."
        )


def as_matrix(x: torch.Tensor, columnwise: bool) -> torch.Tensor:
    """The 2-D matrix whose rows are quantized: [M, K], or its transpose columnwise."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2.t() if columnwise else x2


def encode_scale(amax: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(S_enc, S_dec) from the global or per-row amax: S_enc = min(r(6B/A), FLT_MAX), 1 if 0."""
    s_enc = fdiv(6.0 * bound, amax).clamp(max=FLT_MAX)
    s_enc = torch.where((amax == 0) | (s_enc == 0), torch.ones_like(s_enc), s_enc)
    return s_enc, fdiv(1.0, s_enc)


def block_amax(xf: torch.Tensor, block_2d: bool) -> torch.Tensor:
    """Max |x| per 1x16 block [R, C/16], or per 16x16 tile repeated on its 16 rows."""
    rows, cols = xf.shape
    if not block_2d:
        return xf.abs().reshape(rows, cols // BLOCK, BLOCK).amax(-1)
    tiles = xf.abs().reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK).amax((1, 3))
    return tiles.repeat_interleave(BLOCK, dim=0)


def block_encode_scale(s_b: torch.Tensor, s_dec: torch.Tensor) -> torch.Tensor:
    """enc_b = min(r(1 / r(s_b * S_dec)), FLT_MAX) per block."""
    return fdiv(1.0, s_b.float() * s_dec).clamp(max=FLT_MAX)


def _blocks(xf: torch.Tensor) -> torch.Tensor:
    return xf.reshape(xf.shape[0], -1, BLOCK)


class SRSeed(NamedTuple):
    """Counter-based stochastic rounding: the 8 bits of element i come from (seed, offset + i).

    i is the element's row-major index in the result [R, C]; the kernels in csrc/ draw the same
    bits (quant_math.h sr_bits), so a given (seed, offset) gives the same bytes on every backend.
    The same pair may come as an int64 tensor [2] (`sr_state`): a training module's buffer that a
    compiled graph reads and advances on the device, with no Python int in between.
    """

    seed: int
    offset: int = 0


_U32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # A 32-bit xorshift-multiply hash on int64 holding uint32; multipliers < 2**31 keep products exact.
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _U32
    x = x ^ (x >> 15)
    x = (x * 0x1B873593) & _U32
    return x ^ (x >> 16)


def sr_state_tensor(sr: SRSeed, device=None) -> torch.Tensor:
    """The int64 tensor [2] (seed, offset) that the ops take for an SRSeed."""
    return torch.tensor([sr.seed, sr.offset], dtype=torch.int64, device=device)


def check_sr_state(state: torch.Tensor, device) -> None:
    """A state tensor must be int64 (seed, offset) on the data's device (kernels read it there)."""
    if state.dtype != torch.int64 or state.numel() != 2 or state.device != torch.device(device):
        raise ValueError(
            f"A stochastic-rounding state is an int64 tensor of 2 elements (seed, offset) on the "
            f"data's device {torch.device(device)}; got {state.dtype} {tuple(state.shape)} on "
            f"{state.device}. Build one with sr_state_tensor(SRSeed(seed, offset), device)."
        )


def sr_bits(shape: torch.Size, sr: SRSeed | torch.Tensor, device) -> torch.Tensor:
    """int32 bits in [0, 256) of each element i: with c = (offset + i) mod 2**32, byte c & 3 of
    the hash mix32((c >> 2) ^ mix32(seed mod 2**32)), one hash for four consecutive counters.

    `sr` is an SRSeed or its int64 state tensor (seed, offset), read without a host sync.
    """
    state = sr if isinstance(sr, torch.Tensor) else sr_state_tensor(sr, device)
    check_sr_state(state, device)
    state = state.reshape(2) & _U32
    key = _mix32(state[0])
    n = torch.Size(shape).numel()
    counter = (torch.arange(n, dtype=torch.int64, device=device) + state[1]) & _U32
    h = _mix32((counter >> 2) ^ key)
    return ((h >> ((counter & 3) * 8)) & 0xFF).to(torch.int32).reshape(shape)


def round_codes(
    v: torch.Tensor, generator: torch.Generator | SRSeed | torch.Tensor | None, stochastic: bool
) -> torch.Tensor:
    """E2M1 codes of scaled values: nearest-even, or stochastic with 8 random bits each (from
    the counter hash for an SRSeed or state tensor, else drawn from the generator)."""
    if not stochastic:
        return e2m1_encode(v)
    if isinstance(generator, (SRSeed, torch.Tensor)):
        r8 = sr_bits(v.shape, generator, v.device)
    else:
        r8 = torch.randint(0, 256, v.shape, generator=generator, device=v.device, dtype=torch.int32)
    # q is the grid point g at or below |v|, or the next one up when |v| - g >= (1 - u) step:
    # the floor onto the grid of |v| + u * step taken exactly, never rounded. Every operation
    # here is exact in fp32: a division by a power of two, its floor, the difference of two
    # values less than one step apart (Sterbenz once g > 0), and (256 - r8) / 256 * step.
    a = v.abs()
    step = _sr_step(a)
    g = torch.floor(a / step) * step
    up = (a - g) >= (256 - r8).to(torch.float32) * (1.0 / 256.0) * step
    q = torch.clamp(torch.where(up, g + step, g), max=6.0)  # inf: NaN difference, no step, cap
    return e2m1_encode(torch.where(torch.signbit(v), -q, q).where(~torch.isnan(v), v))


def _sr_step(a: torch.Tensor) -> torch.Tensor:
    # Grid spacing of E2M1 at |v|: 0.5 below 2, 1 in [2, 4), 2 from 4.
    return torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0)).to(a.dtype)


def _fourover6_scales(xf, b_amax, amax_b, s_enc, spec: NVFP4Spec) -> torch.Tensor:
    """Per-block E4M3 scale choosing map-to-4 where its error is strictly lower."""
    s6, s4, map4 = _fourover6_choice(xf, b_amax, amax_b, s_enc, spec)
    return torch.where(map4, s4, s6)


def _fourover6_choice(xf, b_amax, amax_b, s_enc, spec: NVFP4Spec):
    """(s6, s4, map4): both candidate scales and where map-to-4 wins (err4 < err6, ties to 6)."""
    base = fdiv(b_amax, 6.0) * s_enc
    s6 = e4m3(base.clamp(max=E4M3_MAX))
    s4 = e4m3((1.5 * base).clamp(max=E4M3_MAX))
    s_dec = fdiv(1.0, s_enc)
    err6 = _candidate_error(xf, s6, s_dec, amax_b, spec)
    err4 = _candidate_error(xf, s4, s_dec, amax_b, spec)
    return s6, s4, err4 < err6


def fourover6_map4(x: torch.Tensor, spec: NVFP4Spec) -> torch.Tensor:
    """Where `quantize(x, spec)` picks map-to-4: bool [R, C/16] in the result's layout.

    The stored scale already encodes the choice, so decoding never needs this; reports
    (`qtensor analyze`) use it to show how often 4over6 leaves the default map-to-6.
    """
    if not spec.fourover6:
        raise ValueError("fourover6_map4 needs a spec with fourover6 set; got fourover6=None.")
    check_shape(x.shape, spec)
    xf = as_matrix(x, spec.columnwise).to(torch.float32)
    _, amax_b = _global_amax(xf, spec)
    s_enc, _ = encode_scale(amax_b, spec.e4m3_bound)
    return _fourover6_choice(xf, block_amax(xf, spec.block_2d), amax_b, s_enc, spec)[2]


def row_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| of each row of a 2-D x, in fp32: a row-scaled tensor's amax (step 1)."""
    return x.float().abs().amax(dim=1)


def _global_amax(xf: torch.Tensor, spec: NVFP4Spec) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax, amax broadcast over [R, C/16]): one per tensor, or one per row when row-scaled."""
    amax = row_amax(xf) if spec.row_scaled else xf.abs().amax()
    return amax, (amax[:, None] if spec.row_scaled else amax)


def _candidate_error(xf, s_b, s_dec, amax_b, spec: NVFP4Spec) -> torch.Tensor:
    """Input-domain error of one candidate scale, summed in the order docs/formats.md fixes
    ("Variants", 4over6)."""
    xb = _blocks(xf)
    q = e2m1_encode(xb * block_encode_scale(s_b, s_dec)[..., None])
    sf = s_b.float()[..., None]
    val = fdiv((e2m1_decode(q) * sf) * amax_b[..., None], 6.0 * spec.e4m3_bound)
    d = val - xb
    terms = d.abs() if spec.fourover6 == "mae" else d * d
    err = terms[..., 0]
    for i in range(1, BLOCK):  # sequential fp32 sum, element 0..15
        err = err + terms[..., i]
    if spec.block_2d:  # 16 row errors of a tile summed as a tree: +8, +4, +2, +1
        rows, nblk = err.shape
        e = err.reshape(rows // BLOCK, BLOCK, nblk)
        while e.shape[1] > 1:
            half = e.shape[1] // 2
            e = e[:, :half] + e[:, half:]
        err = e.repeat_interleave(BLOCK, dim=1).reshape(rows, nblk)
    return err


def _check_block_amax(x: torch.Tensor, spec: NVFP4Spec, amax: torch.Tensor) -> None:
    if not spec.columnwise or spec.block_2d or spec.rht or spec.stochastic_rounding or \
            spec.fourover6:
        raise ValueError(
            "a per-block amax [R, C/16] is taken by a plain columnwise cast (no block_2d, RHT, "
            f"stochastic rounding or 4over6); got {spec}.")
    rows, cols = as_matrix(x, True).shape
    if tuple(amax.shape) != (rows, cols // BLOCK):
        raise ValueError(f"a per-block amax must be [R, C/16] = {(rows, cols // BLOCK)} for x "
                         f"{tuple(x.shape)}; got {tuple(amax.shape)}.")


def quantize(
    x: torch.Tensor, spec: NVFP4Spec,
    generator: torch.Generator | SRSeed | torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
) -> NVFP4Data:
    """Quantize x (any float dtype, [..., K]) to NVFP4 bytes per docs/formats.md.

    `amax` replaces x's own global amax (step 1), e.g. the whole weight's amax when x is one
    FSDP shard of it: the shard's bytes are then the whole tensor's bytes for those rows. For a
    plain columnwise spec it may also hold one amax per block, [R, C/16] in the result's layout:
    each block is quantized as its own tensor's block would be, so the experts' parts of one
    gradient, side by side, come out in one pass as their own casts' bytes.
    """
    check_shape(x.shape, spec)
    if amax is not None and amax.dim() == 2:
        _check_block_amax(x, spec, amax)
    xm = as_matrix(x, spec.columnwise)
    if spec.rht:
        xm = apply_rht(xm)
    xf = xm.to(torch.float32)
    if amax is None:
        amax, amax_b = _global_amax(xf, spec)
    else:
        amax_b = amax if amax.dim() == 2 else amax[:, None] if spec.row_scaled else amax
    s_enc, s_dec = encode_scale(amax_b, spec.e4m3_bound)
    b_amax = block_amax(xf, spec.block_2d)
    if spec.fourover6:
        s_b = _fourover6_scales(xf, b_amax, amax_b, s_enc, spec)
    else:
        s_b = e4m3(b_amax * (s_enc * RECIP_6))
    v = _blocks(xf) * block_encode_scale(s_b, s_dec)[..., None]
    codes = round_codes(v, generator, spec.stochastic_rounding)
    qdata = pack_fp4(codes.reshape(xf.shape))
    return NVFP4Data(qdata, s_b, amax)


def decode_factor(scale: torch.Tensor, amax: torch.Tensor, bound: int) -> torch.Tensor:
    """Per-block fp32 multiplier r(r(s_b * A) * r(1 / (6B))) [R, C/16]."""
    a = amax[:, None] if amax.dim() == 1 else amax
    return (scale.float() * a) * fdiv(1.0, torch.tensor(6.0 * bound, device=a.device))


def dequantize(
    qdata: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor,
    e4m3_bound: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode to [R, C] in the result's layout (rows are blocks' rows): value(q) * factor."""
    values = e2m1_decode(unpack_fp4(qdata))
    rows, cols = values.shape[0], values.shape[-1]
    factor = decode_factor(scale, amax, e4m3_bound)
    out = values.reshape(rows, cols // BLOCK, BLOCK) * factor[..., None]
    return out.reshape(rows, cols).to(dtype)


def unit_values(qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """value(q) * s_b as fp32 [..., R, C] from storage [..., R, C/2] and scales [..., R, C/16]:
    exact (at most 5 significant bits), what a GEMM multiplies."""
    values = e2m1_decode(unpack_fp4(qdata))
    lead, cols = values.shape[:-1], values.shape[-1]
    out = values.reshape(*lead, cols // BLOCK, BLOCK) * scale.float()[..., None]
    return out.reshape(*lead, cols)
