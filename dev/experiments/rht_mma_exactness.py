"""Does a bf16 tensor-core product with fp32 accumulation give the exact RHT sums?

The CUDA quantizers sum each 16-run of the random Hadamard transform in fp32 only where that is
exact (docs/kernels.md: the run's nonzero exponent fields within 12 of each other, the largest at
most 250), and fall back to fp64 elsewhere. Doing the transform as an MMA (x @ M with M = diag(s)
H16 / 4 in bf16) would need the tensor cores to keep every bit of those sums. This script checks
that on a GPU: runs drawn at the edge of the range test (all exponents across the full 12-binade
span, full mantissas, both signs, zeros, cancellation) go through torch.mm with an fp32 output and
are compared with the exact fp64 sums, bit for bit.

    python dev/experiments/rht_mma_exactness.py [--runs N]
"""

from __future__ import annotations

import argparse

import torch

from qtensor.formats.rht import rht_matrix


def edge_runs(n: int, gen: torch.Generator, device) -> torch.Tensor:
    """n bf16 16-runs whose nonzero exponent fields span exactly 12 (or less), top field <= 250."""
    top = torch.randint(13, 251, (n, 1), generator=gen)
    span = torch.where(torch.rand(n, 1, generator=gen) < 0.5, 12, torch.randint(0, 13, (n, 1), generator=gen))
    exp = top - torch.randint(0, 13, (n, 16), generator=gen).clamp(max=span)
    exp[:, 0] = top[:, 0]
    exp[:, 1] = (top - span)[:, 0]  # both ends of the span in every run
    mant = torch.randint(0, 128, (n, 16), generator=gen)
    mant = torch.where(torch.rand(n, 16, generator=gen) < 0.3, 127, mant)  # full mantissas
    sign = torch.randint(0, 2, (n, 16), generator=gen)
    bits = (sign << 15) | (exp << 7) | mant
    bits = torch.where(torch.rand(n, 16, generator=gen) < 0.1, 0, bits)  # zeros drop out of the span
    bits[:, 0] = (exp[:, 0] << 7) | mant[:, 0]
    bits[:, 1] = (exp[:, 1] << 7) | mant[:, 1]
    runs = bits.to(torch.int16).view(torch.bfloat16)
    # cancellation: a quarter of the runs repeat their first half negated in the second half
    cancel = torch.rand(n, generator=gen) < 0.25
    runs[cancel, 8:] = -runs[cancel, :8]
    return runs.to(device)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=1 << 22)
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    m = rht_matrix().cuda()
    bad = total = 0
    for _ in range(max(1, args.runs // (1 << 20))):
        x = edge_runs(1 << 20, gen, "cuda")
        want = x.double() @ m.double()  # exact: at most 8 + 12 + 4 significant bits
        assert torch.equal(want.float().double(), want)
        for name, got in (
            ("torch.mm out_dtype=fp32", torch.mm(x, m, out_dtype=torch.float32)),
            ("torch.mm bf16 (fp32 accumulate, bf16 out)", torch.mm(x, m).float()),
        ):
            if name.startswith("torch.mm bf16"):
                ok = got.eq(want.float().bfloat16().float()) | (got.isnan() & want.isnan())
            else:
                ok = got.double().eq(want)
            n_bad = int((~ok).sum())
            print(f"{name}: {n_bad} of {ok.numel()} sums differ")
            if name.startswith("torch.mm out"):
                bad += n_bad
                total += ok.numel()
    print(f"fp32-output MMA sums differing from the exact ones: {bad} of {total}")
    # Control: runs outside the range test whose sums fp32 still holds exactly, a + b - a with
    # a = 2**span * b. The tensor cores align the products to the largest one, so from some span
    # on, b's bits fall off: the count shows where, and that the comparison above can fail.
    for span in (12, 16, 20, 24, 26, 28, 32, 40):
        n = 1 << 16
        b = torch.randint(1, 128, (n,), generator=gen).double() + 128  # 8 significant bits
        x = torch.zeros(n, 16, dtype=torch.float64)
        x[:, 0], x[:, 1], x[:, 2] = b * 2.0**span, b, -b * 2.0**span
        x = x.bfloat16().cuda()
        want = x.double() @ m.double()
        got = torch.mm(x, m, out_dtype=torch.float32).double()
        exact = want.float().double().eq(want)
        print(f"control, span 2**{span}: {int((got.ne(want) & exact).sum())} of {int(exact.sum())} "
              f"representable sums differ")


if __name__ == "__main__":
    main()
