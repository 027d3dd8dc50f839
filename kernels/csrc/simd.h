// The vector helpers of the C++ CPU kernels (cpu_kernels.cpp, linear.cpp), written once: which instruction
// set a build uses, float32 vectors of that width with the operations the kernels need, bfloat16 <->
// float32 conversions, exp, and cache prefetches.
//
// The instruction set follows the compiler flags (`-march=native` for the server, `-mavx2 -mfma` or
// `-mno-avx` for the tests' other builds): CONVEYOR_SIMD_AVX512 with AVX-512 (16 float32 lanes),
// CONVEYOR_SIMD_AVX2 with AVX2 and FMA (8 lanes), neither for plain C++ loops; CONVEYOR_SIMD_VECTOR with
// either. Every helper is one fixed sequence of instructions, so a kernel's results depend only on the
// order in which it calls them.

#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define CONVEYOR_SIMD_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define CONVEYOR_SIMD_AVX2 1
#endif
#if defined(CONVEYOR_SIMD_AVX512) || defined(CONVEYOR_SIMD_AVX2)
#define CONVEYOR_SIMD_VECTOR 1
#endif

namespace conveyor::simd {

// The build's vector instruction set, as `conveyor_linear.isa()` reports it.
#if defined(CONVEYOR_SIMD_AVX512)
inline constexpr const char* kIsa = "avx512";
#elif defined(CONVEYOR_SIMD_AVX2)
inline constexpr const char* kIsa = "avx2";
#else
inline constexpr const char* kIsa = "scalar";
#endif

// Element types Simd::load widens to float32 vectors (float16 takes the kernels' scalar loops).
template <typename T>
inline constexpr bool kVectorType = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;

// The bits of the bfloat16 nearest to value, ties to even, as torch's float -> bfloat16 conversion for
// every value but NaN (whose payload may round to infinity; torch returns its canonical NaN).
inline uint16_t bf16_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

// The float32 value of bfloat16 bits (exact).
inline float bf16_value(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof value);
  return value;
}

#if defined(__AVX2__)
// The sum and the maximum of 8 float32 lanes (the AVX2 Simd's reductions; quant.cpp's int8 path uses
// 256-bit vectors in every build).
inline float sum8(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
#endif

#if defined(CONVEYOR_SIMD_VECTOR)
// The vector width the kernels are written against: one source for AVX-512 and AVX2.
#if defined(CONVEYOR_SIMD_AVX512)
struct Simd {
  using Vec = __m512;
  using Words = __m512i;  // kLanes 32-bit words
  static constexpr int kLanes = 16;
  static constexpr int64_t kHeadsPerPass = 3;  // query heads whose V sums stay in the 32 registers at once
  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec set1(float x) { return _mm512_set1_ps(x); }
  static Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
  static Vec div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
  static Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
  static Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
  static Vec min(Vec a, Vec b) { return _mm512_min_ps(a, b); }
  static Vec round(Vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static Vec ldexp(Vec p, Vec n) { return _mm512_scalef_ps(p, n); }  // p * 2^n, n integral
  static float reduce_add(Vec v) { return _mm512_reduce_add_ps(v); }
  static float reduce_max(Vec v) { return _mm512_reduce_max_ps(v); }
  static Words load_words(const void* p) { return _mm512_loadu_si512(p); }
  // bfloat16 bits in the low / high half of each word, as float32.
  static Vec bf16_low(Words w) { return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)); }
  static Vec bf16_high(Words w) {
    return _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
  }
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static Vec load(const c10::BFloat16* p) {
    return bf16_low(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
  }
  static void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
  // x rounded to the nearest bfloat16 (ties to even; NaN stays NaN), as c10::BFloat16's conversion does,
  // still held as float32: one `vcvtneps2bf16` where the CPU has AVX512_BF16.
  static Vec round_bf16(Vec x) {
#if defined(__AVX512BF16__)
    return bf16_low(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)));
#else
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded =
        _mm512_and_si512(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))),
                         _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_castsi512_ps(_mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC00000)));
#endif
  }
  static void store(c10::BFloat16* p, Vec v) {
#if defined(__AVX512BF16__)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
#else
    const __m512i top = _mm512_srli_epi32(_mm512_castps_si512(round_bf16(v)), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(top));
#endif
  }
  // out lane i = the sum of the lanes of v[i], i < 16: sixteen dot products finished at once in 45
  // shuffles and adds instead of sixteen horizontal reductions.
  static Vec reduce(const Vec* v) {
    __m512 pairs[8];  // per 128-bit lane: (v[2i] even, v[2i+1] even, v[2i] odd, v[2i+1] odd) partials
    for (int i = 0; i < 8; ++i) {
      pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                               _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    }
    __m512 quads[4];  // per 128-bit lane: partials of v[4i .. 4i+3]
    for (int i = 0; i < 4; ++i) {
      quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    }
    // Sum the four 128-bit lanes: lanes (0+1, 2+3) of two vectors, then those halves.
    const __m512 z01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 z23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z01, z23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(z01, z23, _MM_SHUFFLE(3, 1, 3, 1)));
  }
};
#else
struct Simd {
  using Vec = __m256;
  using Words = __m256i;  // kLanes 32-bit words
  static constexpr int kLanes = 8;
  static constexpr int64_t kHeadsPerPass = 1;  // 16 registers: one head's V sums at a time
  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec set1(float x) { return _mm256_set1_ps(x); }
  static Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
  static Vec div(Vec a, Vec b) { return _mm256_div_ps(a, b); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
  static Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
  static Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
  static Vec min(Vec a, Vec b) { return _mm256_min_ps(a, b); }
  static Vec round(Vec x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static Vec ldexp(Vec p, Vec n) {  // p * 2^n, n integral in [-126, 127]: n + 127 in the exponent bits
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  }
  static float reduce_add(Vec v) { return sum8(v); }
  static float reduce_max(Vec v) { return max8(v); }
  static Words load_words(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  // bfloat16 bits in the low / high half of each word, as float32.
  static Vec bf16_low(Words w) { return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)); }
  static Vec bf16_high(Words w) {
    return _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
  }
  static Vec load(const float* p) { return _mm256_loadu_ps(p); }
  static Vec load(const c10::BFloat16* p) {
    return bf16_low(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
  // x rounded to the nearest bfloat16 (ties to even; NaN stays NaN), still held as float32.
  static Vec round_bf16(Vec x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded =
        _mm256_and_si256(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))),
                         _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    return _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan);
  }
  static void store(c10::BFloat16* p, Vec v) {
    const __m256i top = _mm256_srli_epi32(_mm256_castps_si256(round_bf16(v)), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(top, top), 0x08);  // qwords 0, 2
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  // out lane i = the sum of the lanes of v[i], i < 8.
  static Vec reduce(const Vec* v) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  }
};
#endif

// exp(x) lane by lane: 2^(x log2 e) split into 2^n * 2^f with f in [-0.5, 0.5], 2^f by its degree-6
// Taylor polynomial (relative error < 2e-7); x is clamped to [-87, 88], where float32 exp is finite
// (and n stays in [-126, 127]).
inline Simd::Vec exp_ps(Simd::Vec x) {
  x = Simd::min(Simd::max(x, Simd::set1(-87.0f)), Simd::set1(88.0f));
  const Simd::Vec t = Simd::mul(x, Simd::set1(1.44269504088896341f));
  const Simd::Vec n = Simd::round(t);
  const Simd::Vec f = Simd::sub(t, n);
  Simd::Vec p = Simd::set1(1.535336188319500e-4f);
  for (const float c : {1.339887440266574e-3f, 9.618437357674640e-3f, 5.550332471162809e-2f,
                        2.402264791363012e-1f, 6.931472028550421e-1f, 1.0f}) {
    p = Simd::fmadd(p, f, Simd::set1(c));
  }
  return Simd::ldexp(p, n);
}

// 2^t lane by lane for t <= 0 (softmax terms already shifted by their maximum): 2^n * 2^f with f in
// [-0.5, 0.5], 2^f by its degree-5 Taylor polynomial (relative error < 3e-7); t below -126 gives
// 2^-126, which a caller masking its -inf lanes replaces by 0.
inline Simd::Vec exp2_ps(Simd::Vec t) {
  t = Simd::max(t, Simd::set1(-126.0f));
  const Simd::Vec n = Simd::round(t);
  const Simd::Vec f = Simd::sub(t, n);
  Simd::Vec p = Simd::set1(1.3333558146428443e-3f);
  for (const float c : {9.618129107628477e-3f, 5.550410866482158e-2f, 2.402265069591007e-1f,
                        6.931471805599453e-1f, 1.0f}) {
    p = Simd::fmadd(p, f, Simd::set1(c));
  }
  return Simd::ldexp(p, n);
}
#endif  // CONVEYOR_SIMD_VECTOR

// Fetches num_elements from p into cache ahead of their use: into L1 by default (prefetcht0), into L2
// with Locality 2 (prefetcht1).
template <int Locality = 3, typename T>
inline void prefetch(const T* p, int64_t num_elements) {
  const char* bytes = reinterpret_cast<const char*>(p);
  const int64_t size = num_elements * static_cast<int64_t>(sizeof(T));
  for (int64_t off = 0; off < size; off += 64) {
    __builtin_prefetch(bytes + off, 0, Locality);
  }
}

}  // namespace conveyor::simd
