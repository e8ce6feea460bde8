// Checks the SIMD-lane forms of csrc/quant_cpu_math.h against the scalar functions of
// csrc/quant_math.h (the math the CUDA kernels run), bit for bit:
//   e4m3_lanes (with and without its NaN select) == e4m3_bits,
//   e2m1_lanes == e2m1_encode, each as a scalar, in 4 lanes and in 8 lanes;
//   e4m3_value_lanes == e4m3_value on all 256 bytes;
//   e4m3_scale_value == e4m3_value on all 256 bytes;
//   e2m1_code_nonan (quant_rows_math.h: the E2M1 code of the CPU fast paths) and e2m1_code_fma
//   (its FMA form, the code of the CUDA rowwise and tile kernels) == e2m1_code_bits on every
//   non-negative, non-NaN pattern swept, and e2m1_code_fma_small (the FMA form without its cap)
//   on every such pattern up to 6.5;
//   the stochastic-rounding forms of the CUDA tile kernel (quant_rows_math.h): the bytes of
//   sr_group_hash of sr_block_key == sr_bits on the 16 counters of 2**16 blocks (keys and block
//   starts from a counter hash, plus the starts before the hash input's carry into bit 16 and
//   before the wrap at 2**32), the code from sr_positions (fp16 positions), with the sign nibble,
//   == e2m1_encode_sr on every non-negative pattern swept below 16 with all 256 random bytes (from
//   16 up, where every code is 7, with r8 = 0 and 255), and nv_codes_sr == e2m1_encode_sr
//   element by element on random blocks and block factors;
//   mx_inv_exponent (the MXFP8 patch phase's multiplier exponent) == mx_inv_scale on the scale
//   code of every amax pattern swept, under both rules;
//   the 4over6 forms of the CUDA kernels (quant_rows_math.h): e2m1_envelope_low == e2m1_code_bits
//   on every such pattern up to 4.5, div6 == the division by 6 on every pattern of its domain,
//   sign_nibbles_packed == sign_nibbles on random bf16 blocks and every sign pattern of one,
//   sign_nibbles_cols == sign_nibbles of each run on random packed column pairs and every sign
//   pattern of a run,
//   and fo6_block_tab == fo6_block (scale byte and codes) on random bf16 blocks under tensor
//   amaxes inside and outside the fast domain, both bounds, MAE and MSE;
//   the RHT's error bound for runs outside the fp32 range (quant_math.h): every fp32 butterfly
//   result within rht_sum_error_bound of the fp64 sum, and every result (and run max) that
//   rht_rounding_pinned keeps == rht16's, on random wide runs and sums near bf16 half-way points.
//
//   check_lanes full     every one of the 2**32 fp32 patterns (a minute or two on one core)
//   check_lanes sample   bits 12..31 in full with bits 0..11 in {0, 1, 0x800, 0xFFF}: every
//                        rounding boundary of both formats (their half-way points are bits 19
//                        and 21/22) with each sticky state below them; what the tests run
//
// Prints one line per function and exits 0 when every pattern agrees, 1 at the first
// disagreement (printed), 2 on bad arguments, 77 when this build's target (AVX2) is not
// available on the CPU. Built by tests/test_cpu_lanes.py with the extension's flags, once for
// baseline x86-64 (SSE2) and once with -mavx2: the two codegens of quant_cpu.cpp's clones.
#include <cfloat>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "../quant_cpu_math.h"

using namespace qtensor;

namespace {

constexpr uint32_t kLows[] = {0x000, 0x001, 0x800, 0xFFF};

template <typename Check>
bool sweep(bool full, Check&& check) {  // check(first pattern, consecutive?) -> ok
  if (full) {
    for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 8)
      if (!check(static_cast<uint32_t>(u), true)) return false;
    return true;
  }
  for (uint64_t hi = 0; hi < (uint64_t{1} << 20); ++hi)
    if (!check(static_cast<uint32_t>(hi << 12), false)) return false;
  return true;
}

// The 8 patterns of one check: consecutive from u (full), or u's high bits with each low value
// twice (sample), so the lanes see every low value in both halves.
void patterns(uint32_t u, bool consecutive, uint32_t* p) {
  for (uint32_t i = 0; i < 8; ++i) p[i] = consecutive ? u + i : u | kLows[i & 3];
}

// Each swept pattern with its sign bit cleared, to check(magnitude bits) -> ok.
template <typename Check>
bool sweep_magnitudes(bool full, Check&& check) {
  return sweep(full, [&](uint32_t u, bool consecutive) {
    uint32_t p[8];
    patterns(u, consecutive, p);
    for (int i = 0; i < 8; ++i)
      if (!check(p[i] & 0x7FFFFFFFu)) return false;
    return true;
  });
}

template <typename Ref, typename Lane>
bool agree(const char* name, const uint32_t* p, Ref ref, Lane lane, bool skip_nan) {
  float f[8];
  for (int i = 0; i < 8; ++i) f[i] = u2f(p[i]);
  vf8 v8;
  vf4 v4;
  std::memcpy(&v8, f, sizeof v8);
  const vi8 r8 = lane(v8);
  for (int h = 0; h < 2; ++h) {
    std::memcpy(&v4, f + 4 * h, sizeof v4);
    const vi4 r4 = lane(v4);
    for (int i = 0; i < 4; ++i) {
      const int k = 4 * h + i;
      if (skip_nan && f[k] != f[k]) continue;
      const uint32_t want = ref(f[k]);
      const uint32_t s = static_cast<uint32_t>(lane(f[k]));
      if (s != want || static_cast<uint32_t>(r4[i]) != want || static_cast<uint32_t>(r8[k]) != want) {
        std::printf("%s: pattern 0x%08" PRIx32 ": reference 0x%02" PRIx32
                    ", scalar 0x%02" PRIx32 ", 4 lanes 0x%02" PRIx32 ", 8 lanes 0x%02" PRIx32 "\n",
                    name, p[k], want, s, static_cast<uint32_t>(r4[i]),
                    static_cast<uint32_t>(r8[k]));
        return false;
      }
    }
  }
  return true;
}

struct E4M3 {
  template <typename F>
  auto operator()(F v) const { return e4m3_lanes<decltype(as_i(v)), F>(v); }
};
struct E4M3NoNaN {
  template <typename F>
  auto operator()(F v) const { return e4m3_lanes<decltype(as_i(v)), F, false>(v); }
};
struct E2M1 {
  template <typename F>
  auto operator()(F v) const { return e2m1_lanes<decltype(as_i(v)), F>(v); }
};

bool check_values() {
  for (uint32_t b = 0; b < 256; b += 4) {
    const vi4 bytes = {static_cast<int32_t>(b), static_cast<int32_t>(b + 1),
                       static_cast<int32_t>(b + 2), static_cast<int32_t>(b + 3)};
    const vi4 got = as_i(e4m3_value_lanes(bytes));
    for (uint32_t i = 0; i < 4; ++i) {
      const float want = e4m3_value(static_cast<uint8_t>(b + i));
      const bool both_nan = want != want && u2f(static_cast<uint32_t>(got[i])) != u2f(static_cast<uint32_t>(got[i]));
      if (!both_nan && static_cast<uint32_t>(got[i]) != f2u(want)) {
        std::printf("e4m3_value_lanes: byte 0x%02" PRIx32 ": reference 0x%08" PRIx32
                    ", lanes 0x%08" PRIx32 "\n", b + i, f2u(want), static_cast<uint32_t>(got[i]));
        return false;
      }
    }
  }
  return true;
}

template <typename Lane>
bool run(const char* name, bool full, uint32_t (*ref)(float), Lane lane, bool skip_nan) {
  const bool ok = sweep(full, [&](uint32_t u, bool consecutive) {
    uint32_t p[8];
    patterns(u, consecutive, p);
    return agree(name, p, ref, lane, skip_nan);
  });
  std::printf("%-24s %s\n", name, ok ? "equal" : "DIFFERENT");
  return ok;
}

// A fast E2M1 code on the magnitude of each pattern (NaN magnitudes are outside its domain).
template <typename Code>
bool check_code(const char* name, bool full, Code code) {
  const bool ok = sweep_magnitudes(full, [&](uint32_t b) {
    if (b > 0x7F800000u || code(b) == e2m1_code_bits(b)) return true;
    std::printf("%s: pattern 0x%08" PRIx32 ": reference %" PRIu32 ", got %" PRIu32 "\n", name, b,
                e2m1_code_bits(b), code(b));
    return false;
  });
  std::printf("%-24s %s\n", name, ok ? "equal" : "DIFFERENT");
  return ok;
}

uint32_t xorshift(uint32_t& x) {
  x ^= x << 13;
  x ^= x >> 17;
  x ^= x << 5;
  return x;
}

// The block hash of the stochastic rounding against sr_bits, counter by counter.
bool check_sr_hash() {
  for (uint32_t j = 0; j < (1u << 16) + 4; ++j) {
    const uint32_t key = mix32(j * 0x9E3779B9u);
    uint32_t c0 = mix32(j) & ~15u;
    if (j >= (1u << 16)) c0 = (j & 1u) ? 0x3FFF0u : 0xFFFFFFF0u;  // before a carry / the wrap
    const uint32_t z = sr_block_key(key, c0);
    for (uint32_t i = 0; i < 16; ++i) {
      const uint32_t got = (sr_group_hash(z ^ (i >> 2)) >> (8 * (i & 3))) & 0xFFu;
      if (got != sr_bits(key, c0 + i)) {
        std::printf("sr_group_hash: key 0x%08" PRIx32 ", counter 0x%08" PRIx32
                    ": reference 0x%02" PRIx32 ", got 0x%02" PRIx32 "\n",
                    key, c0 + i, sr_bits(key, c0 + i), got);
        return false;
      }
    }
  }
  return true;
}

// The stochastic code of each non-negative, non-NaN pattern (inf included) through sr_positions
// (the pattern times 2**-14, as the kernel's product with enc = 1), with random bytes r8 in the low
// half and 255 - r8 in the high one, against e2m1_encode_sr of either sign (the kernel or-s the
// input's sign nibble on): all 256 bytes below 16, 0 and 255 from 16 up.
bool check_sr_code(bool full) {
  const bool ok = sweep(full, [&](uint32_t u, bool consecutive) {
    uint32_t p[8];
    patterns(u, consecutive, p);
    for (int i = 0; i < 8; ++i) {
      const uint32_t b = p[i] & 0x7FFFFFFFu;
      if (b > 0x7F800000u || (!consecutive && (i & 4))) continue;  // NaN; sample: each low once
      const uint32_t last = b < 0x41800000u ? 255u : 1u;
      const float a = u2f(b) * 0x1p-14f;
      for (uint32_t r = 0; r <= last; ++r) {
        const uint32_t r8[2] = {b < 0x41800000u ? r : 255u * r, 255u - (b < 0x41800000u ? r : 255u * r)};
        const uint32_t pos = sr_positions(a, a, r8[0] | (r8[1] << 16));
        for (int h = 0; h < 2; ++h) {
          const uint32_t half = (pos >> (16 * h)) & 0xFFFFu, got = half >> 9;
          for (uint32_t sign = 0; sign < 2; ++sign) {
            const uint32_t want = e2m1_encode_sr(u2f(b | (sign << 31)), r8[h]);
            if (got > 7u || (got | (sign << 3)) != want) {
              std::printf("sr_positions: pattern 0x%08" PRIx32 ", r8 %" PRIu32 ", half %d: reference %" PRIu32
                          ", got position 0x%04" PRIx32 "\n", b | (sign << 31), r8[h], h, want, half);
              return false;
            }
          }
        }
      }
    }
    return true;
  });
  std::printf("%-24s %s\n", "sr_positions", ok ? "equal" : "DIFFERENT");
  return ok;
}

// nv_codes_sr against e2m1_encode_sr(v[i] * enc, sr_bits(key, c0 + i)) on 2**16 random blocks of
// finite values (bf16 patterns over the whole exponent range, zeros and both signs), with block
// factors over its domain (2**-112 .. FLT_MAX, both ends and 1 included): the pairing of the
// hash's bytes, the gathering into nibbles, the signs and the product's scaling by 2**-14.
bool check_sr_block() {
  uint32_t rng = 0x2545F491u;
  const float ends[] = {0x1p-112f, 1.f, FLT_MAX, 0x1.8p-100f};
  for (uint32_t n = 0; n < (1u << 16); ++n) {
    float v[16];
    const uint32_t spread = xorshift(rng) % 40u;  // exponents within 2**spread of each other
    const uint32_t top = 1u + xorshift(rng) % (254u - spread);
    for (int i = 0; i < 16; ++i) {
      const uint32_t x = xorshift(rng);
      const uint32_t e = top + (spread ? x % (spread + 1u) : 0u);
      v[i] = (x >> 24) < 24u ? 0.f : u2f(((x & 0x80000000u) | (e << 23) | (x & 0x7F0000u)) & 0xFFFF0000u);
    }
    float enc = n < 4u ? ends[n] : u2f(0x07800000u + xorshift(rng) % (0x7F7FFFFFu - 0x07800000u));
    if (n % 5u == 1u) enc = 0x1p-2f;
    const uint32_t key = mix32(n), c0 = xorshift(rng) & ~15u;
    const Codes got = nv_codes_sr(v, sign_nibbles(v), enc, key, c0);
    for (uint32_t i = 0; i < 16; ++i) {
      const uint32_t want = e2m1_encode_sr(v[i] * enc, sr_bits(key, c0 + i));
      const uint32_t have = ((i < 8 ? got.x : got.y) >> (4 * (i & 7))) & 0xFu;
      if (have != want) {
        std::printf("nv_codes_sr: block %" PRIu32 ", element %" PRIu32 " 0x%08" PRIx32 ", enc 0x%08" PRIx32
                    ": reference %" PRIu32 ", got %" PRIu32 "\n", n, i, f2u(v[i]), f2u(enc), want, have);
        return false;
      }
    }
  }
  return true;
}

// rht_rounding_pinned (the CUDA kernels' test for runs outside the fp32 range): on runs of every
// spread, each fp32 butterfly result that its run's error bound pins, held times 4, is rht16's
// result exactly, and so is the run's max |result| where the bound pins the fp32 max. Families:
// wide random spreads (13 to 120 exponent steps, subnormals and zeros among them), and sums put
// on a bf16 half-way point by two large elements with tiny ones deciding the rounding (the fp32
// butterfly loses or rounds them). Most results of the first must be pinned, and some of the
// second not; a bound 4 times too small fails.
bool check_rht_pinned() {
  uint32_t rng = 0x6C8E9CF5u;
  uint64_t wide = 0, wide_pinned = 0, tie = 0, tie_pinned = 0;
  double worst = 0.0;  // the largest |fp32 sum - fp64 sum| seen, in bounds
  for (uint32_t n = 0; n < (1u << 17); ++n) {
    const bool ties = n % 4u == 3u;
    float x[16];
    const uint32_t spread = 13u + xorshift(rng) % 108u;
    const uint32_t top = 24u + xorshift(rng) % 226u;  // the bound's domain: fmax in [24, 249]
    for (int i = 0; i < 16; ++i) {
      const uint32_t r = xorshift(rng);
      const uint32_t e = top > (r >> 8) % (spread + 1u) ? top - (r >> 8) % (spread + 1u) : 0u;
      x[i] = (r >> 28) == 0u ? 0.f : u2f(((r & 0x80000000u) | (e << 23) | (r & 0x7F0000u)) & 0xFFFF0000u);
    }
    if (ties) {  // x0 + x1 = 2**t (1 + 2**-8) on the outputs that add them; the rest tiny
      const uint32_t t = 10u + xorshift(rng) % 200u, i1 = 1u + xorshift(rng) % 15u;
      for (int i = 0; i < 16; ++i)
        if (xorshift(rng) % 3u != 0u) {
          // near the sums' last fp32 bit (the largest rounding errors), or far below it
          const uint32_t drop = n % 8u == 3u ? 17u + xorshift(rng) % 12u : 30u + xorshift(rng) % 60u;
          x[i] = u2f((f2u(x[i]) & 0x807FFFFFu) | ((t > drop ? t - drop : 0u) << 23));
        }
      x[0] = u2f(t << 23);
      x[i1] = u2f((t - 8u) << 23);
    }
    uint32_t fmax = 0u;
    for (int i = 0; i < 16; ++i) {
      const uint32_t e = (f2u(x[i]) >> 23) & 0xFFu;
      fmax = e > fmax ? e : fmax;
    }
    if (!rht_bound_applies(fmax)) continue;
    float ref[16], s[16];
    double d[16];
    std::memcpy(ref, x, sizeof x);
    std::memcpy(s, x, sizeof x);
    for (int i = 0; i < 16; ++i) d[i] = x[i];
    rht16(ref);
    signed_hadamard16(s);
    signed_hadamard16(d);  // the reference's fp64 sums
    const float bound = rht_sum_error_bound(fmax);
    for (int i = 0; i < 16; ++i) {
      const double err = std::fabs(static_cast<double>(s[i]) - d[i]) / bound;
      if (!(err <= 1.0)) {
        std::printf("rht_sum_error_bound: run %" PRIu32 ", result %d: fp32 sum 0x%08" PRIx32 " is %g bounds "
                    "from the fp64 sum\n", n, i, f2u(s[i]), err);
        return false;
      }
      worst = err > worst ? err : worst;
    }
    float smax = 0.f, rmax = 0.f;
    for (int i = 0; i < 16; ++i) {
      smax = std::fabs(s[i]) > smax ? std::fabs(s[i]) : smax;
      rmax = std::fabs(ref[i]) > rmax ? std::fabs(ref[i]) : rmax;
      const bool pinned = rht_rounding_pinned(s[i], bound);
      (ties ? tie : wide) += 1;
      (ties ? tie_pinned : wide_pinned) += pinned ? 1 : 0;
      if (pinned && f2u(bf16_round(s[i]) * 0.25f) != f2u(ref[i])) {
        std::printf("rht_rounding_pinned: run %" PRIu32 ", result %d: fp32 sum 0x%08" PRIx32 ", bound 0x%08" PRIx32
                    ": reference 0x%08" PRIx32 ", pinned 0x%08" PRIx32 "\n", n, i, f2u(s[i]), f2u(bound),
                    f2u(ref[i]), f2u(bf16_round(s[i]) * 0.25f));
        return false;
      }
    }
    if (rht_rounding_pinned(smax, bound) && f2u(bf16_round(smax) * 0.25f) != f2u(rmax)) {
      std::printf("rht_rounding_pinned: run %" PRIu32 ": max |fp32 sum| 0x%08" PRIx32 ": reference max 0x%08" PRIx32
                  ", pinned 0x%08" PRIx32 "\n", n, f2u(smax), f2u(rmax), f2u(bf16_round(smax) * 0.25f));
      return false;
    }
  }
  const double share = static_cast<double>(wide_pinned) / static_cast<double>(wide);
  std::fprintf(stderr, "rht_rounding_pinned: pinned %.4f of %" PRIu64 " wide results, %" PRIu64 " of %" PRIu64
               " near ties; largest error %.3f of the bound\n", share, wide, tie_pinned, tie, worst);
  if (share < 0.98 || tie_pinned == tie || worst < 0.25) {
    std::printf("rht_rounding_pinned: the families no longer test the bound (want >= 0.98 pinned "
                "of wide results, some near ties not, an error past a quarter of the bound)\n");
    return false;
  }
  std::printf("%-24s %s\n", "rht_rounding_pinned", "equal");
  return true;
}

// mx_inv_exponent against mx_inv_scale on the scale code of every amax pattern swept (both signs'
// magnitudes, inf and NaN included), under both rules: a finite amax's code is at most 247 and
// its exponent byte gives mx_inv_scale exactly; a NaN or inf amax gives code 255 and byte 255.
bool check_mx_exponent(bool full) {
  const bool ok = sweep_magnitudes(full, [&](uint32_t b) {
    for (int rule = 0; rule < 2; ++rule) {
      const uint32_t code = mx_scale_code(u2f(b), rule), e = mx_inv_exponent(code);
      const bool good = b < 0x7F800000u ? code <= 247u && u2f(e << 23) == mx_inv_scale(code)
                                        : code == 255u && e == 255u;
      if (!good) {
        std::printf("mx_inv_exponent: amax 0x%08" PRIx32 ", rule %d: code %" PRIu32 ", byte %" PRIu32 "\n",
                    b, rule, code, e);
        return false;
      }
    }
    return true;
  });
  std::printf("%-24s %s\n", "mx_inv_exponent", ok ? "equal" : "DIFFERENT");
  return ok;
}

// div6 against the division on every non-negative pattern swept in its domain (0 and
// 2**-125 .. FLT_MAX).
bool check_div6(bool full) {
  const bool ok = sweep_magnitudes(full, [&](uint32_t b) {
    if (b >= 0x7F800000u || (b != 0u && b < 0x01000000u)) return true;  // outside the domain
    const float want = u2f(b) / 6.f, got = div6(u2f(b));
    if (f2u(want) == f2u(got)) return true;
    std::printf("div6: pattern 0x%08" PRIx32 ": reference 0x%08" PRIx32 ", got 0x%08" PRIx32 "\n", b,
                f2u(want), f2u(got));
    return false;
  });
  std::printf("%-24s %s\n", "div6", ok ? "equal" : "DIFFERENT");
  return ok;
}

// sign_nibbles_packed (with its host form of prmt) against sign_nibbles of the unpacked bf16
// values on 2**16 random blocks and every one of the 2**16 sign patterns of one block.
bool check_sign_nibbles() {
  uint32_t rng = 0x9E3779B9u;
  for (uint32_t n = 0; n < (1u << 17); ++n) {
    uint32_t w[8];
    float v[16];
    for (int k = 0; k < 8; ++k) {
      w[k] = xorshift(rng);
      if (n >= (1u << 16)) {  // the sign patterns: element i's sign from bit i of n
        w[k] &= 0x7FFF7FFFu;
        w[k] |= ((n >> (2 * k)) & 1u) << 15 | ((n >> (2 * k + 1)) & 1u) << 31;
      }
      v[2 * k] = u2f(w[k] << 16);
      v[2 * k + 1] = u2f(w[k] & 0xFFFF0000u);
    }
    const Codes want = sign_nibbles(v), got = sign_nibbles_packed(w);
    if (want.x != got.x || want.y != got.y) {
      std::printf("sign_nibbles_packed: word 0 0x%08" PRIx32 ": reference %08" PRIx32 "%08" PRIx32
                  ", got %08" PRIx32 "%08" PRIx32 "\n", w[0], want.y, want.x, got.y, got.x);
      std::printf("%-24s %s\n", "sign_nibbles_packed", "DIFFERENT");
      return false;
    }
  }
  std::printf("%-24s %s\n", "sign_nibbles_packed", "equal");
  return true;
}

// sign_nibbles_cols against sign_nibbles of each run's unpacked bf16 values (run 0 in the low
// halves, run 1 in the high halves) on 2**16 random column pairs and every one of the 2**16 sign
// patterns of run 0 (run 1 taking the complement).
bool check_sign_nibbles_cols() {
  uint32_t rng = 0x7F4A7C15u;
  for (uint32_t n = 0; n < (1u << 17); ++n) {
    uint32_t w[16];
    float v[2][16];
    for (int i = 0; i < 16; ++i) {
      w[i] = xorshift(rng);
      if (n >= (1u << 16)) {  // run 0's element i takes bit i of n as its sign, run 1 the other
        const uint32_t bit = (n >> i) & 1u;
        w[i] = (w[i] & 0x7FFF7FFFu) | bit << 15 | (bit ^ 1u) << 31;
      }
      v[0][i] = u2f(w[i] << 16);
      v[1][i] = u2f(w[i] & 0xFFFF0000u);
    }
    Codes got[2];
    sign_nibbles_cols(w, &got[0], &got[1]);
    for (int r = 0; r < 2; ++r) {
      const Codes want = sign_nibbles(v[r]);
      if (want.x != got[r].x || want.y != got[r].y) {
        std::printf("sign_nibbles_cols: run %d, word 0 0x%08" PRIx32 ": reference %08" PRIx32 "%08" PRIx32
                    ", got %08" PRIx32 "%08" PRIx32 "\n", r, w[0], want.y, want.x, got[r].y, got[r].x);
        std::printf("%-24s %s\n", "sign_nibbles_cols", "DIFFERENT");
        return false;
      }
    }
  }
  std::printf("%-24s %s\n", "sign_nibbles_cols", "equal");
  return true;
}

// fo6_block_tab (the CUDA kernels' 4over6 block, value tables and div6) against fo6_block on
// random bf16 blocks: tensor amaxes inside and outside fo6_fast_domain, both bounds, MAE and
// MSE; block amaxes from the tensor amax down past 2**-125 (and zero), with the elements spread
// below the block amax so that codes 0..7 all occur.
bool check_fo6_tab() {
  const float amaxes[] = {1.f, 2688.f, 3.7e-3f, 6.02e4f, 0x1p-40f, 1e30f, 0x1p-61f, 0x1p70f};
  Fo6Byte bytes[256];
  float col6[8], col4[8];
  fo6_zero(col6);
  fo6_zero(col4);
  uint32_t rng = 0x2545F491u;
  for (float amax : amaxes) {
    for (int bound = 256; bound <= 448; bound += 192) {
      const NvScale ts = nv_scale(amax, bound);
      const float six_b = static_cast<float>(6 * bound);
      for (int s = 0; s < 256; ++s) bytes[s] = fo6_byte(static_cast<uint8_t>(s), ts, six_b);
      for (int n = 0; n < 8192; ++n) {
        float v[16];
        // The block amax: amax * 2**-k (k < 48, bf16-rounded), sometimes amax itself or zero.
        const uint32_t k = xorshift(rng) % 64u;
        float top = k == 0u ? amax : amax * u2f(static_cast<uint32_t>(127 - static_cast<int>(k) * 3 / 4) << 23);
        top = u2f(f2u(top) & 0xFFFF0000u);
        if (k == 63u) top = 0.f;
        float bam = 0.f;
        for (int i = 0; i < 16; ++i) {
          const uint32_t r = xorshift(rng);
          // a random fraction of top, bf16: uniform mantissa, a power of two down to 2**-6
          const float frac = (1.f + static_cast<float>(r & 0x7Fu) / 128.f) * u2f((126u - ((r >> 7) % 7u)) << 23);
          float x = u2f(f2u(top * frac) & 0xFFFF0000u);
          if (i == static_cast<int>((r >> 12) & 15u)) x = top;
          if (r & 0x80000000u) x = -x;
          v[i] = x;
          bam = u2f(umax(f2u(bam), f2u(x) & 0x7FFFFFFFu));
        }
        uint32_t words[8];  // the packed bf16 words, for the signs on every other block
        for (int k = 0; k < 8; ++k) words[k] = (f2u(v[2 * k]) >> 16) | (f2u(v[2 * k + 1]) & 0xFFFF0000u);
        const uint32_t* w16 = (n & 1) ? words : nullptr;
        for (int mse = 0; mse < 2; ++mse) {
          Codes want, got;
          const uint8_t sw = mse ? fo6_block<true>(v, bam, ts, six_b, &want) : fo6_block<false>(v, bam, ts, six_b, &want);
          const uint8_t sg = mse ? fo6_block_tab<true, 1>(v, bam, ts, six_b, bytes, col6, col4, &got, w16)
                                 : fo6_block_tab<false, 1>(v, bam, ts, six_b, bytes, col6, col4, &got, w16);
          if (sw != sg || want.x != got.x || want.y != got.y) {
            std::printf("fo6_block_tab: amax %a, bound %d, %s, block amax %a: reference byte 0x%02x codes "
                        "%08" PRIx32 "%08" PRIx32 ", got 0x%02x %08" PRIx32 "%08" PRIx32 "\n",
                        amax, bound, mse ? "MSE" : "MAE", bam, sw, want.y, want.x, sg, got.y, got.x);
            std::printf("%-24s %s\n", "fo6_block_tab", "DIFFERENT");
            return false;
          }
        }
      }
    }
  }
  std::printf("%-24s %s\n", "fo6_block_tab", "equal");
  return true;
}

uint32_t e4m3_ref(float v) { return e4m3_bits(v); }
uint32_t e2m1_ref(float v) { return e2m1_encode(v); }

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2 || (std::strcmp(argv[1], "full") != 0 && std::strcmp(argv[1], "sample") != 0)) {
    std::fprintf(stderr, "usage: %s full|sample\n", argv[0]);
    return 2;
  }
#if defined(__AVX2__)
  if (!__builtin_cpu_supports("avx2")) {
    std::printf("this build targets AVX2, which this CPU lacks\n");
    return 77;
  }
  std::printf("codegen: AVX2\n");
#else
  std::printf("codegen: baseline\n");
#endif
  const bool full = std::strcmp(argv[1], "full") == 0;
  bool ok = run("e4m3_lanes", full, e4m3_ref, E4M3{}, false);
  ok = run("e4m3_lanes (no NaN)", full, e4m3_ref, E4M3NoNaN{}, true) && ok;
  ok = run("e2m1_lanes", full, e2m1_ref, E2M1{}, false) && ok;
  const bool values = check_values();
  std::printf("%-24s %s\n", "e4m3_value_lanes", values ? "equal" : "DIFFERENT");
  bool scale_values = true;
  for (uint32_t b = 0; b < 256; ++b) {
    const float want = e4m3_value(static_cast<uint8_t>(b)), got = e4m3_scale_value(static_cast<uint8_t>(b));
    if (!(want != want && got != got) && f2u(want) != f2u(got)) {
      std::printf("e4m3_scale_value: byte 0x%02" PRIx32 ": reference 0x%08" PRIx32 ", got 0x%08" PRIx32 "\n",
                  b, f2u(want), f2u(got));
      scale_values = false;
      break;
    }
  }
  std::printf("%-24s %s\n", "e4m3_scale_value", scale_values ? "equal" : "DIFFERENT");
  ok = scale_values && ok;
  ok = check_code("e2m1_code_nonan", full, [](uint32_t b) { return e2m1_code_nonan(b); }) && ok;
  ok = check_code("e2m1_code_fma", full, [](uint32_t b) { return e2m1_code_fma(u2f(b)); }) && ok;
  ok = check_code("e2m1_code_fma_small", full, [](uint32_t b) {
    return b <= 0x40D00000u ? e2m1_code_fma_small(u2f(b)) : e2m1_code_bits(b);  // a <= 6.5
  }) && ok;
  const bool hash = check_sr_hash();
  std::printf("%-24s %s\n", "sr_group_hash", hash ? "equal" : "DIFFERENT");
  ok = hash && ok;
  ok = check_sr_code(full) && ok;
  const bool block = check_sr_block();
  std::printf("%-24s %s\n", "nv_codes_sr", block ? "equal" : "DIFFERENT");
  ok = block && ok;
  ok = check_mx_exponent(full) && ok;
  ok = check_code("e2m1_envelope_low", full, [](uint32_t b) {
    return b <= 0x40900000u ? e2m1_envelope_low(u2f(b)) - 0x4B000000u : e2m1_code_bits(b);  // a <= 4.5
  }) && ok;
  ok = check_div6(full) && ok;
  ok = check_sign_nibbles() && ok;
  ok = check_sign_nibbles_cols() && ok;
  ok = check_fo6_tab() && ok;
  ok = check_rht_pinned() && ok;
  return ok && values ? 0 : 1;
}
