// Linear layers and embedding lookups on GGUF-quantized weights, read from their blocks as the file stores
// them (conveyor.kernels.quant): a quantized model's weights stay the size of its file.
//
// Block formats (ggml's, as gguf-py's `quants.py` dequantizes them; every value below is computed with the
// same float32 operations in the same order, so a dequantized weight equals gguf-py's bit for bit):
//   Q4_0  32 values, 18 bytes: f16 d, 16 bytes of nibbles             w = d * (q - 8)
//   Q4_1  32 values, 20 bytes: f16 d, f16 m, 16 bytes of nibbles      w = d * q + m
//   Q5_0  32 values, 22 bytes: f16 d, u32 high bits, 16 bytes         w = d * (q - 16)
//   Q5_1  32 values, 24 bytes: f16 d, f16 m, u32 high bits, 16 bytes  w = d * q + m
//   Q8_0  32 values, 34 bytes: f16 d, 32 int8                         w = q * d
//   Q4_K 256 values, 144 bytes: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins for 8 groups of 32,
//        128 bytes of nibbles                                        w = (d * sc) * q - dmin * mn
//   Q5_K 256 values, 176 bytes: Q4_K's, plus 32 bytes of fifth bits
//   Q6_K 256 values, 210 bytes: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (one
//        per 16 values), f16 d                                       w = (d * sc) * (q - 32)
// Nibble q of value j < 16 of a 32-value block is the low half of byte j, of value j + 16 its high half.
// One format is conveyor's own, for weights quantized at load (`--quantization int8`):
//   INT8  a row of K values, 4 + K bytes: f32 d, K int8 (per-output-channel symmetric)   w = q * d
//
// Packed layout (`pack`): one uint8 tensor, so one weight is one tensor whatever its parts. It starts with
// int64 words {kMagic, in_features, out_features, num_segments}, then per segment {ggml type, rows, byte
// offset, bytes per row}, then the segments' blocks, each at a 64-byte aligned offset. A segment is a run of
// output rows in one format: a fused q/k/v layer of a Q4_K_M file holds Q4_K and Q6_K rows.
//
// `linear` computes y = x @ W^T + b two ways (chosen per row count by measurement, see
// conveyor.kernels.selection): `dot` dequantizes kRows weight rows at a time into a buffer that stays in L1
// and multiplies every row of x against them (a decode step reads each weight byte once, at its quantized
// size); `dequant` dequantizes the weight in chunks of rows (8 MiB of float32 each, in one reused scratch)
// and runs one float32 matmul per chunk (many rows: the matmul's blocking pays for the extra pass). Sums
// are float32; only their order differs from a BLAS. (`int8`, the third way, is described below.)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "simd.h"

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

// The op namespace; a test builds this file again for AVX2 and without vectors under other names.
#ifndef CONVEYOR_QUANT_NAMESPACE
#define CONVEYOR_QUANT_NAMESPACE conveyor_quant
#endif
#define CONVEYOR_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)

namespace {

using at::Tensor;

// ggml's type ids (gguf.GGMLQuantizationType), and kChannelInt8 (conveyor.kernels.quant.Int8Format.INT8).
enum Type : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kChannelInt8 = 1024
};

constexpr int64_t kMagic = 0x31766e6f63;  // "conv1" in little-endian ASCII: a weight made by `pack`
constexpr int64_t kHeaderWords = 4, kSegmentWords = 4, kAlign = 64;
constexpr int64_t kRows = 4;  // weight rows dequantized together by `dot`
constexpr int64_t kDequantChunkBytes = 8 << 20;  // float32 weight rows `dequant` holds at once

struct Format {
  int64_t values, bytes;  // per block
  int64_t prefix = 0;     // bytes before a row's blocks (INT8's scale)

  int64_t row_bytes(int64_t in_features) const { return prefix + in_features / values * bytes; }
};

Format format_of(int64_t type) {
  switch (type) {
    case kQ4_0: return {32, 18};
    case kQ4_1: return {32, 20};
    case kQ5_0: return {32, 22};
    case kQ5_1: return {32, 24};
    case kQ8_0: return {32, 34};
    case kQ4_K: return {256, 144};
    case kQ5_K: return {256, 176};
    case kQ6_K: return {256, 210};
    case kChannelInt8: return {32, 32, 4};
    default: TORCH_CHECK(false, "ggml type ", type, " is not a block format these kernels read");
  }
}

inline float f16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);  // exact, as the software conversion below
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

inline float f32(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}

inline uint32_t u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Q4_K / Q5_K: the 6-bit scale and min of group j < 8 (gguf-py's Q4_K.get_scale_min).
inline void scale_min_k4(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 15) | ((s[j - 4] >> 2) & 0x30);
    mn = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
  }
}

#if defined(__AVX2__)
// 32 values `scale * (q - pre) + post` from 32 uint8 q, as 4 x 8 float32 (the scalar formulas' operations,
// so the same bits).
inline void emit32(__m256i q, float scale, float pre, float post, float* out) {
  const __m256 s = _mm256_set1_ps(scale), a = _mm256_set1_ps(pre), b = _mm256_set1_ps(post);
  const __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
  for (int h = 0; h < 2; ++h) {
    for (int e = 0; e < 2; ++e) {
      const __m128i bytes = e ? _mm_srli_si128(halves[h], 8) : halves[h];
      const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
      _mm256_storeu_ps(out + h * 16 + e * 8, _mm256_add_ps(_mm256_mul_ps(s, _mm256_sub_ps(v, a)), b));
    }
  }
}

// 16 bytes of nibbles -> 32 uint8: the low halves (values 0-15), then the high halves (16-31).
inline __m256i nibbles16(const uint8_t* p) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(x, 4), mask), _mm_and_si128(x, mask));
}

// 32 bytes -> their nibbles at `shift` (0 or 4) as 32 uint8.
inline __m256i nibbles32(const uint8_t* p, int shift) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_and_si256(_mm256_srl_epi16(x, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(15));
}

// Bit i of `bits` as 16 in byte i, i < 32.
inline __m256i bit_fives(uint32_t bits) {
  // Byte i takes byte i / 8 of bits, then tests its bit i % 8.
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
  const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
  return _mm256_and_si256(set, _mm256_set1_epi8(16));
}
#endif

// One block's values into out (`format_of(type).values` floats).
inline void dequantize_block(int64_t type, const uint8_t* b, float* __restrict out) {
  switch (type) {
    case kQ4_0: {
      const float d = f16(b);
      const uint8_t* qs = b + 2;
#if defined(__AVX2__)
      emit32(nibbles16(qs), d, 8.0f, 0.0f, out);
#else
      for (int j = 0; j < 16; ++j) {
        out[j] = d * static_cast<float>((qs[j] & 15) - 8);
        out[j + 16] = d * static_cast<float>((qs[j] >> 4) - 8);
      }
#endif
      return;
    }
    case kQ4_1: {
      const float d = f16(b), m = f16(b + 2);
      const uint8_t* qs = b + 4;
#if defined(__AVX2__)
      emit32(nibbles16(qs), d, 0.0f, m, out);
#else
      for (int j = 0; j < 16; ++j) {
        out[j] = d * static_cast<float>(qs[j] & 15) + m;
        out[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
      }
#endif
      return;
    }
    case kQ5_0:
    case kQ5_1: {
      const bool q51 = type == kQ5_1;
      const float d = f16(b), m = q51 ? f16(b + 2) : 0.0f;
      const uint32_t qh = u32(b + (q51 ? 4 : 2));
      const uint8_t* qs = b + (q51 ? 8 : 6);
      const float pre = q51 ? 0.0f : 16.0f;
#if defined(__AVX2__)
      emit32(_mm256_or_si256(nibbles16(qs), bit_fives(qh)), d, pre, m, out);
#else
      for (int j = 0; j < 16; ++j) {
        const int lo = (qs[j] & 15) | static_cast<int>(((qh >> j) & 1u) << 4);
        const int hi = (qs[j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1u) << 4);
        out[j] = d * (static_cast<float>(lo) - pre) + m;
        out[j + 16] = d * (static_cast<float>(hi) - pre) + m;
      }
#endif
      return;
    }
    case kQ8_0: {
      const float d = f16(b);
      const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
#if defined(__AVX2__)
      const __m256 dv = _mm256_set1_ps(d);
      for (int j = 0; j < 32; j += 8) {
        const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + j));
        _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), dv));
      }
#else
      for (int j = 0; j < 32; ++j) out[j] = static_cast<float>(qs[j]) * d;
#endif
      return;
    }
    case kQ4_K:
    case kQ5_K: {
      const bool q5 = type == kQ5_K;
      const float d = f16(b), dmin = f16(b + 2);
      const uint8_t* scales = b + 4;
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + (q5 ? 48 : 16);
      for (int g = 0; g < 8; ++g) {
        int sc, mn;
        scale_min_k4(scales, g, sc, mn);
        const float dl = d * static_cast<float>(sc), ml = dmin * static_cast<float>(mn);
        const uint8_t* q = qs + (g / 2) * 32;
        const int shift = (g % 2) * 4;
        float* o = out + g * 32;
#if defined(__AVX2__)
        __m256i v = nibbles32(q, shift);
        if (q5) {
          const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
          const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(g)), _mm256_set1_epi8(1));
          v = _mm256_or_si256(v, _mm256_slli_epi16(bit, 4));
        }
        emit32(v, dl, 0.0f, -ml, o);
#else
        for (int l = 0; l < 32; ++l) {
          const int v = ((q[l] >> shift) & 15) | (q5 ? (((qh[l] >> g) & 1) << 4) : 0);
          o[l] = dl * static_cast<float>(v) - ml;
        }
#endif
      }
      return;
    }
    case kQ6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
      const float d = f16(b + 208);
      for (int half = 0; half < 2; ++half) {
        for (int chunk = 0; chunk < 4; ++chunk) {  // 32 values: low/high nibbles of ql's two 32-byte runs
          const uint8_t* low = ql + half * 64 + (chunk % 2) * 32;
          const int low_shift = (chunk / 2) * 4;
          const uint8_t* high = qh + half * 32;
          const int high_shift = chunk * 2;
          const int first = half * 128 + chunk * 32;
          const float d0 = d * static_cast<float>(scales[first / 16]);
          const float d1 = d * static_cast<float>(scales[first / 16 + 1]);  // one scale per 16 values
#if defined(__AVX2__)
          const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(high));
          const __m256i two = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(high_shift)), _mm256_set1_epi8(3));
          const __m256i v = _mm256_or_si256(nibbles32(low, low_shift), _mm256_slli_epi16(two, 4));
          alignas(32) float tmp[32];
          emit32(v, d0, 32.0f, 0.0f, tmp);
          std::memcpy(out + first, tmp, 16 * sizeof(float));
          emit32(v, d1, 32.0f, 0.0f, tmp);
          std::memcpy(out + first + 16, tmp + 16, 16 * sizeof(float));
#else
          for (int l = 0; l < 32; ++l) {
            const int v = ((low[l] >> low_shift) & 15) | (((high[l] >> high_shift) & 3) << 4);
            out[first + l] = (l < 16 ? d0 : d1) * static_cast<float>(v - 32);
          }
#endif
        }
      }
      return;
    }
    default: TORCH_CHECK(false, "ggml type ", type, " is not a block format these kernels read");
  }
}

// An INT8 row's K values `q * d` (the same float32 product as the reference).
inline void dequantize_int8(float d, const int8_t* q, int64_t K, float* __restrict out) {
  int64_t k = 0;
#if defined(__AVX2__)
  const __m256 dv = _mm256_set1_ps(d);
  for (; k + 8 <= K; k += 8) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k));
    _mm256_storeu_ps(out + k, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), dv));
  }
#endif
  for (; k < K; ++k) out[k] = static_cast<float>(q[k]) * d;
}

struct Segment {
  int64_t type, first_row, rows, row_bytes;
  const uint8_t* data;
  Format format;
};

// A packed weight's header, read once per call.
struct Layout {
  int64_t in_features = 0, out_features = 0;
  std::vector<Segment> segments;

  const uint8_t* row(int64_t n, const Segment*& seg) const {
    for (const Segment& s : segments) {
      if (n < s.first_row + s.rows) {
        seg = &s;
        return s.data + (n - s.first_row) * s.row_bytes;
      }
    }
    TORCH_CHECK(false, "row ", n, " is past the weight's ", out_features, " rows");
  }

  void dequantize_row(int64_t n, float* out) const {
    const Segment* seg = nullptr;
    const uint8_t* p = row(n, seg);
    if (seg->type == kChannelInt8) {
      dequantize_int8(f32(p), reinterpret_cast<const int8_t*>(p + 4), in_features, out);
      return;
    }
    const int64_t blocks = in_features / seg->format.values;
    for (int64_t i = 0; i < blocks; ++i) {
      dequantize_block(seg->type, p + i * seg->format.bytes, out + i * seg->format.values);
    }
  }
};

Layout read_layout(const Tensor& packed) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 1 && packed.is_contiguous() &&
                  packed.numel() >= kHeaderWords * 8,
              "the weight must be a packed quantized weight (conveyor_quant.pack)");
  const uint8_t* base = packed.data_ptr<uint8_t>();
  int64_t header[kHeaderWords];
  std::memcpy(header, base, sizeof(header));
  TORCH_CHECK(header[0] == kMagic, "the weight must be a packed quantized weight (conveyor_quant.pack)");
  Layout layout;
  layout.in_features = header[1];
  layout.out_features = header[2];
  int64_t first = 0;
  for (int64_t s = 0; s < header[3]; ++s) {
    int64_t w[kSegmentWords];
    std::memcpy(w, base + (kHeaderWords + s * kSegmentWords) * 8, sizeof(w));
    layout.segments.push_back({w[0], first, w[1], w[3], base + w[2], format_of(w[0])});
    first += w[1];
  }
  TORCH_CHECK(first == layout.out_features, "a packed weight's segments hold ", first, " rows, not ",
              layout.out_features);
  return layout;
}

// blocks[i]: `[rows_i, row_bytes_i]` uint8, the GGUF tensor's bytes, in ggml type types[i].
Tensor pack(const std::vector<int64_t>& types, const std::vector<Tensor>& blocks, int64_t in_features) {
  TORCH_CHECK(!types.empty() && types.size() == blocks.size(), "pack takes one type per block tensor");
  const int64_t segments = static_cast<int64_t>(types.size());
  auto align = [](int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; };
  int64_t offset = align((kHeaderWords + segments * kSegmentWords) * 8), rows = 0;
  std::vector<int64_t> words = {kMagic, in_features, 0, segments};
  for (int64_t s = 0; s < segments; ++s) {
    const Format f = format_of(types[s]);
    const Tensor& b = blocks[s];
    TORCH_CHECK(in_features % f.values == 0, "in_features ", in_features, " is not a whole number of ",
                f.values, "-value blocks");
    TORCH_CHECK(b.scalar_type() == at::kByte && b.dim() == 2 && b.size(1) == f.row_bytes(in_features),
                "blocks of type ", types[s], " must be [rows, ", f.row_bytes(in_features), "] uint8");
    words.insert(words.end(), {types[s], b.size(0), offset, b.size(1)});
    offset = align(offset + b.numel());
    rows += b.size(0);
  }
  words[2] = rows;
  Tensor packed = at::zeros({offset}, at::kByte);
  uint8_t* base = packed.data_ptr<uint8_t>();
  std::memcpy(base, words.data(), words.size() * 8);
  for (int64_t s = 0; s < segments; ++s) {
    const Tensor b = blocks[s].contiguous();
    std::memcpy(base + words[kHeaderWords + s * kSegmentWords + 2], b.data_ptr<uint8_t>(), b.numel());
  }
  return packed;
}

#if defined(CONVEYOR_SIMD_VECTOR)
using conveyor::simd::Simd;
using Vec = Simd::Vec;
#if defined(CONVEYOR_SIMD_AVX512)
constexpr int kTile = 4;  // rows of x per pass: 16 accumulators + 4 weight vectors + 1 of x
#else
constexpr int kTile = 2;  // 8 accumulators + 4 weight vectors + 1 of x of 16 ymm registers
#endif

// T rows of x `[T, K]` against kRows dequantized weight rows w `[kRows, K]`: out[t * ldo + r], r < rows.
template <int T>
void dot_tile(const float* x, int64_t K, const float* w, int64_t rows, const float* bias, float* out, int64_t ldo) {
  Vec acc[T][kRows];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < kRows; ++r) acc[t][r] = Simd::zero();
  for (int64_t k = 0; k < K; k += Simd::kLanes) {
    Vec wv[kRows];
    for (int r = 0; r < kRows; ++r) wv[r] = Simd::load(w + r * K + k);
    for (int t = 0; t < T; ++t) {
      const Vec xv = Simd::load(x + t * K + k);
      for (int r = 0; r < kRows; ++r) acc[t][r] = Simd::fmadd(xv, wv[r], acc[t][r]);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int64_t r = 0; r < rows; ++r) out[t * ldo + r] = Simd::reduce_add(acc[t][r]) + (bias ? bias[r] : 0.0f);
}
#else
constexpr int kTile = 2;

template <int T>
void dot_tile(const float* x, int64_t K, const float* w, int64_t rows, const float* bias, float* out, int64_t ldo) {
  for (int t = 0; t < T; ++t) {
    for (int64_t r = 0; r < rows; ++r) {
      float sum = 0.0f;
      for (int64_t k = 0; k < K; ++k) sum += x[t * K + k] * w[r * K + k];
      out[t * ldo + r] = sum + (bias ? bias[r] : 0.0f);
    }
  }
}
#endif

void dot_rows(const float* x, int64_t M, int64_t K, const float* w, int64_t rows, const float* bias, float* out,
              int64_t ldo) {
  int64_t m = 0;
  for (; m + kTile <= M; m += kTile) dot_tile<kTile>(x + m * K, K, w, rows, bias, out + m * ldo, ldo);
  for (; m < M; ++m) dot_tile<1>(x + m * K, K, w, rows, bias, out + m * ldo, ldo);
}

#if defined(__AVX2__) && defined(__FMA__)
#define CONVEYOR_QUANT_INT8 1
// ---- int8: x quantized per 32 values, integer dot products (llama.cpp's Q8_1 activations) ----
//
// Each 32 values of a row of x become int8 q = round(x / d) (to nearest even) with d = max|x| / 127, and
// s = d * sum(q); a weight group of 32 values becomes int8 values v with a float32 scale per 16 values
// (w = scale * v + min), so sum(w * x) over the group is scale * d * sum(v * q) + min * s. Formats whose
// stored values are unsigned (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K) keep v unsigned and fold a format's
// offset into min (Q4_0: w = d * q - 8 * d), so v * q is an unsigned-by-signed byte product as the
// instructions take it; signed v (Q6_K, Q8_0, INT8) multiplies as |v| * sign(q, v), both within int8. The
// products of 4 bytes sum into int32 by one AVX-512 VNNI `vpdpbusd` where the CPU has it, else by
// `maddubs` then `madd` (products below 2^15: no int16 saturation). Results differ from the float path by
// x's rounding to 8 bits (about 0.4 % per block).
constexpr int kInt8Tile = 4;  // rows of x per pass over a weight row

using conveyor::simd::max8;
using conveyor::simd::sum8;

// Per int32 lane j, the sum of the 4 byte products u[4j + i] * s[4j + i]: u unsigned, s signed.
inline __m256i dot4(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

struct QuantizedX {
  std::vector<int8_t> q;  // [M, K]
  std::vector<float> d, s;  // [M, K / 32]
  std::vector<float> s16;  // [M, K / 16]: d * sum(q) of each 16 values (Q6_K's groups of a scale)
};

void quantize_x(const float* x, int64_t M, int64_t K, QuantizedX& out) {
  const int64_t blocks = M * K / 32;
  out.q.resize(M * K);
  out.d.resize(blocks);
  out.s.resize(blocks);
  out.s16.resize(2 * blocks);
  at::parallel_for(0, blocks, 256, [&](int64_t begin, int64_t end) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = begin; b < end; ++b) {
      const float* xp = x + b * 32;
      __m256 v[4], amax = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(xp + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
      }
      const float max = max8(amax);
      const float d = max / 127.0f;
      const __m256 id = _mm256_set1_ps(max != 0.0f ? 127.0f / max : 0.0f);
      __m256i q[4];
      for (int i = 0; i < 4; ++i) {
        q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      }
      const __m256i halves[2] = {_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])};
      int32_t half_sums[2];
      for (int h = 0; h < 2; ++h) {
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(halves[h]), _mm256_extracti128_si256(halves[h], 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
        half_sums[h] = _mm_cvtsi128_si32(t);
      }
      // packs interleave the 128-bit lanes; the permutation puts the 32 values back in order.
      const __m256i packed = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
          _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q.data() + b * 32), packed);
      out.d[b] = d;
      out.s[b] = d * static_cast<float>(half_sums[0] + half_sums[1]);
      out.s16[2 * b] = d * static_cast<float>(half_sums[0]);
      out.s16[2 * b + 1] = d * static_cast<float>(half_sums[1]);
    }
  });
}

// Groups of 32 values per block: a K-quant's group g is sub g % 8 of block g / 8.
template <int64_t Type>
constexpr int kGroupsPerBlock = Type == kQ4_K || Type == kQ5_K || Type == kQ6_K ? 8 : 1;

// Q4_K / Q5_K / Q6_K: the unsigned values of group `sub` (32 values) of block `block` (their scales and
// offsets: group_scales).
template <int64_t Type>
inline __m256i group_values(const uint8_t* row, int64_t block, int sub) {
  if constexpr (Type == kQ6_K) {
    const uint8_t* b = row + block * 210;
    const int half = sub / 4, chunk = sub % 4;
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + half * 32));
    const __m256i two = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(chunk * 2)), _mm256_set1_epi8(3));
    const __m256i low = nibbles32(b + half * 64 + (chunk % 2) * 32, (chunk / 2) * 4);
    return _mm256_or_si256(low, _mm256_slli_epi16(two, 4));
  }
  constexpr int64_t bytes = Type == kQ5_K ? 176 : 144;
  const uint8_t* b = row + block * bytes;
  const __m256i v = nibbles32(b + (Type == kQ5_K ? 48 : 16) + (sub / 2) * 32, (sub % 2) * 4);
  if constexpr (Type == kQ5_K) {
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(sub)), _mm256_set1_epi8(1));
    return _mm256_or_si256(v, _mm256_slli_epi16(bit, 4));
  }
  return v;
}

// Group `block` of a weight row in a 32-value format (or INT8): v the int8 values (unsigned where
// kUnsigned), scale its float32 scale, min the value added to every weight (0 for symmetric formats).
template <int64_t Type>
inline void decode_group(const uint8_t* row, int64_t block, __m256i& v, __m256& scale, float& min) {
  min = 0.0f;
  if constexpr (Type == kChannelInt8) {
    v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 4 + block * 32));
    scale = _mm256_set1_ps(f32(row));
  } else {  // the 32-value block formats
    constexpr int64_t bytes = Type == kQ4_0 ? 18 : Type == kQ4_1 ? 20 : Type == kQ5_0 ? 22 : Type == kQ5_1 ? 24 : 34;
    const uint8_t* b = row + block * bytes;
    const float d = f16(b);
    if constexpr (Type == kQ4_0) {
      v = nibbles16(b + 2);
      min = -8.0f * d;
    } else if constexpr (Type == kQ4_1) {
      v = nibbles16(b + 4);
      min = f16(b + 2);
    } else if constexpr (Type == kQ5_0) {
      v = _mm256_or_si256(nibbles16(b + 6), bit_fives(u32(b + 2)));
      min = -16.0f * d;
    } else if constexpr (Type == kQ5_1) {
      v = _mm256_or_si256(nibbles16(b + 8), bit_fives(u32(b + 4)));
      min = f16(b + 2);
    } else {
      v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
    }
    scale = _mm256_set1_ps(d);
  }
}

// The K-quants: a scale (and an offset) per 32 values (Q4_K, Q5_K) or per 16 (Q6_K), inside 256-value
// blocks, decoded once per block by group_scales.
template <int64_t Type>
constexpr bool kScaledGroups = Type == kQ4_K || Type == kQ5_K || Type == kQ6_K;
template <int64_t Type>
constexpr int kScalesPerBlock = Type == kQ6_K ? 16 : 8;
template <int64_t Type>
constexpr bool kUnsigned = Type == kQ4_0 || Type == kQ4_1 || Type == kQ5_0 || Type == kQ5_1 || kScaledGroups<Type>;

// K-quant block `b`: the float32 scale and offset of each of its kScalesPerBlock runs of values, so
// w = scale * v + offset with v unsigned: Q4_K / Q5_K d * sc and -dmin * mn per 32 values, Q6_K d * sc
// and -32 * d * sc per 16.
template <int64_t Type>
inline void group_scales(const uint8_t* b, float* scales, float* offsets) {
  if constexpr (Type == kQ6_K) {
    const float d = f16(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int j = 0; j < 16; ++j) {
      scales[j] = d * static_cast<float>(sc[j]);
      offsets[j] = -32.0f * scales[j];
    }
  } else {
    const float d = f16(b), dmin = f16(b + 2);
    for (int j = 0; j < 8; ++j) {
      int sc, mn;
      scale_min_k4(b + 4, j, sc, mn);
      scales[j] = d * static_cast<float>(sc);
      offsets[j] = -(dmin * static_cast<float>(mn));
    }
  }
}

// R weight rows `rows[r]` against rows [m, m + T) of the quantized x: out[t * ldo + r]. Each group of a
// weight row is decoded once per T rows of x, each 32 values of x loaded once per R weight rows; the
// R * T accumulators are independent chains.
template <int64_t Type, int R, int T>
void int8_tile(const uint8_t* const* rows, const QuantizedX& xq, int64_t m, int64_t groups, const float* bias,
               float* out, int64_t ldo) {
  __m256 acc[R][T];
  float mins[R][T];
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < T; ++t) {
      acc[r][t] = _mm256_setzero_ps();
      mins[r][t] = 0.0f;
    }
  }
  __m256 block_mins[R][T];  // K-quants: the offset terms of 8 runs at once
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) block_mins[r][t] = _mm256_setzero_ps();
  constexpr int G = kGroupsPerBlock<Type>;
  for (int64_t block = 0; block < groups / G; ++block) {
    alignas(32) float group_scale[R][16], group_min[R][16];
    if constexpr (kScaledGroups<Type>) {
      // Each offset times the sum of its x values: s per 32 values, s16 per 16.
      constexpr int S = kScalesPerBlock<Type>;
      constexpr int64_t bytes = Type == kQ6_K ? 210 : Type == kQ5_K ? 176 : 144;
      for (int r = 0; r < R; ++r) group_scales<Type>(rows[r] + block * bytes, group_scale[r], group_min[r]);
      for (int t = 0; t < T; ++t) {
        const float* sums = (S == 16 ? xq.s16.data() : xq.s.data()) + ((m + t) * groups + block * G) * (S / 8);
        for (int i = 0; i < S; i += 8) {
          const __m256 s = _mm256_loadu_ps(sums + i);
          for (int r = 0; r < R; ++r)
            block_mins[r][t] = _mm256_fmadd_ps(_mm256_load_ps(group_min[r] + i), s, block_mins[r][t]);
        }
      }
    }
    for (int sub = 0; sub < G; ++sub) {
      const int64_t g = block * G + sub;
      __m256i v[R], u[R];  // u: the unsigned factor, v or |v| (then q takes v's sign)
      __m256 scale[R];
      float min[R];
      for (int r = 0; r < R; ++r) {
        if constexpr (kScaledGroups<Type>) {
          v[r] = group_values<Type>(rows[r], block, sub);
          // Q6_K: lanes 0-3 (values 0-15) and 4-7 (16-31) of dot4 take their own scale
          scale[r] = Type == kQ6_K ? _mm256_set_m128(_mm_set1_ps(group_scale[r][2 * sub + 1]),
                                                     _mm_set1_ps(group_scale[r][2 * sub]))
                                   : _mm256_set1_ps(group_scale[r][sub]);
        } else {
          decode_group<Type>(rows[r], block, v[r], scale[r], min[r]);
        }
        u[r] = kUnsigned<Type> ? v[r] : _mm256_sign_epi8(v[r], v[r]);
      }
      for (int t = 0; t < T; ++t) {
        const int64_t x_block = (m + t) * groups + g;
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + x_block * 32));
        const __m256 d = _mm256_set1_ps(xq.d[x_block]);
        for (int r = 0; r < R; ++r) {
          const __m256 sums = _mm256_cvtepi32_ps(dot4(u[r], kUnsigned<Type> ? q : _mm256_sign_epi8(q, v[r])));
          acc[r][t] = _mm256_fmadd_ps(sums, _mm256_mul_ps(scale[r], d), acc[r][t]);
          if constexpr (kUnsigned<Type> && !kScaledGroups<Type>) mins[r][t] += min[r] * xq.s[x_block];
        }
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    for (int r = 0; r < R; ++r) {
      out[t * ldo + r] = sum8(acc[r][t]) + sum8(block_mins[r][t]) + mins[r][t] + (bias ? bias[r] : 0.0f);
    }
  }
}

// Decode steps (x with fewer rows than kInt8Tile) take four short weight rows per pass (4 KiB together at
// most), sharing each load of x, the next four prefetched: four interleaved short rows within a page
// defeat the hardware prefetcher (a 49152 x 576 Q8_0 LM head ran at 0.65x of one row at a time without
// the prefetch). Longer rows stream best one at a time: with unsigned 4-bit values and VNNI a 128256 x 2048
// Q4_0 LM head ran at 2x four rows at once, and 1.5x in the AVX2 build on the same AVX-512 EPYC.
inline bool four_rows(int64_t row_bytes) { return 4 * row_bytes <= 4096; }

// Output columns [n0, n0 + count) of one segment (format Type, weight rows at `data`): every row of x.
// Four weight rows at a time against one row of x (decode, see four_rows), else one weight row against
// kInt8Tile rows of x.
template <int64_t Type>
void int8_columns(const uint8_t* data, int64_t row_bytes, int64_t n0, int64_t count, const QuantizedX& xq, int64_t M,
                  int64_t groups, const float* bias, float* out, int64_t N) {
  for (int64_t c = 0; c < count;) {
    const int64_t n = n0 + c;
    const float* bn = bias ? bias + n : nullptr;
    if (M < kInt8Tile && c + 4 <= count && four_rows(row_bytes)) {
      const uint8_t* next = data + (c + 4) * row_bytes;
      const int64_t ahead = std::min<int64_t>(4, count - c - 4) * row_bytes;
      for (int64_t i = 0; i < ahead; i += 64) _mm_prefetch(reinterpret_cast<const char*>(next + i), _MM_HINT_T0);
      const uint8_t* rows[4] = {data + c * row_bytes, data + (c + 1) * row_bytes, data + (c + 2) * row_bytes,
                                data + (c + 3) * row_bytes};
      for (int64_t m = 0; m < M; ++m) int8_tile<Type, 4, 1>(rows, xq, m, groups, bn, out + m * N + n, N);
      c += 4;
    } else {
      const uint8_t* rows[1] = {data + c * row_bytes};
      int64_t m = 0;
      for (; m + kInt8Tile <= M; m += kInt8Tile) int8_tile<Type, 1, kInt8Tile>(rows, xq, m, groups, bn, out + m * N + n, N);
      for (; m < M; ++m) int8_tile<Type, 1, 1>(rows, xq, m, groups, bn, out + m * N + n, N);
      c += 1;
    }
  }
}

void int8_segment(const Segment& seg, const QuantizedX& xq, int64_t M, int64_t K, const float* bias, float* out,
                  int64_t N) {
  const int64_t groups = K / 32;
  // Chunks of 16 output rows (a multiple of 4) over the threads.
  at::parallel_for(0, (seg.rows + 15) / 16, 1, [&](int64_t begin, int64_t end) {
    const int64_t c0 = begin * 16, count = std::min(end * 16, seg.rows) - c0;
    const uint8_t* data = seg.data + c0 * seg.row_bytes;
    const int64_t n0 = seg.first_row + c0;
    switch (seg.type) {
      case kQ4_0: return int8_columns<kQ4_0>(data, seg.row_bytes, n0, count, xq, M, groups, bias, out, N);
      case kQ4_1: return int8_columns<kQ4_1>(data, seg.row_bytes, n0, count, xq, M, groups, bias, out, N);
      case kQ5_0: return int8_columns<kQ5_0>(data, seg.row_bytes, n0, count, xq, M, groups, bias, out, N);
      case kQ5_1: return int8_columns<kQ5_1>(data, seg.row_bytes, n0, count, xq, M, groups, bias, out, N);
      case kQ8_0: return int8_columns<kQ8_0>(data, seg.row_bytes, n0, count, xq, M, groups, bias, out, N);
      case kQ4_K: return int8_columns<kQ4_K>(data, seg.row_bytes, n0, count, xq, M, groups, bias, out, N);
      case kQ5_K: return int8_columns<kQ5_K>(data, seg.row_bytes, n0, count, xq, M, groups, bias, out, N);
      case kQ6_K: return int8_columns<kQ6_K>(data, seg.row_bytes, n0, count, xq, M, groups, bias, out, N);
      case kChannelInt8:
        return int8_columns<kChannelInt8>(data, seg.row_bytes, n0, count, xq, M, groups, bias, out, N);
      default: TORCH_CHECK(false, "ggml type ", seg.type, " is not a block format these kernels read");
    }
  });
}
#endif

enum Method : int64_t { kDot = 0, kDequant = 1, kInt8 = 2 };

// Rows [first, first + rows) of the weight as float32, into out `[rows, in_features]`.
void dequantize_rows(const Layout& layout, int64_t first, int64_t rows, float* out) {
  const int64_t K = layout.in_features;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) layout.dequantize_row(first + n, out + n * K);
  });
}

// x `[M, in_features]` float32 or bfloat16 -> `[M, out_features]` in x's dtype.
Tensor linear(const Tensor& x, const Tensor& packed, const c10::optional<Tensor>& bias, int64_t method) {
  const Layout layout = read_layout(packed);
  const int64_t K = layout.in_features, N = layout.out_features;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be [num_tokens, ", K, "] float32 or bfloat16");
  Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.dim() == 1 && b.size(0) == N, "bias must be [", N, "]");
  }
  const Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0);
  Tensor out;
  if (method == kDequant) {
    // The weight in chunks of rows of at most kDequantChunkBytes float32 each (a 49152-row LM head would
    // be 113 MB whole), each dequantized into one scratch per calling thread (the engine's step thread),
    // reused across calls and layers, then one float32 matmul per chunk.
    thread_local Tensor scratch_w;
    Tensor& scratch = scratch_w;
    const int64_t chunk = std::min(N, std::max<int64_t>(16, kDequantChunkBytes / (4 * K)));
    if (!scratch.defined() || scratch.numel() < chunk * K) scratch = at::empty({chunk * K}, at::kFloat);
    out = chunk == N ? Tensor() : at::empty({M, N}, at::kFloat);
    for (int64_t n0 = 0; n0 < N; n0 += chunk) {
      const int64_t rows = std::min(chunk, N - n0);
      dequantize_rows(layout, n0, rows, scratch.data_ptr<float>());
      const Tensor w = scratch.narrow(0, 0, rows * K).view({rows, K});
      const c10::optional<Tensor> bias_rows = b.defined() ? c10::optional<Tensor>(b.narrow(0, n0, rows)) : c10::nullopt;
      if (chunk == N) {
        out = at::linear(xf, w, bias_rows);
      } else {
        out.narrow(1, n0, rows).copy_(at::linear(xf, w, bias_rows));
      }
    }
  } else if (method == kInt8) {
#if defined(CONVEYOR_QUANT_INT8)
    // Reused by the thread that calls; the workers below read it through this reference (a lambda
    // naming a thread_local would reach each worker's own, empty one).
    thread_local QuantizedX scratch_x;
    QuantizedX& xq = scratch_x;
    quantize_x(xf.data_ptr<float>(), M, K, xq);
    out = at::empty({M, N}, at::kFloat);
    const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
    float* op = out.data_ptr<float>();
    for (const Segment& seg : layout.segments) int8_segment(seg, xq, M, K, bp, op, N);
#else
    TORCH_CHECK(false, "the int8 method needs AVX2 (this build is ", conveyor::simd::kIsa, ")");
#endif
  } else {
    TORCH_CHECK(method == kDot, "method must be 0 (dot), 1 (dequant) or 2 (int8)");
    out = at::empty({M, N}, at::kFloat);
    const float* xp = xf.data_ptr<float>();
    const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
    float* op = out.data_ptr<float>();
    const int64_t groups = (N + kRows - 1) / kRows;
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> w(kRows * K, 0.0f);
      for (int64_t g = begin; g < end; ++g) {
        const int64_t n0 = g * kRows, rows = std::min(kRows, N - n0);
        for (int64_t r = 0; r < rows; ++r) layout.dequantize_row(n0 + r, w.data() + r * K);
        dot_rows(xp, M, K, w.data(), rows, bp ? bp + n0 : nullptr, op + n0, N);
      }
    });
  }
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

// Rows `ids` `[num_tokens]` int64 of the weight (an embedding table) as float32 `[num_tokens, in_features]`.
Tensor embedding(const Tensor& packed, const Tensor& ids) {
  const Layout layout = read_layout(packed);
  const Tensor idx = ids.to(at::kLong).contiguous();
  const int64_t T = idx.numel(), K = layout.in_features;
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(ip[t] >= 0 && ip[t] < layout.out_features, "token id ", ip[t], " is outside the table's ",
                layout.out_features, " rows");
  }
  Tensor out = at::empty({T, K}, at::kFloat);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) layout.dequantize_row(ip[t], op + t * K);
  });
  return out;
}

Tensor dequantize(const Tensor& packed) {
  const Layout layout = read_layout(packed);
  Tensor out = at::empty({layout.out_features, layout.in_features}, at::kFloat);
  dequantize_rows(layout, 0, layout.out_features, out.data_ptr<float>());
  return out;
}

std::string isa() { return conveyor::simd::kIsa; }

#if defined(CONVEYOR_QUANT_INT8)
constexpr bool kHasInt8 = true;
#else
constexpr bool kHasInt8 = false;
#endif
bool int8_dot() { return kHasInt8; }

}  // namespace

CONVEYOR_LIBRARY(CONVEYOR_QUANT_NAMESPACE, m) {
  m.def("pack(int[] types, Tensor[] blocks, int in_features) -> Tensor", &pack);
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int method) -> Tensor", &linear);
  m.def("embedding(Tensor packed, Tensor ids) -> Tensor", &embedding);
  m.def("dequantize(Tensor packed) -> Tensor", &dequantize);
  m.def("isa() -> str", &isa);
  m.def("int8_dot() -> bool", &int8_dot);
}
