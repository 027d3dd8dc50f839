// Dot products of weight rows with groups of activation rows, shared by the kernels that run one small
// GEMM per group of tokens (moe.cpp: per expert; lora.cpp: per adapter). Dot products run on tiles of
// 4 weight rows x 2 activation rows (Simd's fused multiply-adds, float32 or bfloat16 widened on load),
// so a weight row is read once per 2 activation rows, and sums are float32.

#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

#include "simd.h"

namespace conveyor::grouped {

#if defined(CONVEYOR_SIMD_VECTOR)
using simd::Simd;
#endif

constexpr int kTileRows = 4;          // weight rows per dot tile
constexpr int kTileCols = 2;          // activation rows per dot tile

// out[c * stride + r] = dot(w[r], x[c]) over n elements, for r < R, c < C.
template <int R, int C, typename W, typename X>
inline void dot_tile(const W* const* w, const X* const* x, int64_t n, float* out, int64_t stride) {
  float sums[R][C] = {};
  int64_t i = 0;
#if defined(CONVEYOR_SIMD_VECTOR)
  if constexpr (simd::kVectorType<W> && simd::kVectorType<X>) {
    Simd::Vec acc[R][C];
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < C; ++c) acc[r][c] = Simd::zero();
    }
    for (; i + Simd::kLanes <= n; i += Simd::kLanes) {
      Simd::Vec xv[C];
      for (int c = 0; c < C; ++c) xv[c] = Simd::load(x[c] + i);
      for (int r = 0; r < R; ++r) {
        const Simd::Vec wv = Simd::load(w[r] + i);
        for (int c = 0; c < C; ++c) acc[r][c] = Simd::fmadd(wv, xv[c], acc[r][c]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < C; ++c) sums[r][c] = Simd::reduce_add(acc[r][c]);
    }
  }
#endif
  for (; i < n; ++i) {
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < C; ++c) sums[r][c] += static_cast<float>(w[r][i]) * static_cast<float>(x[c][i]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) out[c * stride + r] = sums[r][c];
  }
}

// out[c * stride + r] = dot(w[r], x[c]) for r < rows (<= kTileRows), c < cols (<= kTileCols).
template <typename W, typename X>
inline void dots(const W* const* w, int rows, const X* const* x, int cols, int64_t n, float* out,
                 int64_t stride) {
#define CONVEYOR_TILE(R, C) \
  if (rows == R && cols == C) return dot_tile<R, C>(w, x, n, out, stride);
  CONVEYOR_TILE(4, 2) CONVEYOR_TILE(4, 1) CONVEYOR_TILE(3, 2) CONVEYOR_TILE(3, 1)
  CONVEYOR_TILE(2, 2) CONVEYOR_TILE(2, 1) CONVEYOR_TILE(1, 2) CONVEYOR_TILE(1, 1)
#undef CONVEYOR_TILE
}

// out[p * out_stride + r - first] = dot(weight row r, x[p]) for rows [first, last) and the pairs [0, count).
template <typename W, typename X>
inline void rows_times_pairs(const W* weight, int64_t width, int64_t first, int64_t last,
                             const X* const* x, int64_t count, float* out, int64_t out_stride) {
  for (int64_t r = first; r < last; r += kTileRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kTileRows, last - r));
    const W* w[kTileRows];
    for (int i = 0; i < rows; ++i) w[i] = weight + (r + i) * width;
    for (int64_t p = 0; p < count; p += kTileCols) {
      const int cols = static_cast<int>(std::min<int64_t>(kTileCols, count - p));
      dots(w, rows, x + p, cols, width, out + p * out_stride + (r - first), out_stride);
    }
  }
}

}  // namespace conveyor::grouped
