"""The decode layout and the decode GEMM (qtensor::decode_mm, csrc/decode_gemm_cuda.cu).

CPU (CI): `pack` / `unpack` are exact inverses, bit for bit, on every byte value and ragged
shapes; the layout puts each value where the kernel's decode reads it (a bit-level emulation of
the kernel's word decode, its rotations and masks copied from csrc/decode_gemm_cuda.cu, gives
the reference's unit values, in bf16 and fp16 registers); the op's CPU kernel is the canonical
weight's (bit for bit); bad arguments fail clearly.

CUDA (marked): the kernel against the emulated reference, up to fp32 accumulation order
([Tolerance] of test_gemm_triton.py: relative Frobenius error under 1e-5 in fp32; bf16 results
equal but for rare one-ulp ties), on M = 1..64 (and the chunked M up to 128), N and K that are
not multiples of the tiles, per-tensor and row-scaled NVFP4, bounds 448 and 256, bias, fp16
and bf16 activations and outputs, zero weights, outliers, every split count.
"""

from __future__ import annotations

import pytest
import torch

from qtensor.backends import has_kernel
from qtensor.formats import decode_layout as dl
from qtensor.formats import mxfp4 as mxfp4_ref
from qtensor.formats import mxfp8 as mxfp8_ref
from qtensor.formats import nvfp4 as nvfp4_ref
from qtensor.ops import decode_mm as dmm
from qtensor.ops import gemm_ops
from qtensor.ops.gemm_operands import Side

FORMATS = ("nvfp4", "mxfp4", "mxfp8")
SHAPES = [(64, 64), (16, 32), (80, 96), (130, 320), (200, 2080)]
needs_kernel = pytest.mark.skipif(
    not (torch.cuda.is_available() and has_kernel("decode_gemm", "CUDA")),
    reason="needs a GPU and the CUDA decode kernel")


def random_bytes(fmt: str, n: int, k: int, g: torch.Generator, *, all_values=False):
    """Canonical (data, scale) uint8 of a random weight: every code pattern; scales over the
    range the kernel's fast and two-multiply paths cover (NVFP4: every finite E4M3 byte)."""
    width = k if fmt == "mxfp8" else k // 2
    data = torch.randint(0, 256, (n, width), dtype=torch.uint8, generator=g)
    if all_values:
        flat = data.view(-1)
        flat[: min(256, flat.numel())] = torch.arange(min(256, flat.numel()), dtype=torch.uint8)
    if fmt == "mxfp8":
        data[(data & 0x7F) == 0x7F] = 0x7E  # the layout refuses NaN codes (tested below)
    blocks = k // (16 if fmt == "nvfp4" else 32)
    if fmt == "nvfp4":
        scale = torch.randint(0, 0x7F, (n, blocks), dtype=torch.uint8, generator=g)
    else:
        scale = torch.randint(100, 150, (n, blocks), dtype=torch.uint8, generator=g)
    return data, scale


def canonical_units(fmt: str, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if fmt == "nvfp4":
        return nvfp4_ref.unit_values(data, scale.view(torch.float8_e4m3fn))
    if fmt == "mxfp4":
        return mxfp4_ref.dequantize(data, scale)
    return mxfp8_ref.dequantize(data.view(torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu),
                                columnwise=False)


# ---- the layout --------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_pack_unpack_is_bitwise_inverse(fmt, n, k):
    if k % (16 if fmt == "nvfp4" else 32):
        pytest.skip("K is not a whole number of blocks")
    g = torch.Generator().manual_seed(n * 1000 + k)
    data, scale = random_bytes(fmt, n, k, g, all_values=True)
    codes, scales = dl.pack(fmt, data, scale, n, k)
    assert (codes.numel(), scales.numel()) == dl.packed_sizes(fmt, n, k)
    d2, s2 = dl.unpack(fmt, codes, scales, n, k)
    assert torch.equal(d2, data) and torch.equal(s2, scale)
    assert (tuple(d2.shape), tuple(s2.shape)) == dl.canonical_shapes(fmt, n, k)
    fake = dmm._unpack_fake(codes, scales, dl.FORMATS.index(fmt), n, k)
    assert (tuple(fake[0].shape), tuple(fake[1].shape)) == dl.canonical_shapes(fmt, n, k)


def test_pack_unpack_all_65536_nibble_pairs_of_rows():
    """Every 16-bit pattern (two bytes, four E2M1 codes) placed at every K offset of a
    super-tile's rows survives the round trip."""
    n, k = 256, 1024  # 16 row tiles x 16 super-tiles: 65536 two-byte words
    words = torch.arange(65536, dtype=torch.int32)
    data = torch.stack(((words & 0xFF), (words >> 8)), dim=-1).to(torch.uint8).reshape(n, k // 2)
    scale = torch.arange(n * k // 16, dtype=torch.int32).remainder(0x7F).to(torch.uint8)
    scale = scale.reshape(n, k // 16)
    d2, s2 = dl.unpack("nvfp4", *dl.pack("nvfp4", data, scale, n, k), n, k)
    assert torch.equal(d2, data) and torch.equal(s2, scale)


def _rotr(q: torch.Tensor, n: int) -> torch.Tensor:
    return ((q >> n) | (q << (32 - n))) & 0xFFFFFFFF if n else q


# The kernel's word decode, as written in csrc/decode_gemm_cuda.cu: per MMA register, the
# (rotate-right, mask) pieces or-ed together, for bf16 and (E2M1 only) fp16 registers. A shift
# there, `q << s` or `q >> s`, is the rotation 32 - s or s here (the mask keeps only bits the
# shift keeps).
KERNEL_PIECES = {
    ("e2m1", False): (((0, 0x81C081C0),), ((4, 0x81C081C0),), ((26, 0x81C081C0),),
                      ((6, 0x01000100), (30, 0x80C080C0))),
    ("e2m1", True): (((0, 0x80008000), (29, 0x0E000E00)), ((4, 0x80008000), (1, 0x0E000E00)),
                     ((26, 0x80008000), (23, 0x0E000E00)),
                     ((30, 0x80008000), (3, 0x08000800), (27, 0x06000600))),
    ("e4m3", False): (((0, 0x87F087F0),), ((8, 0x07700770), (28, 0x80808080))),
}


def _register_half(bits: torch.Tensor, half: bool) -> torch.Tensor:
    """The value of 16 register bits: fp16 if `half`, else bf16."""
    if half:
        return bits.to(torch.int16).view(torch.float16).double()
    return (bits.to(torch.int32) << 16).view(torch.float32).double()


def emulate_kernel_units(fmt: str, codes, scales, n: int, k: int, half=False) -> torch.Tensor:
    """The weight values [N, K] the kernel forms from packed bytes: each lane's words, the
    bit-level register decode of [Note: decode GEMM], times the block's scale."""
    np_, kp = dl.padded(n, k)
    nt, kt = np_ // 16, kp // 64
    vec = 2 if fmt == "mxfp8" else 1
    words = codes.view(torch.int32).view(nt, kt, vec, 32, 4).long() & 0xFFFFFFFF
    sc = scales.view(nt, kt, 32, 2).long()
    pieces = KERNEL_PIECES[("e4m3" if fmt == "mxfp8" else "e2m1", half)]
    factor = 2.0 ** (120 if fmt == "mxfp8" else 14 if half else 126)
    out = torch.zeros(np_, kp, dtype=torch.float64)
    tiles_r = torch.arange(nt)[:, None] * 16
    tiles_k = torch.arange(kt)[None, :] * 64
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for s in range(4):
            regs = []  # the four A registers of MMA s: register o = 2p + r
            if fmt == "mxfp8":
                v = words[:, :, s // 2, lane]
                for w in (v[..., 2 * (s % 2)], v[..., 2 * (s % 2) + 1]):
                    regs += [sum(_rotr(w, n) & m for n, m in reg) for reg in pieces]
            else:
                q = words[:, :, 0, lane, s]
                regs = [sum(_rotr(q, n) & m for n, m in reg) for reg in pieces]
            for o, bits in enumerate(regs):
                r, p = o % 2, o // 2
                code = sc[:, :, lane, r]
                if fmt == "nvfp4":
                    scale = code.to(torch.uint8).view(torch.float8_e4m3fn).double()
                else:
                    scale = torch.pow(2.0, code.double() - 127)
                for h, value in ((0, bits & 0xFFFF), (1, bits >> 16)):
                    col = 16 * t + 4 * s + 2 * p + h
                    out[tiles_r + g + 8 * r, tiles_k + col] = \
                        _register_half(value, half) * factor * scale
    return out[:n, :k].float()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(64, 64), (80, 96), (130, 320)])
def test_layout_is_where_the_kernel_decodes(fmt, n, k):
    g = torch.Generator().manual_seed(7 * n + k)
    data, scale = random_bytes(fmt, n, k, g, all_values=True)
    codes, scales = dl.pack(fmt, data, scale, n, k)
    expect = canonical_units(fmt, data, scale)
    assert torch.equal(emulate_kernel_units(fmt, codes, scales, n, k), expect)
    if fmt == "nvfp4":  # float16 activations: the kernel decodes to float16 registers
        assert torch.equal(emulate_kernel_units(fmt, codes, scales, n, k, half=True), expect)


def test_pack_refuses_bad_input():
    data = torch.zeros(64, 64, dtype=torch.uint8)
    data[3, 5] = 0xFF
    with pytest.raises(ValueError, match="NaN codes"):
        dl.pack("mxfp8", data, torch.zeros(64, 2, dtype=torch.uint8), 64, 64)
    codes = torch.zeros(64, 32, dtype=torch.uint8)
    for bad in (0x7F, 0xFF, 0x80, 0xB8):  # NaN, -NaN, -0, -1
        scale = torch.full((64, 4), 0x38, dtype=torch.uint8)
        scale[7, 2] = bad
        with pytest.raises(ValueError, match="NaN or negative scale"):
            dl.pack("nvfp4", codes, scale, 64, 64)
    with pytest.raises(ValueError, match="divisible by 16"):
        dl.pack("nvfp4", data, data, 64, 40)
    with pytest.raises(ValueError, match=r"codes \[64, 32\]"):
        dl.pack("nvfp4", data, torch.zeros(64, 4, dtype=torch.uint8), 64, 64)
    with pytest.raises(ValueError, match="holds nvfp4, mxfp4, mxfp8"):
        dl.pack("int4", data, data, 64, 64)
    with pytest.raises(ValueError, match="code bytes"):
        dl.unpack("nvfp4", torch.zeros(10, dtype=torch.uint8), torch.zeros(10, dtype=torch.uint8),
                  64, 64)


# ---- the op ------------------------------------------------------------------------------------


def _problem(fmt, m, n, k, device, *, row_scaled=False, bound=448, bias=False, x_dtype=None,
             seed=0, weights="random"):
    g = torch.Generator().manual_seed(seed)
    data, scale = random_bytes(fmt, n, k, g)
    if weights == "zero":
        data.zero_()
    if weights == "outliers" and fmt != "nvfp4":
        scale[::7, ::3] = 200  # blocks past the one-multiply path (two multiplies)
    amax = None
    if fmt == "nvfp4":
        amax = (torch.rand(n, generator=g) * 10 + 0.1) if row_scaled else torch.tensor(3.5)
    x = torch.randn(m, k, generator=g)
    if weights == "outliers":
        x[:, ::97] *= 1000
    x = x.to(x_dtype or torch.bfloat16)
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    codes, scales = dl.pack(fmt, data, scale, n, k)
    move = (lambda t: None if t is None else t.to(device))
    return (move(x), move(codes), move(scales), move(amax), move(b), fmt, n, k, bound)


def _reference(args, out_dtype):
    x, w, s, amax, bias, fmt, n, k, bound = [a.cpu() if isinstance(a, torch.Tensor) else a
                                             for a in args]
    return dmm.reference(x, w, s, amax, bias, fmt, n, k, bound, out_dtype)


@pytest.mark.parametrize("fmt", FORMATS)
def test_cpu_op_is_the_canonical_product(fmt):
    """On the CPU a packed weight gives the canonical weight's bits (its op's CPU kernel), which
    are the reference's up to the order of the fp32 additions."""
    args = _problem(fmt, 5, 80, 96, "cpu", row_scaled=True, bias=True, seed=7)
    x, w, s, amax, bias, fmt, n, k, bound = args
    out = torch.ops.qtensor.decode_mm(*args, torch.float32)
    data, scale = dmm.canonical(fmt, w, s, n, k)
    a, b = Side(x), Side(data, scale, amax, bound)
    canonical = gemm_ops.op(f"{fmt}_mm")(*gemm_ops.dense_args(fmt, a, b, bias, torch.float32))
    assert torch.equal(out, canonical)
    ref = gemm_ops.reference_mm(fmt, a, b, bias, torch.float32)
    assert_close_to_reference(out, ref, args)


def test_cpu_op_gradient_matches_autograd_of_units():
    args = list(_problem("mxfp8", 3, 64, 64, "cpu", bias=True))
    x = args[0].float().requires_grad_()
    bias = args[4].float().requires_grad_()
    args[0], args[4] = x, bias
    out = torch.ops.qtensor.decode_mm(*args, torch.float32)
    out.square().sum().backward()
    w = dmm.weight_side("mxfp8", args[1], args[2], None, 64, 64, 448)
    u = canonical_units("mxfp8", w.data.view(torch.uint8), w.scale.view(torch.uint8)).double()
    # d(out^2)/dx = 2 out @ W's units, d/dbias = the column sums of 2 out, from the op's own
    # output; each an fp32 sum (of N = 64 and M = 3 terms) within that many 2**-23 of its
    # absolute terms' sum.
    d = 2 * out.detach().double()
    excess = (x.grad.double() - d @ u).abs() - 64 * 2.0**-23 * (d.abs() @ u.abs())
    assert excess.max() <= 0
    excess = (bias.grad.double() - d.sum(0)).abs() - 3 * 2.0**-23 * d.abs().sum(0)
    assert excess.max() <= 0


def test_op_errors_name_the_requirement():
    args = list(_problem("nvfp4", 2, 64, 64, "cpu"))
    with pytest.raises(ValueError, match=r"activation \[M, K = 64\]"):
        torch.ops.qtensor.decode_mm(args[0][:, :32], *args[1:], torch.float32)
    bad = list(args)
    bad[3] = None
    with pytest.raises(ValueError, match="amax goes with NVFP4"):
        torch.ops.qtensor.decode_mm(*bad, torch.float32)
    bad = list(args)
    bad[1] = args[1][:-16]
    with pytest.raises(ValueError, match="decode layout"):
        torch.ops.qtensor.decode_mm(*bad, torch.float32)


def test_kernel_path_crossover():
    """One launch up to DECODE_M rows; launches of DECODE_M rows up to the format's crossover;
    unpack + dense above it, except for MXFP4, which has no dense kernel."""
    for fmt in dl.FORMATS:
        assert dmm.kernel_path(fmt, 1) == dmm.kernel_path(fmt, dmm.DECODE_M) == "decode"
        assert dmm.kernel_path(fmt, dmm.DECODE_M + 1) == "chunked"
        limit = dmm.CHUNKED_M[fmt]
        if fmt in gemm_ops.NO_KERNEL:
            assert limit is None and dmm.kernel_path(fmt, 4096) == "chunked"
        else:
            assert dmm.kernel_path(fmt, limit) == "chunked"
            assert dmm.kernel_path(fmt, limit + 1) == "unpack"


def test_fake_gives_shape_and_dtype():
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = _problem("mxfp4", 7, 80, 96, "cpu")
    with FakeTensorMode() as mode:
        fargs = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        out = torch.ops.qtensor.decode_mm(*fargs, torch.float16)
    assert tuple(out.shape) == (7, 80) and out.dtype == torch.float16


# ---- the CUDA kernel ---------------------------------------------------------------------------


def _magnitude(args):
    """|x| @ |W|^T in fp32: the sum of the absolute products each output element adds up."""
    x, w, s, amax, bias, fmt, n, k, bound = [a.cpu() if isinstance(a, torch.Tensor) else a
                                             for a in args]
    data, scale = dmm.canonical(fmt, w, s, n, k)
    bits = data.view(torch.uint8) & (0x7F if fmt == "mxfp8" else 0x77)  # clear the sign bits
    data = bits.view(data.dtype)
    return gemm_ops.reference_mm(fmt, Side(x.abs()), Side(data, scale, amax, bound), None,
                                 torch.float32)


def assert_close_to_reference(out: torch.Tensor, ref: torch.Tensor, args) -> None:
    """Equal up to the order of the fp32 additions: each of the two sums of K exact products is
    within (K - 1) * 2**-24 * sum |products| of the exact one, so they differ by at most
    K * 2**-23 times it; an output in bf16 or fp16 may round either side of that interval, one
    unit in its last place."""
    out = out.cpu()
    assert out.shape == ref.shape and out.dtype == ref.dtype
    k = args[7]
    ref32 = _reference(args, torch.float32)
    tol = k * 2.0**-23 * _magnitude(args)
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(out), finite)
    o, r, tol = out[finite].float(), ref32[finite], tol[finite]
    if out.dtype != torch.float32:
        big = torch.maximum(o.abs(), r.abs())
        tol = tol + torch.finfo(out.dtype).eps * big.clamp(min=torch.finfo(out.dtype).tiny)
    excess = ((o - r).abs() - tol).max().item() if o.numel() else 0.0
    assert excess <= 0, f"{out.dtype} results differ from the reference beyond the fp32 " \
                        f"summation bound by {excess:.3e}"
    if out.dtype != torch.float32 and int(finite.sum()) >= 1000:
        # most elements round to the reference's own value
        assert (out[finite] != ref[finite]).float().mean() < 0.02


@pytest.mark.cuda
@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16, 17, 33, 64, 100, 128])
@pytest.mark.parametrize("n,k", [(80, 96), (200, 2080), (1200, 1024)])
def test_kernel_matches_reference(fmt, m, n, k):
    args = _problem(fmt, m, n, k, "cuda", seed=m + n)
    for out_dtype in (torch.float32, torch.bfloat16):
        assert_close_to_reference(dmm.cuda(*args, out_dtype), _reference(args, out_dtype), args)


@pytest.mark.cuda
@needs_kernel
@pytest.mark.parametrize("fmt,m", [("nvfp4", 16), ("mxfp4", 9), ("mxfp4", 40)])
def test_kernel_on_a_weight_of_two_row_tiles_per_warp(fmt, m):
    """A 4-bit weight of 2**27 elements or more runs the tile of two row tiles per warp from 9
    tokens on; N = 2112 leaves its last CTA half its row tiles. Up to 16 tokens a split of 1
    writes from the registers of both row tiles."""
    n, k = 2112, 65536
    args = _problem(fmt, m, n, k, "cuda", seed=m)
    ref = _reference(args, torch.float32)
    assert_close_to_reference(dmm.cuda(*args, torch.float32), ref, args)
    if m <= 16:
        out = dmm._launch(*args, torch.float32, splits=1)
        assert_close_to_reference(out, ref, args)
        assert torch.equal(out, dmm._launch(*args, torch.float32, splits=1))


@pytest.mark.cuda
@needs_kernel
@pytest.mark.parametrize("case", ["row_scaled", "bound256", "bias", "fp16", "zero", "outliers",
                                  "fp16_out"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_options(fmt, case):
    if case in ("row_scaled", "bound256", "fp16") and fmt != "nvfp4":
        pytest.skip("an NVFP4 option")
    kw = dict(row_scaled=case == "row_scaled", bound=256 if case == "bound256" else 448,
              bias=case in ("bias", "fp16_out"), x_dtype=torch.float16 if case == "fp16" else None,
              weights={"zero": "zero", "outliers": "outliers"}.get(case, "random"))
    args = _problem(fmt, 12, 272, 1088, "cuda", seed=5, **kw)
    out_dtype = torch.float16 if case == "fp16_out" else torch.float32
    out = dmm.cuda(*args, out_dtype)
    ref = _reference(args, out_dtype)
    if case == "zero":
        assert torch.equal(out.cpu(), ref)
    else:
        assert_close_to_reference(out, ref, args)


@pytest.mark.cuda
@needs_kernel
@pytest.mark.parametrize("tile", dmm.TILES.values(), ids=dmm.TILES)
@pytest.mark.parametrize("case", ["plain", "row_scaled", "fp16", "bias", "outliers"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,n,k", [(33, 200, 2080), (64, 1200, 1024), (47, 2112, 8192)])
def test_each_tile_of_33_to_64_rows(fmt, case, tile, m, n, k):
    """From 33 rows the kernel takes the warpgroup tile (64 or 128 weight rows a CTA) where it
    runs and the m16n8k16 tiles elsewhere: each against the reference, on ragged N and K, a last
    CTA of half its row tiles (N = 2112 with 128 rows), and each option."""
    if case in ("row_scaled", "fp16") and fmt != "nvfp4":
        pytest.skip("an NVFP4 option")
    if reason := dmm.tile_problem(tile, fmt):
        pytest.skip(reason)
    kw = dict(row_scaled=case == "row_scaled", bias=case == "bias",
              x_dtype=torch.float16 if case == "fp16" else None,
              weights="outliers" if case == "outliers" else "random")
    args = _problem(fmt, m, n, k, "cuda", seed=m + n, **kw)
    for out_dtype in (torch.float32, torch.bfloat16):
        out = dmm._launch(*args, out_dtype, tile=tile)
        assert_close_to_reference(out, _reference(args, out_dtype), args)


@pytest.mark.cuda
@needs_kernel
@pytest.mark.parametrize("tile", dmm.TILES.values(), ids=dmm.TILES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_tile_on_a_large_quantized_gaussian_weight(fmt, tile):
    """Many CTAs on every SM and long K ranges, three launches each: where a warpgroup tile
    whose A registers the compiler reused before its MMAs had completed gave wrong sums,
    differently from launch to launch (8192x28672 MXFP8 and MXFP4 at 40 and 64 rows), while
    the small shapes above passed."""
    if reason := dmm.tile_problem(tile, fmt):
        pytest.skip(reason)
    from qtensor import MXFP4Tensor, MXFP8Tensor, NVFP4Tensor

    n, k = 8192, 28672
    g = torch.Generator("cuda").manual_seed(7)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    cls = {"nvfp4": NVFP4Tensor, "mxfp4": MXFP4Tensor, "mxfp8": MXFP8Tensor}[fmt]
    q = cls.from_hp(w)
    codes, scales = dl.pack(fmt, q.qdata.view(torch.uint8), q.scale.view(torch.uint8), n, k)
    amax = q.amax if fmt == "nvfp4" else None
    for m in (40, 64):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        args = (x, codes, scales, amax, None, fmt, n, k, 448)
        ref = dmm.reference(*args, torch.float32)
        for _ in range(3):  # the failures seen were intermittent
            out = dmm._launch(*args, torch.float32, tile=tile)
            assert torch.isfinite(out).all()
            err = ((out - ref).norm() / ref.norm()).item()
            assert err < k * 2.0**-24, f"M={m}: relative error {err:.2e}"


@pytest.mark.cuda
@needs_kernel
def test_forced_tiles_refuse_what_they_cannot_run():
    args = _problem("nvfp4", 32, 200, 2080, "cuda", seed=1)
    for tile in dmm.TILES.values():
        with pytest.raises(RuntimeError, match="a tile is chosen for 33 to 64"):
            dmm._launch(*args, torch.float32, tile=tile)
    with pytest.raises(RuntimeError, match="tile is 0"):
        dmm._launch(*args, torch.float32, tile=5)
    mx = _problem("mxfp8", 40, 200, 2080, "cuda", seed=1)
    with pytest.raises(RuntimeError, match="128 rows a CTA takes 4-bit weights"):
        dmm._launch(*mx, torch.float32, tile=dmm.TILE_MMA_128)


@pytest.mark.cuda
@needs_kernel
@pytest.mark.parametrize("splits", range(1, 9))
def test_every_split_count_gives_the_same_result(splits):
    args = _problem("nvfp4", 4, 320, 4096, "cuda", seed=11)
    ref = _reference(args, torch.float32)
    out = dmm._launch(*args, torch.float32, splits=splits)
    assert_close_to_reference(out, ref, args)
    assert torch.equal(out, dmm._launch(*args, torch.float32, splits=splits))  # deterministic


@pytest.mark.cuda
@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [40, 64])
def test_from_33_rows_a_short_k_range_splits_in_two(fmt, m):
    """From 33 rows the kernel splits K in two where each CTA then keeps at most 64 stages
    (4096x4096: 16-32), rather than the finer split every cluster could take at once. The
    summation order is the split's, so the chosen launch is bitwise the forced split of 2 and
    not that of 4 (the devices this runs on hold clusters of 3 or more for these 64 or fewer
    row groups)."""
    if torch.cuda.get_device_properties(0).multi_processor_count < 100:
        pytest.skip("the split rule's premise: room for clusters of more than 2 CTAs")
    args = _problem(fmt, m, 4096, 4096, "cuda", seed=m)
    out = dmm._launch(*args, torch.float32)
    assert torch.equal(out, dmm._launch(*args, torch.float32, splits=2))
    assert not torch.equal(out, dmm._launch(*args, torch.float32, splits=4))
    assert_close_to_reference(out, _reference(args, torch.float32), args)


@pytest.mark.cuda
@needs_kernel
@pytest.mark.parametrize("case", ["plain", "row_scaled", "bias", "fp16", "fp16_out"])
@pytest.mark.parametrize("m", [1, 5, 9, 16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_one_k_range_writes_its_outputs_from_registers(fmt, m, case):
    """Up to 16 tokens a split of 1 writes each output from the CTA's registers, without the
    partial tile and the cluster barriers ([Note: decode GEMM]): every token and option of the
    epilogue, a last CTA with rows past N (N = 200) and K in a partial last stage."""
    if case in ("row_scaled", "fp16") and fmt != "nvfp4":
        pytest.skip("an NVFP4 option")
    kw = dict(row_scaled=case == "row_scaled", bias=case in ("bias", "fp16_out"),
              x_dtype=torch.float16 if case == "fp16" else None)
    args = _problem(fmt, m, 200, 1088, "cuda", seed=13, **kw)
    out_dtype = torch.float16 if case == "fp16_out" else torch.float32
    out = dmm._launch(*args, out_dtype, splits=1)
    assert_close_to_reference(out, _reference(args, out_dtype), args)
    assert torch.equal(out, dmm._launch(*args, out_dtype, splits=1))  # deterministic


@pytest.mark.cuda
@needs_kernel
@pytest.mark.parametrize("m", [1, 16, 32])
@pytest.mark.parametrize("fmt", FORMATS)
def test_overlapped_launches_wait_for_their_input(fmt, m):
    """A launch may overlap the end of the previous kernel (programmatic dependent launch,
    [Note: decode GEMM] "Launch"), and lets the next one start once it has streamed its weight.
    A chain of products, each reading the output of the one before (the first one that of an
    elementwise kernel), gives the same bits eagerly and replayed from a CUDA graph as launches
    that each wait for the previous kernel to complete. From 17 rows a 4-bit weight overlaps
    only above 2**24 elements: those rows take 8192x8192 weights."""
    from qtensor import MXFP4Tensor, MXFP8Tensor, NVFP4Tensor

    n = k = 8192 if m > 16 else 2048
    cls = {"nvfp4": NVFP4Tensor, "mxfp4": MXFP4Tensor, "mxfp8": MXFP8Tensor}[fmt]
    g = torch.Generator("cuda").manual_seed(m)
    weights = []
    for _ in range(6):
        q = cls.from_hp(torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.03)
        codes, scales = dl.pack(fmt, q.qdata.view(torch.uint8), q.scale.view(torch.uint8), n, k)
        weights.append((codes, scales, q.amax if fmt == "nvfp4" else None))
    x0 = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)

    def chain(pdl: bool) -> torch.Tensor:
        x = x0 * 1.0
        for codes, scales, amax in weights:
            x = dmm._launch(x, codes, scales, amax, None, fmt, n, k, 448, torch.bfloat16, pdl=pdl)
        return x

    serial = chain(False)
    assert torch.isfinite(serial).all() and bool(serial.abs().max() > 0)
    for _ in range(3):
        assert torch.equal(chain(True), serial)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain(True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(True)
    for _ in range(3):
        out.zero_()
        graph.replay()
        assert torch.equal(out, serial)


@pytest.mark.cuda
@needs_kernel
def test_kernel_reads_strided_and_misaligned_activations():
    args = list(_problem("nvfp4", 6, 128, 256, "cuda", seed=2))
    wide = torch.zeros(6, 264, dtype=torch.bfloat16, device="cuda")
    wide[:, 8:] = args[0]
    args[0] = wide[:, 8:]  # row stride 264, 16-byte aligned
    assert_close_to_reference(dmm.cuda(*args, torch.float32), _reference(args, torch.float32), args)
    odd = torch.zeros(6 * 256 + 1, dtype=torch.bfloat16, device="cuda")
    odd[1:] = args[0].reshape(-1)
    args[0] = odd[1:].view(6, 256)  # 2-byte aligned: the kernel copies it
    assert_close_to_reference(dmm.cuda(*args, torch.float32), _reference(args, torch.float32), args)
    # Rows 0 elements apart (one row expanded) give a tensor map no row stride: the kernel copies.
    args[0] = odd[1:257].clone().expand(6, 256)
    assert args[0].stride(0) == 0
    assert_close_to_reference(dmm.cuda(*args, torch.float32), _reference(args, torch.float32), args)


# ---- the CUDA unpack ---------------------------------------------------------------------------

needs_unpack = pytest.mark.skipif(
    not (torch.cuda.is_available() and has_kernel("decode_unpack", "CUDA")),
    reason="needs a GPU and the CUDA unpack kernel")


@pytest.mark.cuda
@needs_unpack
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", SHAPES + [(4096, 4160)])
def test_cuda_unpack_gives_the_canonical_bytes(fmt, n, k):
    """qtensor::decode_unpack against the reference unpack (and so the canonical bytes pack
    started from), on ragged shapes, every byte value and the scales of every lane."""
    if k % (16 if fmt == "nvfp4" else 32):
        pytest.skip("K is not a whole number of blocks")
    g = torch.Generator().manual_seed(n + 3 * k)
    data, scale = random_bytes(fmt, n, k, g, all_values=True)
    codes, scales = dl.pack(fmt, data, scale, n, k)
    d2, s2 = dmm.unpack(fmt, codes.cuda(), scales.cuda(), n, k)
    assert d2.is_cuda and d2.dtype == s2.dtype == torch.uint8
    assert torch.equal(d2.cpu(), data) and torch.equal(s2.cpu(), scale)


@pytest.mark.cuda
@needs_unpack
def test_cuda_unpack_all_65536_nibble_pairs_of_rows():
    n, k = 256, 1024
    words = torch.arange(65536, dtype=torch.int32)
    data = torch.stack(((words & 0xFF), (words >> 8)), dim=-1).to(torch.uint8).reshape(n, k // 2)
    scale = torch.arange(n * k // 16, dtype=torch.int32).remainder(0x7F).to(torch.uint8)
    scale = scale.reshape(n, k // 16)
    codes, scales = dl.pack("nvfp4", data, scale, n, k)
    d2, s2 = dmm.unpack("nvfp4", codes.cuda(), scales.cuda(), n, k)
    assert torch.equal(d2.cpu(), data) and torch.equal(s2.cpu(), scale)


@pytest.mark.cuda
@needs_unpack
def test_cuda_unpack_errors_and_the_canonical_tensor():
    data, scale = random_bytes("nvfp4", 64, 128, torch.Generator().manual_seed(1))
    codes, scales = (t.cuda() for t in dl.pack("nvfp4", data, scale, 64, 128))
    op = torch.ops.qtensor.decode_unpack.default
    with pytest.raises(RuntimeError, match="packed weight must be contiguous uint8 of 4096 bytes"):
        op(codes[:-16], scales, 0, 64, 128)
    with pytest.raises(RuntimeError, match="divisible by 32"):
        op(codes, scales, 2, 64, 112)
    with pytest.raises(RuntimeError, match=r"fmt is 0 \(NVFP4\)"):
        op(codes, scales, 3, 64, 128)
    # DecodeWeight.canonical() takes the kernel on the GPU: the canonical tensor's bytes.
    from qtensor import NVFP4Tensor
    from qtensor.tensors import DecodeWeight

    w = NVFP4Tensor.from_hp(torch.randn(200, 2080, generator=torch.Generator().manual_seed(4))
                            .to(torch.bfloat16).cuda())
    back = DecodeWeight.pack(w).canonical()
    assert torch.equal(back.qdata, w.qdata) and torch.equal(back.scale.view(torch.uint8),
                                                            w.scale.view(torch.uint8))
