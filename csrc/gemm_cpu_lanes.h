// The lane kernels of gemm_cpu.cpp, compiled once per instruction set: gemm_cpu.cpp includes
// this file three times, each time inside its own namespace with `ISA` defined there and, for
// AVX2 and AVX-512, under a target pragma (GCC) or attribute region (Clang), so that every
// function here (the intrinsics' callers included) is compiled for that target, each namespace
// with its own copy of every helper. No include guard, on purpose.
//
// `Lanes`, 16 fp32 lanes, is one AVX-512 register, or two halves of 8 (one AVX2 register each):
// a 16-lane vector type on AVX2 made the compiler shuffle every result through memory. The
// intrinsics (e2m1_units8, the AVX2 and AVX-512 branches of units16 and fma) are the only
// target-specific code; the rest is GCC/Clang vector extensions, the same operations on every
// target.

// The bytes at p as a T (an unaligned vector load), and a value's bits as another type of its
// size (C++20's bit_cast, for vector types too).
template <typename T>
QT_GEMM_INLINE T load_as(const void* p) {
  T t;
  std::memcpy(&t, p, sizeof t);
  return t;
}
template <typename T, typename F>
QT_GEMM_INLINE T bits_as(F f) {
  static_assert(sizeof(T) == sizeof(F), "a bit cast keeps the size");
  return load_as<T>(&f);
}

// e4m3 value(b) of byte lanes b (0..255): a normal magnitude a's fp32 bits are (a << 20) +
// (120 << 23); a subnormal one's m * 2**-9 is the same bits with exponent 121, minus 2**-6
// (exact; quant_math.h e4m3_scale_value); 0x7F is NaN; the sign goes to bit 31.
template <typename I, typename F>
QT_GEMM_INLINE F e4m3_lanes(I w) {
  const I a = w & 0x7F, u = a << 20;
  const F normal = bits_as<F>(u + (120 << 23));
  const F sub = bits_as<F>(u + (121 << 23)) - 0x1p-6f;
  I mag = bits_as<I>(a < 8 ? sub : normal);
  mag = a == 0x7F ? I{} + 0x7FC00000 : mag;
  return bits_as<F>(mag | ((w & 0x80) << 24));
}

#if defined(QT_GEMM_X86)
// The 8 code bytes at p as 16 nibble bytes, element 2j (the low nibble of byte j) first.
QT_GEMM_INLINE __m128i nibble_bytes(const uint8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i f = _mm_set1_epi8(0x0F);
  return _mm_unpacklo_epi8(_mm_and_si128(b, f), _mm_and_si128(_mm_srli_epi16(b, 4), f));
}
#endif

// (The functions below that branch on the instruction set take it as a template parameter I,
// defaulted to ISA, so that the branches of the other targets are never compiled.)
template <int I>
using LanesOf = std::conditional_t<I == kAvx512, f32x16, Pair8>;
using Lanes = LanesOf<ISA>;

// 16 floats at p (unaligned), a half at a time where Lanes has halves.
template <int I = ISA>
QT_GEMM_INLINE LanesOf<I> lanes(const float* p) {
  if constexpr (I == kAvx512) {
    return load_as<f32x16>(p);
  } else {
    return Pair8{{load_as<f32x8>(p), load_as<f32x8>(p + 8)}};
  }
}

// The lanes summed by halves: (l, l + 8), then 4, 2, 1 apart. (Lane subscripts and shuffles,
// not a copy to memory: the sums would then live in memory for the whole loop.)
template <int I = ISA>
QT_GEMM_INLINE float lane_sum(LanesOf<I> v) {
  if constexpr (I == kAvx512) {
#if defined(QT_GEMM_X86)
    const __m512 w = reinterpret_cast<__m512>(v);
    const f32x8 h = reinterpret_cast<f32x8>(
        _mm256_add_ps(_mm512_castps512_ps256(w), _mm512_extractf32x8_ps(w, 1)));
    return ((h[0] + h[4]) + (h[2] + h[6])) + ((h[1] + h[5]) + (h[3] + h[7]));
#endif
  } else {
    const f32x8 h = v.h[0] + v.h[1];
    return ((h[0] + h[4]) + (h[2] + h[6])) + ((h[1] + h[5]) + (h[3] + h[7]));
  }
}

#if defined(QT_GEMM_X86)
// value(q) * s of the 8 codes in idx's lanes: the magnitudes permuted (the permute takes
// indices modulo 8), then the sign bit q & 8 moved to bit 31 (-0 for code 8, as the table has).
// A template so that only the AVX2 namespace, whose units16 calls it, compiles it.
template <int I>
QT_GEMM_INLINE f32x8 e2m1_units8(__m256 table, __m256i idx) {
  const __m256i u = _mm256_castps_si256(_mm256_permutevar8x32_ps(table, idx));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(idx, _mm256_set1_epi32(8)), 28);
  return reinterpret_cast<f32x8>(_mm256_xor_si256(u, sign));
}
#endif

// The 16 units of weight row w (bytes) with scale bytes sc, at elements k .. k + 15.
template <int FMT, int I = ISA>
QT_GEMM_INLINE LanesOf<I> units16(const uint8_t* w, const uint8_t* sc, int64_t k) {
  const float s = FMT == kNvfp4 ? kScales.e4m3[sc[k / 16]] : kScales.ue8m0[sc[k / 32]];
  const uint8_t* p = FMT == kMxfp8 ? w + k : w + k / 2;
#if defined(QT_GEMM_X86)
  if constexpr (I == kAvx512) {
    if constexpr (FMT == kMxfp8) {
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      return e4m3_lanes<i32x16, f32x16>(reinterpret_cast<i32x16>(b)) * s;
    } else {
      const __m512 table = _mm512_mul_ps(reinterpret_cast<__m512>(kE2M1Signed), _mm512_set1_ps(s));
      return reinterpret_cast<f32x16>(
          _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(nibble_bytes(p)), table));
    }
  } else if constexpr (I == kAvx2) {
    if constexpr (FMT == kMxfp8) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      const f32x8 lo = e4m3_lanes<i32x8, f32x8>(reinterpret_cast<i32x8>(_mm256_cvtepu8_epi32(b)));
      const f32x8 hi = e4m3_lanes<i32x8, f32x8>(
          reinterpret_cast<i32x8>(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))));
      return Pair8{{lo * s, hi * s}};
    } else {
      const __m256 table = _mm256_mul_ps(reinterpret_cast<__m256>(kE2M1Magnitude), _mm256_set1_ps(s));
      const __m128i q = nibble_bytes(p);
      return Pair8{{e2m1_units8<ISA>(table, _mm256_cvtepu8_epi32(q)),
                    e2m1_units8<ISA>(table, _mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)))}};
    }
  }
#endif
  float u[16];
  for (int i = 0; i < 16; ++i) {
    if constexpr (FMT == kMxfp8) {
      u[i] = e4m3_value(p[i]) * s;
    } else {
      const int q = (p[i / 2] >> (4 * (i & 1))) & 15;
      u[i] = kE2M1Signed[q] * s;
    }
  }
  return lanes<I>(u);
}

// a * b + c per lane, rounded once (a fused multiply-add on every target, so that the bits do
// not depend on the instruction set; with a bf16, fp16 or unit activation the product is exact
// and this equals the product added).
template <int I = ISA>
QT_GEMM_INLINE LanesOf<I> fma(LanesOf<I> a, LanesOf<I> b, LanesOf<I> c) {
  if constexpr (I == kAvx512) {
#if defined(QT_GEMM_X86)
    return reinterpret_cast<f32x16>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a),
                                                    reinterpret_cast<__m512>(b),
                                                    reinterpret_cast<__m512>(c)));
#endif
  } else if constexpr (I == kAvx2) {
#if defined(QT_GEMM_X86)
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h)
      c.h[h] = reinterpret_cast<f32x8>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a.h[h]),
                                                       reinterpret_cast<__m256>(b.h[h]),
                                                       reinterpret_cast<__m256>(c.h[h])));
    return c;
#endif
  } else {
    for (int h = 0; h < 2; ++h)
      for (int l = 0; l < 8; ++l) c.h[h][l] = std::fma(a.h[h][l], b.h[h][l], c.h[h][l]);
    return c;
  }
}

// out[m0 .. m0 + MT, n0 .. n0 + NT]: NT weight rows decoded once per 16 elements and multiplied
// into MT activation rows.
template <int FMT, int MT, int NT>
QT_GEMM_INLINE void tile(const Operands& o, int64_t m0, int64_t n0) {
  Lanes acc[MT][NT] = {};
  const uint8_t* w = o.w + n0 * o.ldw;
  const uint8_t* sc = o.s + n0 * o.lds;
  const float* x = o.x + m0 * o.ldx;
  // Fully unrolled, so that the sums stay in registers.
  for (int64_t k = 0; k < o.K; k += 16) {
    Lanes u[NT];
#pragma GCC unroll 8
    for (int j = 0; j < NT; ++j) u[j] = units16<FMT>(w + j * o.ldw, sc + j * o.lds, k);
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i) {
      const Lanes xv = lanes(x + i * o.ldx + k);
#pragma GCC unroll 8
      for (int j = 0; j < NT; ++j) acc[i][j] = fma(xv, u[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) o.out[(m0 + i) * o.ldo + n0 + j] = lane_sum(acc[i][j]);
}

// Activation rows [m, M) against weight rows n0 .. n0 + NT: tiles of MT rows, then the rows
// left over in tiles of MT / 2, MT / 4, ... (each tile decodes the weight rows once).
template <int FMT, int MT, int NT>
QT_GEMM_INLINE void rows(const Operands& o, int64_t m, int64_t M, int64_t n0) {
  for (; m + MT <= M; m += MT) tile<FMT, MT, NT>(o, m, n0);
  if constexpr (MT > 1) rows<FMT, MT / 2, NT>(o, m, M, n0);
}

// The weight rows [n_lo, n_hi): tiles of MT x NT (the accumulators fit the registers of the
// instruction set: 16 zmm, or 8 ymm pairs), then single weight rows.
template <int FMT>
QT_GEMM_INLINE void weight_rows(const Operands& o, int64_t M, int64_t n_lo, int64_t n_hi) {
  constexpr int NT = ISA == kAvx512 ? 2 : 1;
  int64_t n = n_lo;
  if (M == 1) {
    for (; n + 4 <= n_hi; n += 4) rows<FMT, 1, 4>(o, 0, M, n);
  } else if (M < 4) {
    for (; n + 2 <= n_hi; n += 2) rows<FMT, 2, 2>(o, 0, M, n);
  } else if (ISA == kAvx512 && M >= 8) {
    for (; n + NT <= n_hi; n += NT) rows<FMT, 8, NT>(o, 0, M, n);
  } else {
    for (; n + NT <= n_hi; n += NT) rows<FMT, 4, NT>(o, 0, M, n);
  }
  for (; n < n_hi; ++n) rows<FMT, 1, 1>(o, 0, M, n);
}

void weight_rows_entry(int fmt, const Operands& o, int64_t M, int64_t lo, int64_t hi) {
  switch (fmt) {
    case kNvfp4: weight_rows<kNvfp4>(o, M, lo, hi); break;
    case kMxfp4: weight_rows<kMxfp4>(o, M, lo, hi); break;
    default: weight_rows<kMxfp8>(o, M, lo, hi); break;
  }
}

template <int FMT>
QT_GEMM_INLINE void units_rows(const Operands& o, int64_t lo, int64_t hi) {
  for (int64_t r = lo; r < hi; ++r)
    for (int64_t k = 0; k < o.K; k += 16) {
      const Lanes u = units16<FMT>(o.w + r * o.ldw, o.s + r * o.lds, k);
      std::memcpy(o.out + r * o.ldo + k, &u, sizeof u);
    }
}

void units_rows_entry(int fmt, const Operands& o, int64_t lo, int64_t hi) {
  switch (fmt) {
    case kNvfp4: units_rows<kNvfp4>(o, lo, hi); break;
    case kMxfp4: units_rows<kMxfp4>(o, lo, hi); break;
    default: units_rows<kMxfp8>(o, lo, hi); break;
  }
}
