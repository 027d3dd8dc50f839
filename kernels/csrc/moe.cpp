// The mixture-of-experts MLP on CPUs (`conveyor.kernels.reference.fused_moe` is the contract): the step's
// (token, choice) pairs are sorted by expert, and each expert the step uses streams its weights once for
// all its tokens.
//
// Two passes over the active experts, each one at::parallel_for over (expert, 16 weight rows) work
// items, so threads spread over experts and rows alike:
//   1. gate/up: for rows r..r+16 of the expert's gate and up halves, the dot products with each of its
//      tokens' hidden rows, then silu(gate) * up -> act[pair, r..r+16] (float32);
//   2. down: for rows h..h+16 of the down projection, the dot products with each pair's act row, times
//      the pair's routing weight -> pair_out[pair, h..h+16] (the weighted sum fused into the output).
// A last pass adds each token's pair rows in increasing expert order (the reference's order) in float32.
// Dot products are grouped.h's tiles, so a weight row is read once per 2 tokens of its expert.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "grouped.h"

#ifndef CONVEYOR_MOE_NAMESPACE
#define CONVEYOR_MOE_NAMESPACE conveyor_moe
#endif
#define CONVEYOR_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)

namespace conveyor::moe {

using at::Tensor;
using grouped::rows_times_pairs;

constexpr int64_t kRowsPerItem = 16;  // weight rows per work item

template <typename T>
Tensor fused_moe_typed(const Tensor& hidden, const Tensor& w13, const Tensor& w2, const Tensor& topk_weights,
                       const Tensor& topk_ids) {
  const int64_t num_tokens = hidden.size(0), hidden_size = hidden.size(1);
  const int64_t num_experts = w13.size(0), width = w13.size(1) / 2, top_k = topk_ids.size(1);
  const int64_t num_pairs = num_tokens * top_k;
  const int64_t* ids = topk_ids.data_ptr<int64_t>();
  const float* routing = topk_weights.data_ptr<float>();
  const T* x = hidden.data_ptr<T>();
  const T* gate_up = w13.data_ptr<T>();
  const T* down = w2.data_ptr<T>();

  // Counting sort of the pairs by expert, stable in (token, choice) order.
  std::vector<int64_t> start(num_experts + 1, 0);
  for (int64_t p = 0; p < num_pairs; ++p) {
    TORCH_CHECK(ids[p] >= 0 && ids[p] < num_experts, "fused_moe: expert id ", ids[p], " outside [0, ",
                num_experts, ")");
    ++start[ids[p] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) start[e + 1] += start[e];
  std::vector<int64_t> sorted_pair(num_pairs), slot(num_pairs);
  {
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t p = 0; p < num_pairs; ++p) {
      const int64_t s = next[ids[p]]++;
      sorted_pair[s] = p;  // pair p = token p / top_k, choice p % top_k
      slot[p] = s;
    }
  }
  std::vector<const T*> token_rows(num_pairs);
  for (int64_t s = 0; s < num_pairs; ++s) token_rows[s] = x + (sorted_pair[s] / top_k) * hidden_size;

  // Work items: (expert, first row) over the active experts.
  auto items_of = [&](int64_t rows) {
    std::vector<std::pair<int64_t, int64_t>> items;
    for (int64_t e = 0; e < num_experts; ++e) {
      if (start[e + 1] == start[e]) continue;
      for (int64_t r = 0; r < rows; r += kRowsPerItem) items.emplace_back(e, r);
    }
    return items;
  };

  // 1. gate/up and the activation: act[s, r] = silu(gate_r . x_s) * (up_r . x_s).
  std::vector<float> act(num_pairs * width);
  const auto up_items = items_of(width);
  at::parallel_for(0, static_cast<int64_t>(up_items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> gate_out, up_out;
    for (int64_t item = begin; item < end; ++item) {
      const auto [e, r0] = up_items[item];
      const int64_t r1 = std::min(width, r0 + kRowsPerItem), rows = r1 - r0;
      const int64_t first = start[e], count = start[e + 1] - first;
      gate_out.resize(count * rows);
      up_out.resize(count * rows);
      const T* expert = gate_up + e * 2 * width * hidden_size;
      rows_times_pairs(expert, hidden_size, r0, r1, token_rows.data() + first, count, gate_out.data(), rows);
      rows_times_pairs(expert + width * hidden_size, hidden_size, r0, r1, token_rows.data() + first, count,
                       up_out.data(), rows);
      for (int64_t p = 0; p < count; ++p) {
        float* out = act.data() + (first + p) * width + r0;
        for (int64_t i = 0; i < rows; ++i) {
          const float g = gate_out[p * rows + i];
          out[i] = g / (1.0f + std::exp(-g)) * up_out[p * rows + i];
        }
      }
    }
  });

  // 2. down, times the routing weight: pair_out[s, h] = w_s * (down_h . act_s).
  std::vector<float> pair_out(num_pairs * hidden_size);
  std::vector<const float*> act_rows(num_pairs);
  for (int64_t s = 0; s < num_pairs; ++s) act_rows[s] = act.data() + s * width;
  const auto down_items = items_of(hidden_size);
  at::parallel_for(0, static_cast<int64_t>(down_items.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const auto [e, h0] = down_items[item];
      const int64_t h1 = std::min(hidden_size, h0 + kRowsPerItem);
      const int64_t first = start[e], count = start[e + 1] - first;
      float* out = pair_out.data() + first * hidden_size + h0;
      rows_times_pairs(down + e * hidden_size * width, width, h0, h1, act_rows.data() + first, count, out,
                       hidden_size);
      for (int64_t p = 0; p < count; ++p) {
        const float w = routing[sorted_pair[first + p]];
        for (int64_t h = 0; h < h1 - h0; ++h) out[p * hidden_size + h] *= w;
      }
    }
  });

  // 3. Each token's pairs added in increasing expert order, from 0, in float32.
  Tensor result = at::empty({num_tokens, hidden_size}, hidden.options());
  T* result_data = result.data_ptr<T>();
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> order(top_k);
    std::vector<float> sum(hidden_size);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t j = 0; j < top_k; ++j) order[j] = slot[t * top_k + j];
      std::sort(order.begin(), order.end());  // slots ascend with the expert id
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (const int64_t s : order) {
        const float* row = pair_out.data() + s * hidden_size;
        for (int64_t h = 0; h < hidden_size; ++h) sum[h] += row[h];
      }
      for (int64_t h = 0; h < hidden_size; ++h) result_data[t * hidden_size + h] = static_cast<T>(sum[h]);
    }
  });
  return result;
}

// See `conveyor.kernels.reference.fused_moe`. hidden, w13, w2: one dtype, float32 or bfloat16,
// contiguous; topk_weights float32 and topk_ids int64, [num_tokens, top_k].
Tensor fused_moe(const Tensor& hidden, const Tensor& w13, const Tensor& w2, const Tensor& topk_weights,
                 const Tensor& topk_ids) {
  TORCH_CHECK(hidden.dim() == 2 && w13.dim() == 3 && w2.dim() == 3, "fused_moe: hidden is 2-D, w13 and w2 3-D");
  TORCH_CHECK(w13.size(2) == hidden.size(1) && w2.size(1) == hidden.size(1) && w13.size(1) == 2 * w2.size(2) &&
                  w13.size(0) == w2.size(0),
              "fused_moe: w13 [E, 2I, H] and w2 [E, H, I] do not match hidden [T, H]");
  TORCH_CHECK(topk_ids.sizes() == topk_weights.sizes() && topk_ids.size(0) == hidden.size(0),
              "fused_moe: topk_ids and topk_weights are [num_tokens, top_k]");
  TORCH_CHECK(hidden.scalar_type() == w13.scalar_type() && w13.scalar_type() == w2.scalar_type(),
              "fused_moe: hidden, w13 and w2 share one dtype");
  const Tensor h = hidden.contiguous(), a = w13.contiguous(), b = w2.contiguous();
  const Tensor weights = topk_weights.to(at::kFloat).contiguous(), ids = topk_ids.to(at::kLong).contiguous();
  switch (hidden.scalar_type()) {
    case at::kFloat:
      return fused_moe_typed<float>(h, a, b, weights, ids);
    case at::kBFloat16:
      return fused_moe_typed<c10::BFloat16>(h, a, b, weights, ids);
    default:
      TORCH_CHECK(false, "fused_moe: float32 or bfloat16, not ", hidden.scalar_type());
  }
}

}  // namespace conveyor::moe

CONVEYOR_LIBRARY(CONVEYOR_MOE_NAMESPACE, m) {
  m.def("fused_moe(Tensor hidden, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids) -> Tensor",
        &conveyor::moe::fused_moe);
}
