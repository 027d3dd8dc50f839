// Linear layers for CPUs, y = x @ W^T + b, with the weight laid out once in panels
// (conveyor.kernels.cpu.CPULinear): the CPU path's matmuls, with oneDNN's packed layers as the fallback.
//
// Why: a decode step multiplies a few rows by every weight, where BLAS libraries tuned for large matrices
// reach a fraction of the machine (oneDNN's packed float32 ran the embedded model's layers at 99 GFLOP/s
// with 16 rows on a 2-core AVX-512 Xeon whose matmul peak is about 290; its packed bfloat16 ran them at
// about 300 GFLOP/s with 16 rows on a 2-core AVX512_BF16 EPYC, where the kernel below runs 410). Here
// every row of the step goes through register tiles against a panel of columns streamed once from memory.
//
// float32 x: weights are float32, or bfloat16 when bfloat16 holds every value exactly (a checkpoint saved
// in bfloat16, loaded as float32): then the same values cost half the bytes, and widening bfloat16 to
// float32 is a 16-bit shift. Products and sums are float32 either way; only the order of the sums
// differs from a BLAS, as between any two BLAS libraries. bfloat16 x (a model held in bfloat16): see
// pack_weight_bf16 below.
//
// Packed layout, made once by pack_weight: `[num_panels, K, BN]`, one panel per BN output columns (the
// last one padded with zeros), so a panel streams from memory in one pass. float32 panels hold row k as
// BN columns in order. bfloat16 panels interleave: 32-bit word j of row k holds column j in its low half
// and column j + BN/2 in its high half, so `word << 16` gives columns 0..BN/2-1 as float32 and
// `word & 0xffff0000` columns BN/2..BN-1. BN is 32 with AVX-512, 16 otherwise (AVX2, or the scalar
// loop), so the library that packs is the one that multiplies; `packed.size(2)` is its BN.
//
// Rows of x go through register tiles of up to kTileRows rows (a decode step's rows in one or two
// tiles); the threads split the panels, and each panel is read from memory once per block of kBlockRows
// rows, then from cache by the block's other tiles.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "simd.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

// The op namespace; a test builds this file a second time for AVX2 under another name.
#ifndef CONVEYOR_LINEAR_NAMESPACE
#define CONVEYOR_LINEAR_NAMESPACE conveyor_linear
#endif
#define CONVEYOR_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)

namespace {

using at::Tensor;
using conveyor::simd::bf16_bits;
using conveyor::simd::bf16_value;
using conveyor::simd::prefetch;

#if defined(CONVEYOR_SIMD_AVX512)
constexpr int64_t kPanel = 32;
constexpr int kTileRows = 12;  // 24 accumulators + 2 weight vectors + 1 broadcast of 32 zmm registers
#elif defined(CONVEYOR_SIMD_AVX2)
constexpr int64_t kPanel = 16;
constexpr int kTileRows = 6;  // 12 accumulators + 2 weight vectors + 1 broadcast of 16 ymm registers
#else
constexpr int64_t kPanel = 16;
constexpr int kTileRows = 8;
#endif
constexpr int64_t kHalf = kPanel / 2;
constexpr int64_t kBlockRows = 256;  // rows of x per pass over the weight (they stay in cache)

#if defined(CONVEYOR_SIMD_VECTOR)
using conveyor::simd::Simd;
using Vec = Simd::Vec;
static_assert(kHalf == Simd::kLanes, "a panel row is two vectors");

// Row k of a panel as float32 columns [0, BN/2) and [BN/2, BN).
inline void load_row(const float* row, Vec& lo, Vec& hi) {
  lo = Simd::load(row);
  hi = Simd::load(row + kHalf);
}
inline void load_row(const uint16_t* row, Vec& lo, Vec& hi) {
  const Simd::Words words = Simd::load_words(row);
  lo = Simd::bf16_low(words);
  hi = Simd::bf16_high(words);
}
#endif

inline float weight_value(const float* row, int64_t j) { return row[j]; }
inline float weight_value(const uint16_t* row, int64_t j) {
  return bf16_value(row[j < kHalf ? 2 * j : 2 * (j - kHalf) + 1]);
}

// One tile: rows [0, ROWS) of x against one panel; writes `cols` (<= kPanel) columns of out. With
// `next`, the panel the thread takes next is prefetched into cache meanwhile, so that the memory
// stream overlaps this tile's arithmetic instead of stalling the next one.
template <int ROWS, typename W>
void tile(const float* x, int64_t ldx, const W* panel, int64_t K, const float* bias, float* out, int64_t ldo,
          int64_t cols, const W* next) {
#if defined(CONVEYOR_SIMD_VECTOR)
  Vec lo[ROWS], hi[ROWS];
  for (int r = 0; r < ROWS; ++r) {
    lo[r] = hi[r] = Simd::zero();
  }
  for (int64_t k = 0; k < K; ++k) {
    if (next != nullptr) {
      prefetch<2>(next + k * kPanel, kPanel);
    }
    Vec w_lo, w_hi;
    load_row(panel + k * kPanel, w_lo, w_hi);
    for (int r = 0; r < ROWS; ++r) {
      // set1 of a loaded value, not a broadcast from the pointer (_mm256_broadcast_ss): GCC treats that
      // read as possibly aliasing the accumulators (vector types may alias anything) and stored all 12 to
      // the stack on every k, which halved the AVX2 tile (86 -> 200 GFLOP/s at 16 rows on 2 Zen 4 cores).
      const Vec xv = Simd::set1(x[r * ldx + k]);
      lo[r] = Simd::fmadd(xv, w_lo, lo[r]);
      hi[r] = Simd::fmadd(xv, w_hi, hi[r]);
    }
  }
  alignas(64) float acc[kPanel];
  for (int r = 0; r < ROWS; ++r) {
    Simd::store(acc, lo[r]);
    Simd::store(acc + kHalf, hi[r]);
    for (int64_t c = 0; c < cols; ++c) {
      out[r * ldo + c] = acc[c] + (bias ? bias[c] : 0.0f);
    }
  }
#else
  (void)next;
  float acc[ROWS][kPanel] = {};
  for (int64_t k = 0; k < K; ++k) {
    const W* row = panel + k * kPanel;
    for (int64_t j = 0; j < kPanel; ++j) {
      const float w = weight_value(row, j);
      for (int r = 0; r < ROWS; ++r) {
        acc[r][j] += x[r * ldx + k] * w;
      }
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      out[r * ldo + c] = acc[r][c] + (bias ? bias[c] : 0.0f);
    }
  }
#endif
}

template <typename W>
using TileFn = void (*)(const float*, int64_t, const W*, int64_t, const float*, float*, int64_t, int64_t,
                        const W*);

template <typename W, int... R>
constexpr std::array<TileFn<W>, sizeof...(R)> make_tiles(std::integer_sequence<int, R...>) {
  return {&tile<R + 1, W>...};
}

// `[N, K]` float32 -> `[num_panels, K, kPanel]` float32, or bfloat16 bits in the interleaved layout.
Tensor pack_weight(const Tensor& weight, bool bf16) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "weight must be [out_features, in_features] float32, got ", weight.scalar_type(), " ",
              weight.sizes());
  const Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t panels = (N + kPanel - 1) / kPanel;
  Tensor packed = at::zeros({panels, K, kPanel}, w.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const float* src = w.data_ptr<float>();
  float* dst_f = bf16 ? nullptr : packed.data_ptr<float>();
  uint16_t* dst_b = bf16 ? reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>()) : nullptr;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t j = 0; j < kPanel && p * kPanel + j < N; ++j) {
        const int64_t n = p * kPanel + j;
        const int64_t slot = j < kHalf ? 2 * j : 2 * (j - kHalf) + 1;
        for (int64_t k = 0; k < K; ++k) {
          if (bf16) {
            dst_b[(p * K + k) * kPanel + slot] = bf16_bits(src[n * K + k]);
          } else {
            dst_f[(p * K + k) * kPanel + j] = src[n * K + k];
          }
        }
      }
    }
  });
  return packed;
}

// --- bfloat16 activations (a model held in bfloat16) ------------------------------------------------
//
// Packed layout, made once by pack_weight_bf16: `[num_panels, ceil(K/2), BN, 2]` bfloat16, one panel per
// BN output columns (the last one padded with zeros): entry [p, i, j] holds column p * BN + j at rows
// k = 2i and 2i + 1 (a zero for an odd K's missing row). With AVX512_BF16 one `vdpbf16ps` multiplies a
// pair of x's values (broadcast as one 32-bit word) by that pair of 16 columns and adds both products to
// 16 float32 sums: twice the multiplies of a float32 FMA per instruction, on half the bytes. Sums are
// float32; each output is rounded to bfloat16 once, as oneDNN's bfloat16 matmul does.
//
// Builds without AVX512_BF16 run the same layout through a plain loop (correct, not fast; the model
// loader sends bfloat16 matmuls to oneDNN there, see bf16_dot()).

#if defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;
#else
constexpr bool kBf16Dot = false;
#endif

inline uint32_t x_pair(const uint16_t* row, int64_t i, int64_t K) {
  // x's values at k = 2i, 2i + 1 as one 32-bit word (the first in the low half; zero past K).
  const uint32_t low = row[2 * i];
  const uint32_t high = 2 * i + 1 < K ? row[2 * i + 1] : 0;
  return low | (high << 16);
}

template <int ROWS>
void tile_bf16(const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t K, const float* bias,
               uint16_t* out, int64_t ldo, int64_t cols, const uint16_t* next) {
  const int64_t pairs = (K + 1) / 2;
  float acc[ROWS][kPanel];
#if defined(__AVX512BF16__)
  Vec lo[ROWS], hi[ROWS];
  for (int r = 0; r < ROWS; ++r) {
    lo[r] = hi[r] = Simd::zero();
  }
  // One pair of rows k = 2i, 2i + 1 of the panel against each row's x pair (one 32-bit word).
  const auto step = [&](int64_t i, const uint16_t* words, int64_t stride) {
    if (next != nullptr) {
      prefetch<2>(next + i * 2 * kPanel, 2 * kPanel);
    }
    const __m512bh w_lo = (__m512bh)_mm512_loadu_si512(panel + i * 2 * kPanel);
    const __m512bh w_hi = (__m512bh)_mm512_loadu_si512(panel + i * 2 * kPanel + kPanel);
    for (int r = 0; r < ROWS; ++r) {
      int32_t word;
      std::memcpy(&word, words + r * stride, sizeof word);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(word);
      lo[r] = _mm512_dpbf16_ps(lo[r], xv, w_lo);
      hi[r] = _mm512_dpbf16_ps(hi[r], xv, w_hi);
    }
  };
  for (int64_t i = 0; i < K / 2; ++i) {
    step(i, x + 2 * i, ldx);
  }
  if (K % 2 == 1) {  // the last pair: x's last value and a zero
    uint16_t words[2 * ROWS];
    for (int r = 0; r < ROWS; ++r) {
      words[2 * r] = x[r * ldx + K - 1];
      words[2 * r + 1] = 0;
    }
    step(K / 2, words, 2);
  }
  for (int r = 0; r < ROWS; ++r) {
    Simd::store(acc[r], lo[r]);
    Simd::store(acc[r] + kHalf, hi[r]);
  }
#else
  (void)next;
  for (int r = 0; r < ROWS; ++r) {
    std::fill(acc[r], acc[r] + kPanel, 0.0f);
  }
  for (int64_t i = 0; i < pairs; ++i) {
    const uint16_t* row = panel + i * 2 * kPanel;
    for (int r = 0; r < ROWS; ++r) {
      const uint32_t word = x_pair(x + r * ldx, i, K);
      const float x0 = bf16_value(static_cast<uint16_t>(word)), x1 = bf16_value(static_cast<uint16_t>(word >> 16));
      for (int64_t j = 0; j < kPanel; ++j) {
        acc[r][j] += x0 * bf16_value(row[2 * j]) + x1 * bf16_value(row[2 * j + 1]);
      }
    }
  }
#endif
  for (int r = 0; r < ROWS; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      out[r * ldo + c] = bf16_bits(acc[r][c] + (bias ? bias[c] : 0.0f));
    }
  }
}

using TileBf16Fn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, const float*, uint16_t*,
                            int64_t, int64_t, const uint16_t*);

template <int... R>
constexpr std::array<TileBf16Fn, sizeof...(R)> make_tiles_bf16(std::integer_sequence<int, R...>) {
  return {&tile_bf16<R + 1>...};
}

// `[N, K]` bfloat16 -> `[num_panels, ceil(K/2), kPanel, 2]` bfloat16 (the layout above).
Tensor pack_weight_bf16(const Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "weight must be [out_features, in_features] bfloat16, got ", weight.scalar_type(), " ",
              weight.sizes());
  const Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t panels = (N + kPanel - 1) / kPanel, pairs = (K + 1) / 2;
  Tensor packed = at::zeros({panels, pairs, kPanel, 2}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t j = 0; j < kPanel && p * kPanel + j < N; ++j) {
        for (int64_t k = 0; k < K; ++k) {
          dst[((p * pairs + k / 2) * kPanel + j) * 2 + k % 2] = src[(p * kPanel + j) * K + k];
        }
      }
    }
  });
  return packed;
}

// Every row of x against every panel: rows in blocks of kBlockRows, each block in tiles of near-equal
// height (16 rows run as 8 + 8, not 12 + 4), the threads splitting the panels. `tiles[r - 1]` runs a
// tile of r rows; a panel is `panel_size` weight elements.
template <typename X, typename W, typename O, typename Tiles>
void run_panels(const Tiles& tiles, const X* xp, const W* wp, int64_t panel_size, const float* bp, O* op,
                int64_t M, int64_t K, int64_t panels, int64_t out_features) {
  for (int64_t block = 0; block < M; block += kBlockRows) {
    const int64_t block_rows = std::min(kBlockRows, M - block);
    const int64_t num_tiles = (block_rows + kTileRows - 1) / kTileRows;
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t col = p * kPanel;
        const int64_t cols = std::min(kPanel, out_features - col);
        int64_t row = block;
        for (int64_t t = 0; t < num_tiles; ++t) {
          const int64_t rows = (block + block_rows - row) / (num_tiles - t);
          const W* next = t + 1 == num_tiles && p + 1 < end ? wp + (p + 1) * panel_size : nullptr;
          tiles[rows - 1](xp + row * K, K, wp + p * panel_size, K, bp ? bp + col : nullptr,
                          op + row * out_features + col, out_features, cols, next);
          row += rows;
        }
      }
    });
  }
}

// x `[M, K]` float32 with a pack_weight weight -> `[M, out_features]` float32, or x bfloat16 with a
// pack_weight_bf16 weight -> bfloat16.
Tensor linear(const Tensor& x, const Tensor& packed, const c10::optional<Tensor>& bias, int64_t out_features) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && (bf16 || x.scalar_type() == at::kFloat),
              "x must be [num_tokens, in_features] float32 or bfloat16");
  if (bf16) {
    TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kPanel && packed.size(3) == 2 && packed.is_contiguous() &&
                    packed.scalar_type() == at::kBFloat16,
                "a bfloat16 x needs a weight from this library's pack_weight_bf16 (panels of ", kPanel, ")");
  } else {
    TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous() &&
                    (packed.scalar_type() == at::kFloat || packed.scalar_type() == at::kBFloat16),
                "a float32 x needs a weight from this library's pack_weight (panels of ", kPanel, ")");
  }
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0);
  const int64_t weight_k = bf16 ? 2 * packed.size(1) : packed.size(1);
  TORCH_CHECK(K == weight_k || (bf16 && K + 1 == weight_k), "x has ", K, " features, the weight ", weight_k);
  TORCH_CHECK(out_features > (panels - 1) * kPanel && out_features <= panels * kPanel, "out_features ",
              out_features, " does not match a packed weight of ", panels, " panels of ", kPanel);
  Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.dim() == 1 && b.size(0) == out_features, "bias must be [", out_features, "]");
  }
  const Tensor xc = x.contiguous();
  Tensor out = at::empty({M, out_features}, x.options());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  static constexpr auto tiles_f32 = make_tiles<float>(std::make_integer_sequence<int, kTileRows>{});
  static constexpr auto tiles_bf16_weight = make_tiles<uint16_t>(std::make_integer_sequence<int, kTileRows>{});
  static constexpr auto tiles_bf16 = make_tiles_bf16(std::make_integer_sequence<int, kTileRows>{});
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  if (bf16) {
    run_panels(tiles_bf16, reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), wp,
               packed.size(1) * 2 * kPanel, bp, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), M, K,
               panels, out_features);
  } else if (packed.scalar_type() == at::kBFloat16) {
    run_panels(tiles_bf16_weight, xc.data_ptr<float>(), wp, K * kPanel, bp, out.data_ptr<float>(), M, K, panels,
               out_features);
  } else {
    run_panels(tiles_f32, xc.data_ptr<float>(), packed.data_ptr<float>(), K * kPanel, bp, out.data_ptr<float>(),
               M, K, panels, out_features);
  }
  return out;
}

std::string isa() { return conveyor::simd::kIsa; }

bool bf16_dot() { return kBf16Dot; }

}  // namespace

CONVEYOR_LIBRARY(CONVEYOR_LINEAR_NAMESPACE, m) {
  m.def("pack_weight(Tensor weight, bool bf16) -> Tensor", &pack_weight);
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor", &linear);
  m.def("pack_weight_bf16(Tensor weight) -> Tensor", &pack_weight_bf16);
  m.def("isa() -> str", &isa);
  m.def("bf16_dot() -> bool", &bf16_dot);
}
