// LoRA deltas of many adapters in one batch on CPUs (`conveyor.kernels.reference.add_lora` is the
// contract): the step's token rows are sorted by adapter (a counting sort, stable), and each adapter the
// step uses runs its shrink (`x A^T`, rank-wide) and expand (`(x A^T) B^T`) over all its rows at once,
// the segmented form of Punica's SGMV (Chen et al., 2023), so an adapter's A and B are read once per
// step, not once per token. Rows whose adapter index is negative are left as they are.
//
// Two passes, each one at::parallel_for over (adapter, 16 weight rows) work items:
//   1. shrink: rows r..r+16 of the adapter's A, dotted with each of its token rows -> mid[row, r]
//      (float32);
//   2. expand: rows o..o+16 of the adapter's B, dotted with each row's mid -> y[row, o] += delta
//      (added in float32, rounded once to y's dtype).

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

constexpr int64_t kRowsPerItem = 16;  // weight rows per work item

template <typename T>
void add_lora_typed(Tensor& y, const Tensor& x, const Tensor& lora_a, const Tensor& lora_b,
                    const Tensor& indices) {
  const int64_t num_tokens = x.size(0), in_features = x.size(1);
  const int64_t num_slots = lora_a.size(0), rank = lora_a.size(1), out_features = lora_b.size(1);
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

  auto items_of = [&](int64_t rows) {
    std::vector<std::pair<int64_t, int64_t>> items;
    for (int64_t a = 0; a < num_slots; ++a) {
      if (start[a + 1] == start[a]) continue;
      for (int64_t r = 0; r < rows; r += kRowsPerItem) items.emplace_back(a, r);
    }
    return items;
  };

  // 1. shrink: mid[s, r] = A[a, r] . x[row s].
  std::vector<float> mid(num_rows * rank);
  const auto shrink_items = items_of(rank);
  at::parallel_for(0, static_cast<int64_t>(shrink_items.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const auto [a, r0] = shrink_items[item];
      const int64_t r1 = std::min(rank, r0 + kRowsPerItem);
      const int64_t first = start[a], count = start[a + 1] - first;
      rows_times_pairs(a_data + a * rank * in_features, in_features, r0, r1, x_rows.data() + first, count,
                       mid.data() + first * rank + r0, rank);
    }
  });

  // 2. expand: y[row s, o] += B[a, o] . mid[s].
  std::vector<const float*> mid_rows(num_rows);
  for (int64_t s = 0; s < num_rows; ++s) mid_rows[s] = mid.data() + s * rank;
  const auto expand_items = items_of(out_features);
  at::parallel_for(0, static_cast<int64_t>(expand_items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> delta;
    for (int64_t item = begin; item < end; ++item) {
      const auto [a, o0] = expand_items[item];
      const int64_t o1 = std::min(out_features, o0 + kRowsPerItem), rows = o1 - o0;
      const int64_t first = start[a], count = start[a + 1] - first;
      delta.resize(count * rows);
      rows_times_pairs(b_data + a * out_features * rank, rank, o0, o1, mid_rows.data() + first, count,
                       delta.data(), rows);
      for (int64_t p = 0; p < count; ++p) {
        T* out = y_data + sorted_row[first + p] * out_features + o0;
        for (int64_t o = 0; o < rows; ++o) {
          out[o] = static_cast<T>(static_cast<float>(out[o]) + delta[p * rows + o]);
        }
      }
    }
  });
}

// See `conveyor.kernels.reference.add_lora`. y [T, out], x [T, in], lora_a [L, R, in], lora_b [L, out, R]:
// one dtype, float32 or bfloat16; indices [T] int64 in [-1, L). y is updated in place and returned.
Tensor add_lora(Tensor y, const Tensor& x, const Tensor& lora_a, const Tensor& lora_b, const Tensor& indices) {
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && lora_a.dim() == 3 && lora_b.dim() == 3,
              "add_lora: y and x are 2-D, lora_a and lora_b 3-D");
  TORCH_CHECK(x.size(0) == y.size(0) && indices.numel() == x.size(0), "add_lora: y, x and indices have one row per token");
  TORCH_CHECK(lora_a.size(2) == x.size(1) && lora_b.size(1) == y.size(1) && lora_a.size(1) == lora_b.size(2) &&
                  lora_a.size(0) == lora_b.size(0),
              "add_lora: lora_a [L, R, in] and lora_b [L, out, R] do not match x [T, in] and y [T, out]");
  TORCH_CHECK(y.scalar_type() == x.scalar_type() && x.scalar_type() == lora_a.scalar_type() &&
                  lora_a.scalar_type() == lora_b.scalar_type(),
              "add_lora: y, x, lora_a and lora_b share one dtype");
  TORCH_CHECK(y.is_contiguous(), "add_lora: y is updated in place and must be contiguous");
  const Tensor xc = x.contiguous(), a = lora_a.contiguous(), b = lora_b.contiguous();
  const Tensor index = indices.to(at::kLong).contiguous();
  switch (y.scalar_type()) {
    case at::kFloat:
      add_lora_typed<float>(y, xc, a, b, index);
      break;
    case at::kBFloat16:
      add_lora_typed<c10::BFloat16>(y, xc, a, b, index);
      break;
    default:
      TORCH_CHECK(false, "add_lora: float32 or bfloat16, not ", y.scalar_type());
  }
  return y;
}

}  // namespace conveyor::lora

CONVEYOR_LIBRARY(CONVEYOR_LORA_NAMESPACE, m) {
  m.def("add_lora(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor indices) -> Tensor(a!)",
        &conveyor::lora::add_lora);
}
