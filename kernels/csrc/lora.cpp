// LoRA deltas of many adapters in one batch on CPUs (`conveyor.kernels.reference.add_lora` is the
// contract): the step's token rows are sorted by adapter (a counting sort, stable), and each adapter the
// step uses runs its shrink (`mid = A x`, every slice's A stacked) and expand (`y += B mid`, B stored
// transposed, `[R, out]`) over all its rows at once, the segmented form of Punica's SGMV (Chen et al.,
// 2023), so an adapter's matrices are read once per step, not once per token. Rows whose adapter index
// is negative are left as they are.
//
// Two passes, each one at::parallel_for over work items:
//   1. shrink, items (adapter, 16 rows of A): A's rows dotted with each of the adapter's token rows
//      (grouped.h's tiles) -> mid[row, k] (float32);
//   2. expand, items (adapter, 64 output columns within one slice): for each pair of token rows, the
//      columns' float32 sums start from y, take `mid[row, slice * R + r] * B[r, columns]` for r below the
//      slot's rank (tiles of 4 vectors of columns kept in registers over r, each B vector serving both
//      rows; B's block stays in cache across the adapter's rows), and are rounded once to y's dtype.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "grouped.h"

#ifndef CONVEYOR_LORA_NAMESPACE
#define CONVEYOR_LORA_NAMESPACE conveyor_lora
#endif
#define CONVEYOR_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)

namespace conveyor::lora {

using at::Tensor;
using grouped::rows_times_pairs;
#if defined(CONVEYOR_SIMD_VECTOR)
using simd::Simd;
#endif

constexpr int64_t kRowsPerItem = 16;  // rows of A per shrink work item
constexpr int64_t kColsPerItem = 64;  // output columns per expand work item

// acc[c] += m * b[c] for c < n.
template <typename T>
inline void axpy(float m, const T* b, float* acc, int64_t n) {
  int64_t c = 0;
#if defined(CONVEYOR_SIMD_VECTOR)
  if constexpr (simd::kVectorType<T>) {
    const Simd::Vec mv = Simd::set1(m);
    for (; c + Simd::kLanes <= n; c += Simd::kLanes) {
      Simd::store(acc + c, Simd::fmadd(mv, Simd::load(b + c), Simd::load(acc + c)));
    }
  }
#endif
  for (; c < n; ++c) acc[c] += m * static_cast<float>(b[c]);
}

#if defined(CONVEYOR_SIMD_VECTOR)
constexpr int kTileVecs = 4;  // vectors of output columns per expand tile, kept in registers over r

// acc[t][c] += sum_r m[t][r] * b[r * stride + c] for the tile's kTileVecs * kLanes columns and C token rows:
// each B vector loaded once per r serves the C rows, and the sums stay in registers.
template <int C, typename T>
inline void expand_tile(const T* b, int64_t stride, const float* const* m, int64_t rank, float* const* acc) {
  Simd::Vec sum[C][kTileVecs];
  for (int t = 0; t < C; ++t) {
    for (int v = 0; v < kTileVecs; ++v) sum[t][v] = Simd::load(acc[t] + v * Simd::kLanes);
  }
  for (int64_t r = 0; r < rank; ++r) {
    Simd::Vec bv[kTileVecs];
    for (int v = 0; v < kTileVecs; ++v) bv[v] = Simd::load(b + r * stride + v * Simd::kLanes);
    for (int t = 0; t < C; ++t) {
      const Simd::Vec mv = Simd::set1(m[t][r]);
      for (int v = 0; v < kTileVecs; ++v) sum[t][v] = Simd::fmadd(mv, bv[v], sum[t][v]);
    }
  }
  for (int t = 0; t < C; ++t) {
    for (int v = 0; v < kTileVecs; ++v) Simd::store(acc[t] + v * Simd::kLanes, sum[t][v]);
  }
}
#endif

// acc[t][c] += sum_r m[t][r] * b[r * stride + c] for c < cols and C (1 or 2) token rows.
template <int C, typename T>
inline void expand_rows(const T* b, int64_t stride, const float* const* m, int64_t rank, float* const* acc,
                        int64_t cols) {
  int64_t c = 0;
#if defined(CONVEYOR_SIMD_VECTOR)
  if constexpr (simd::kVectorType<T>) {
    constexpr int64_t tile = kTileVecs * Simd::kLanes;
    for (; c + tile <= cols; c += tile) {
      const float* ms[C];
      float* accs[C];
      for (int t = 0; t < C; ++t) ms[t] = m[t], accs[t] = acc[t] + c;
      expand_tile<C>(b + c, stride, ms, rank, accs);
    }
  }
#endif
  for (int t = 0; t < C; ++t) {
    for (int64_t r = 0; r < rank; ++r) axpy(m[t][r], b + r * stride + c, acc[t] + c, cols - c);
  }
}

template <typename T>
void add_lora_typed(Tensor& y, const Tensor& x, const Tensor& lora_a, const Tensor& lora_b, const Tensor& indices,
                    const std::vector<int64_t>& slices, const std::vector<int64_t>& ranks) {
  const int64_t num_tokens = x.size(0), in_features = x.size(1), out_features = y.size(1);
  const int64_t num_slots = lora_a.size(0), stacked = lora_a.size(1), rank = lora_b.size(1);
  const int64_t* index = indices.data_ptr<int64_t>();
  const T* x_data = x.data_ptr<T>();
  const T* a_data = lora_a.data_ptr<T>();
  const T* b_data = lora_b.data_ptr<T>();
  T* y_data = y.data_ptr<T>();

  // Counting sort of the rows by adapter; rows without one (index < 0) are dropped.
  std::vector<int64_t> start(num_slots + 1, 0);
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(index[t] < num_slots, "add_lora: adapter index ", index[t], " outside [-1, ", num_slots, ")");
    if (index[t] >= 0) ++start[index[t] + 1];
  }
  for (int64_t s = 0; s < num_slots; ++s) start[s + 1] += start[s];
  const int64_t num_rows = start[num_slots];
  if (num_rows == 0) return;
  std::vector<int64_t> sorted_row(num_rows);
  {
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t t = 0; t < num_tokens; ++t) {
      if (index[t] >= 0) sorted_row[next[index[t]]++] = t;
    }
  }
  std::vector<const T*> x_rows(num_rows);
  for (int64_t s = 0; s < num_rows; ++s) x_rows[s] = x_data + sorted_row[s] * in_features;

  // 1. shrink: mid[s, k] = A[a, k] . x[row s], k < S * R.
  // A slot's rows past its rank are zero: neither read nor multiplied (mid stays 0 there).
  std::vector<float> mid(num_rows * stacked, 0.0f);
  struct Rows {
    int64_t adapter, first, last;
  };
  std::vector<Rows> shrink_items;
  for (int64_t a = 0; a < num_slots; ++a) {
    if (start[a + 1] == start[a]) continue;
    for (size_t s = 0; s < slices.size(); ++s) {
      const int64_t base = static_cast<int64_t>(s) * rank;
      for (int64_t k = 0; k < ranks[a]; k += kRowsPerItem) {
        shrink_items.push_back({a, base + k, base + std::min(ranks[a], k + kRowsPerItem)});
      }
    }
  }
  at::parallel_for(0, static_cast<int64_t>(shrink_items.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const auto [a, k0, k1] = shrink_items[item];
      const int64_t first = start[a], count = start[a + 1] - first;
      rows_times_pairs(a_data + a * stacked * in_features, in_features, k0, k1, x_rows.data() + first, count,
                       mid.data() + first * stacked + k0, stacked);
    }
  });

  // 2. expand: y[row s, c] += sum_r mid[s, slice(c) * R + r] * B[a, r, c], in blocks of columns that
  // stay within one slice.
  struct Block {
    int64_t adapter, first_col, cols, slice;
  };
  std::vector<Block> blocks;
  for (int64_t a = 0; a < num_slots; ++a) {
    if (start[a + 1] == start[a] || ranks[a] == 0) continue;
    int64_t offset = 0;
    for (size_t s = 0; s < slices.size(); ++s) {
      for (int64_t c = 0; c < slices[s]; c += kColsPerItem) {
        blocks.push_back({a, offset + c, std::min(kColsPerItem, slices[s] - c), static_cast<int64_t>(s)});
      }
      offset += slices[s];
    }
  }
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t begin, int64_t end) {
    float acc[2][kColsPerItem];
    for (int64_t item = begin; item < end; ++item) {
      const Block& block = blocks[item];
      const T* b = b_data + block.adapter * rank * out_features + block.first_col;
      const int64_t last = start[block.adapter + 1];
      for (int64_t p = start[block.adapter]; p < last; p += 2) {  // two token rows per B read
        const int rows = p + 1 < last ? 2 : 1;
        T* out[2];
        const float* m[2];
        float* accs[2] = {acc[0], acc[1]};
        for (int t = 0; t < rows; ++t) {
          out[t] = y_data + sorted_row[p + t] * out_features + block.first_col;
          m[t] = mid.data() + (p + t) * stacked + block.slice * rank;
          for (int64_t c = 0; c < block.cols; ++c) acc[t][c] = static_cast<float>(out[t][c]);
        }
        if (rows == 2) {
          expand_rows<2>(b, out_features, m, ranks[block.adapter], accs, block.cols);
        } else {
          expand_rows<1>(b, out_features, m, ranks[block.adapter], accs, block.cols);
        }
        for (int t = 0; t < rows; ++t) {
          for (int64_t c = 0; c < block.cols; ++c) out[t][c] = static_cast<T>(acc[t][c]);
        }
      }
    }
  });
}

// See `conveyor.kernels.reference.add_lora`. y [T, out], x [T, in], lora_a [L, S * R, in], lora_b [L, R, out]:
// one dtype, float32 or bfloat16; indices [T] int64 in [-1, L); output_slices: S widths summing to out;
// slot_ranks: L ranks in [0, R] (rows past them are zero and skipped), or empty for R each. y is updated
// in place and returned.
Tensor add_lora(Tensor y, const Tensor& x, const Tensor& lora_a, const Tensor& lora_b, const Tensor& indices,
                at::IntArrayRef output_slices, at::IntArrayRef slot_ranks) {
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && lora_a.dim() == 3 && lora_b.dim() == 3,
              "add_lora: y and x are 2-D, lora_a and lora_b 3-D");
  TORCH_CHECK(x.size(0) == y.size(0) && indices.numel() == x.size(0),
              "add_lora: y, x and indices have one row per token");
  const std::vector<int64_t> slices(output_slices.begin(), output_slices.end());
  int64_t total = 0;
  for (const int64_t w : slices) total += w;
  TORCH_CHECK(!slices.empty() && total == y.size(1), "add_lora: output_slices must sum to y's width ", y.size(1));
  TORCH_CHECK(lora_a.size(2) == x.size(1) && lora_b.size(2) == y.size(1) && lora_a.size(0) == lora_b.size(0) &&
                  lora_a.size(1) == static_cast<int64_t>(slices.size()) * lora_b.size(1),
              "add_lora: lora_a [L, S * R, in] and lora_b [L, R, out] do not match x [T, in], y [T, out] and ",
              slices.size(), " slices");
  TORCH_CHECK(y.scalar_type() == x.scalar_type() && x.scalar_type() == lora_a.scalar_type() &&
                  lora_a.scalar_type() == lora_b.scalar_type(),
              "add_lora: y, x, lora_a and lora_b share one dtype");
  TORCH_CHECK(y.is_contiguous(), "add_lora: y is updated in place and must be contiguous");
  std::vector<int64_t> ranks(slot_ranks.begin(), slot_ranks.end());
  if (ranks.empty()) ranks.assign(lora_a.size(0), lora_b.size(1));
  TORCH_CHECK(static_cast<int64_t>(ranks.size()) == lora_a.size(0), "add_lora: one rank per slot");
  for (const int64_t r : ranks) TORCH_CHECK(r >= 0 && r <= lora_b.size(1), "add_lora: a slot rank ", r, " outside [0, ", lora_b.size(1), "]");
  const Tensor xc = x.contiguous(), a = lora_a.contiguous(), b = lora_b.contiguous();
  const Tensor index = indices.to(at::kLong).contiguous();
  switch (y.scalar_type()) {
    case at::kFloat:
      add_lora_typed<float>(y, xc, a, b, index, slices, ranks);
      break;
    case at::kBFloat16:
      add_lora_typed<c10::BFloat16>(y, xc, a, b, index, slices, ranks);
      break;
    default:
      TORCH_CHECK(false, "add_lora: float32 or bfloat16, not ", y.scalar_type());
  }
  return y;
}

}  // namespace conveyor::lora

CONVEYOR_LIBRARY(CONVEYOR_LORA_NAMESPACE, m) {
  m.def("add_lora(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor indices, int[] output_slices, "
        "int[] slot_ranks) -> Tensor(a!)",
        &conveyor::lora::add_lora);
}
