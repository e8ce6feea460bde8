"""The decode layout: a weight's bytes in the order the decode GEMM loads them.

[Note: decode layout]
A 2-D weight W [N, K] with its blocks along K (the right operand of x @ W^T) is stored in the
canonical layout of its format (docs/formats.md): codes [N, K/2] (NVFP4, MXFP4: element 2j in
the low nibble) or [N, K] (MXFP8), block scales [N, K/16] or [N, K/32]. The decode layout holds
the same bits, permuted, and zero-padded to N a multiple of 64 and K a multiple of 64:
- the weight is cut into super-tiles of 16 rows x 64 K, stored [N/16, K/64] row-major;
- in a super-tile, lane l = 4g + t of a warp owns rows g and g + 8 at K offsets [16t, 16t + 16):
  its 32 values are 16 bytes (32 for MXFP8, as two 16-byte vectors stored one warp-width
  apart), ordered as the A fragments of four m16n8k16 MMAs want them;
- its two scales, of row g and row g + 8 for that K range, are one uint16 (row g in the low
  byte), so the scales are [N/16, K/64, 32] uint16. An MXFP4 or MXFP8 block covers two lanes'
  ranges; each keeps a copy.
Within a lane's codes, word s of the 16 bytes (one per MMA, K slots 16t + 4s + 0..3) holds the
8 codes of A fragment registers o = 2p + r (row g + 8r, elements 16t + 4s + 2p + h, h the
register half); an MXFP8 lane's word 2s + p holds the 4 codes of registers 2p + r. A register
is formed from its word by the pieces of WORD_PIECES: `rotr(word, n) & mask`, or-ed. The masks
select the bits of a bf16 pair holding each value times 2**-126 (E2M1: sign at bit 15 of the
half, exponent and mantissa at bits 8-6) or 2**-120 (E4M3: sign 15, the rest at bits 10-4), so
the rotations decide where each code bit is stored. Four rotated copies of one mask cannot tile
a 32-bit word, so the last E2M1 register (the second E4M3 one) takes two pieces: 9
instructions per 8 E2M1 codes, 5 per 4 E4M3 codes. Among the placements with that count, these
make three E2M1 pieces (one E4M3 piece) take only bits a left shift keeps (rotations 26 and 30
are shifts left by 6 and 2, rotation 28 one by 4), and the kernel issues a left shift as an
integer multiply on the FMA pipe: of the 9 (5) instructions, 7 (4) run on the integer ALU pipe,
the decode's busiest. Left shifts alone cannot place every bit: the four registers need twelve
code bits at bits 6-8 and only the word's bits 0-8 lie at or below them, so at least one piece
is a right shift or a rotation.
csrc/decode_gemm_cuda.cu ([Note: decode GEMM]) applies the same pieces.

`pack` and `unpack` are exact inverses on every canonical tensor (tests/test_decode_gemm.py
checks it bit for bit). The layout cannot hold an E4M3 NaN, as an MXFP8 code or an NVFP4 block
scale, nor a negative NVFP4 block scale (quantization writes neither): the kernel's bit decode
would misread them, so `pack` refuses such a weight (it keeps its canonical layout).
"""

from __future__ import annotations

import torch

FORMATS = ("nvfp4", "mxfp4", "mxfp8")  # the kernel's fmt argument is the index
ROWS, SUPER_K = 64, 64  # padding of N (4 row tiles of 16, one CTA) and of K (one super-tile)

# The decode of one 32-bit word into MMA registers: per register, its (rotate-right, mask)
# pieces. E2M1 code bit b (mantissa, exponent low, exponent high, sign) lands at bit
# E2M1_DEST[b] + 16h of its register, E4M3 bit b at E4M3_DEST[b] + 16h.
WORD_PIECES = {
    4: (((0, 0x81C081C0),), ((4, 0x81C081C0),), ((26, 0x81C081C0),),
        ((6, 0x01000100), (30, 0x80C080C0))),
    8: (((0, 0x87F087F0),), ((8, 0x07700770), (28, 0x80808080))),
}
E2M1_DEST = (6, 7, 8, 15)
E4M3_DEST = (4, 5, 6, 7, 8, 9, 10, 15)


def _word_sources(bits: int) -> tuple[int, ...]:
    """Word bit of code bit b of value (o, h): entry (2o + h) * bits + b."""
    dest = E2M1_DEST if bits == 4 else E4M3_DEST
    src = []
    for pieces in WORD_PIECES[bits]:
        for h in range(2):
            for b in range(bits):
                d = dest[b] + 16 * h
                (rot,) = [r for r, mask in pieces if mask >> d & 1]
                src.append((d + rot) % 32)
    if sorted(src) != list(range(32)):
        raise AssertionError(f"WORD_PIECES[{bits}] does not place each of the 32 bits once")
    return tuple(src)


_SOURCES = {bits: _word_sources(bits) for bits in WORD_PIECES}  # checked once, at import


def _to_words(values: torch.Tensor, bits: int) -> torch.Tensor:
    """values [..., 32 // bits] (codes in register order 2o + h) -> the words' bytes [..., 4]."""
    out = [torch.zeros_like(values[..., 0]) for _ in range(4)]
    for i, pos in enumerate(_SOURCES[bits]):
        bit = (values[..., i // bits] >> (i % bits)) & 1
        out[pos // 8] |= bit << (pos % 8)
    return torch.stack(out, dim=-1)


def _from_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of _to_words: bytes [..., 4] -> codes [..., 32 // bits]."""
    out = [torch.zeros_like(words[..., 0]) for _ in range(32 // bits)]
    for i, pos in enumerate(_SOURCES[bits]):
        out[i // bits] |= ((words[..., pos // 8] >> (pos % 8)) & 1) << (i % bits)
    return torch.stack(out, dim=-1)


def _block(fmt: str) -> int:
    return 16 if fmt == "nvfp4" else 32


def padded(n: int, k: int) -> tuple[int, int]:
    return -(-n // ROWS) * ROWS, -(-k // SUPER_K) * SUPER_K


def check(fmt: str, n: int, k: int) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"the decode layout holds {', '.join(FORMATS)} weights; got {fmt!r}.")
    if n <= 0 or k <= 0 or k % _block(fmt):
        raise ValueError(f"a {fmt} weight in the decode layout needs N > 0 and K > 0 divisible "
                         f"by {_block(fmt)}; got N = {n}, K = {k}.")


def packed_sizes(fmt: str, n: int, k: int) -> tuple[int, int]:
    """Bytes of the packed codes and of the packed scales."""
    np_, kp = padded(n, k)
    tiles = (np_ // 16) * (kp // SUPER_K)
    return tiles * 512 * (2 if fmt == "mxfp8" else 1), tiles * 64


def canonical_shapes(fmt: str, n: int, k: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shapes of the canonical (data, scale) uint8 tensors of a [N, K] weight."""
    return (n, k if fmt == "mxfp8" else k // 2), (n, k // _block(fmt))


def _pad(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    if tuple(t.shape) == (rows, cols):
        return t
    out = t.new_zeros(rows, cols)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def pack(fmt: str, data: torch.Tensor, scale: torch.Tensor, n: int, k: int):
    """(codes, scales) of the decode layout, flat uint8, from canonical bytes (any uint8 view:
    data [N, K/2] or [N, K], scale [N, K/16] or [N, K/32])."""
    check(fmt, n, k)
    data, scale = data.view(torch.uint8), scale.view(torch.uint8)
    width = k if fmt == "mxfp8" else k // 2
    if tuple(data.shape) != (n, width) or tuple(scale.shape) != (n, k // _block(fmt)):
        raise ValueError(f"canonical {fmt} bytes of a [{n}, {k}] weight are codes [{n}, {width}] "
                         f"and scales [{n}, {k // _block(fmt)}]; got {tuple(data.shape)} and "
                         f"{tuple(scale.shape)}.")
    if fmt == "mxfp8" and bool(((data & 0x7F) == 0x7F).any()):
        raise ValueError("the decode layout cannot carry MXFP8 NaN codes (0x7F / 0xFF); this "
                         "weight keeps its canonical layout.")
    if fmt == "nvfp4" and bool((((scale & 0x7F) == 0x7F) | (scale >= 0x80)).any()):
        raise ValueError("the decode layout carries NVFP4 block scales that are non-negative "
                         "numbers (E4M3 0x00-0x7E), as quantization writes them; this weight "
                         "has a NaN or negative scale byte and keeps its canonical layout.")
    np_, kp = padded(n, k)
    nt, kt = np_ // 16, kp // SUPER_K
    if fmt == "mxfp8":
        b = _pad(data, np_, kp).view(nt, 2, 8, kt, 4, 2, 2, 2, 2)  # r g | t jH jl p h
        b = b.permute(0, 3, 5, 2, 4, 6, 7, 1, 8)  # nt kt jH g t jl p r h
        codes = _to_words(b.reshape(-1, 4), 8).reshape(-1)
    else:
        nib = torch.stack((data & 15, data >> 4), dim=-1).reshape(n, k)
        b = _pad(nib, np_, kp).view(nt, 2, 8, kt, 4, 4, 2, 2)  # r g | t s p h
        b = b.permute(0, 3, 2, 4, 5, 6, 1, 7)  # nt kt g t s p r h
        codes = _to_words(b.reshape(-1, 8), 4).reshape(-1)
    sc = _pad(scale, np_, kp // _block(fmt))
    if fmt == "nvfp4":
        sc = sc.view(nt, 2, 8, kt, 4)
    else:  # one block per two lanes: each lane keeps a copy
        sc = sc.view(nt, 2, 8, kt, 2, 1).expand(nt, 2, 8, kt, 2, 2).reshape(nt, 2, 8, kt, 4)
    scales = sc.permute(0, 3, 2, 4, 1).reshape(-1)  # nt kt g t r
    return codes.contiguous(), scales.contiguous()


def unpack(fmt: str, codes: torch.Tensor, scales: torch.Tensor, n: int, k: int):
    """The canonical (data, scale) uint8 tensors that `pack` made these bytes from."""
    check(fmt, n, k)
    sizes = packed_sizes(fmt, n, k)
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8 or \
            (codes.numel(), scales.numel()) != sizes:
        raise ValueError(f"a {fmt} [{n}, {k}] weight in the decode layout is {sizes[0]} code "
                         f"bytes and {sizes[1]} scale bytes (uint8); got {codes.dtype} "
                         f"{codes.numel()} and {scales.dtype} {scales.numel()}.")
    np_, kp = padded(n, k)
    nt, kt = np_ // 16, kp // SUPER_K
    if fmt == "mxfp8":
        b = _from_words(codes.view(-1, 4), 8).view(nt, kt, 2, 8, 4, 2, 2, 2, 2)  # .. jl p r h
        data = b.permute(0, 7, 3, 1, 4, 2, 5, 6, 8).reshape(np_, kp)[:n, :k]
    else:
        nib = _from_words(codes.view(-1, 4), 4).view(nt, kt, 8, 4, 4, 2, 2, 2)  # .. s p r h
        nib = nib.permute(0, 6, 2, 1, 3, 4, 5, 7).reshape(np_, kp)[:n, :k]  # nt r g kt t s p h
        pairs = nib.reshape(n, k // 2, 2)
        data = pairs[..., 0] | (pairs[..., 1] << 4)
    sc = scales.view(nt, kt, 8, 4, 2).permute(0, 4, 2, 1, 3)  # nt r g kt t
    if fmt != "nvfp4":
        sc = sc[..., ::2]
    scale = sc.reshape(np_, -1)[:n, : k // _block(fmt)]
    return data.contiguous(), scale.contiguous()
