// The decoder's layer loop for CPUs in one op (conveyor.kernels.cpu.DecoderLayers): every layer of a
// Llama-family model for one step, the same kernels in the same order as the model's Python forward
// (conveyor.server.model.models.llama), called from C++.
//
// Why: at decode batch sizes a layer is about sixteen small ops, and from Python each costs its
// dispatch (argument parsing, the boxed call of a custom op, a Python frame per module). Here the ops
// are plain C++ calls (the CPU kernels directly, the linear layers through the dispatcher's unboxed
// path) and the step's attention layout (which rows decode, which sequences prefill) is read once, not
// per layer. On 2 cores it took a bfloat16 step of the embedded model from 40.5 to 39.3 ms (the
// profiler had put the Python between ops at 6 ms; most of that was its own cost).
//
// Linear layers come in three kinds, as conveyor.kernels.cpu.linear_kind names them: a plain weight
// (`at::linear`), a oneDNN-packed weight (`mkldnn::_linear_pointwise`, kernels/onednn.py) and this
// library's panel-packed kernel (`conveyor_linear::linear`, linear.cpp; float32, or bfloat16 with
// AVX512_BF16).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "cpu_kernels.h"

namespace {

using at::Tensor;

enum LinearKind : int64_t { kPlain = 0, kOneDNN = 1, kPanel = 2 };

Tensor linear(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias, int64_t kind,
              int64_t out_features) {
  switch (kind) {
    case kPlain:
      return at::linear(x, weight, bias);
    case kOneDNN: {
      static auto op =
          c10::Dispatcher::singleton()
              .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
              .typed<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&, std::string_view,
                            c10::List<std::optional<at::Scalar>>, std::optional<std::string_view>)>();
      return op.call(x, weight, bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
    }
    case kPanel: {
      static auto op = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("conveyor_linear::linear", "")
                           .typed<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&, int64_t)>();
      return op.call(x, weight, bias, out_features);
    }
    default:
      TORCH_CHECK(false, "unknown linear kind ", kind);
  }
}

// Which query rows of the step decode (one token) and which sequences prefill (several), read once per
// step from query_start_loc `[num_seqs + 1]` int32.
struct StepLayout {
  bool all_decode = true;
  Tensor decode_seqs, decode_rows;             // int64, empty when all_decode
  std::vector<int64_t> prefill_seqs, starts, q_lens;
};

StepLayout step_layout(const Tensor& query_start_loc) {
  const Tensor loc = query_start_loc.to(at::kLong).contiguous();
  const int64_t* lp = loc.data_ptr<int64_t>();
  const int64_t num_seqs = loc.size(0) - 1;
  StepLayout layout;
  std::vector<int64_t> seqs, rows;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q_len = lp[b + 1] - lp[b];
    TORCH_CHECK(q_len >= 1, "sequence ", b, " has no query rows in query_start_loc");
    if (q_len == 1) {
      seqs.push_back(b);
      rows.push_back(lp[b]);
    } else {
      layout.all_decode = false;
      layout.prefill_seqs.push_back(b);
      layout.starts.push_back(lp[b]);
      layout.q_lens.push_back(q_len);
    }
  }
  if (!layout.all_decode) {
    const auto opts = at::TensorOptions().dtype(at::kLong);
    layout.decode_seqs = at::tensor(seqs, opts);
    layout.decode_rows = at::tensor(rows, opts);
  }
  return layout;
}

// The rows of prefilling sequences, as conveyor.kernels.reference.prefill_attention computes them
// (the sequence's K/V gathered from its blocks, then torch's scaled_dot_product_attention).
void prefill_attention(const Tensor& out, const Tensor& query, const Tensor& key_cache,
                       const Tensor& value_cache, const Tensor& block_tables, const Tensor& seq_lens,
                       const StepLayout& layout, double scale) {
  const int64_t block_size = key_cache.size(1);
  const Tensor lens = seq_lens.to(at::kLong);
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (size_t i = 0; i < layout.prefill_seqs.size(); ++i) {
    const int64_t b = layout.prefill_seqs[i], start = layout.starts[i], q_len = layout.q_lens[i];
    const int64_t seq_len = lp[b];
    const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
    const Tensor ids = block_tables[b].narrow(0, 0, num_blocks).to(at::kLong);
    auto gather = [&](const Tensor& cache) {
      return cache.index_select(0, ids)
          .reshape({num_blocks * block_size, cache.size(2), cache.size(3)})
          .narrow(0, 0, seq_len)
          .transpose(0, 1);  // [num_kv_heads, seq_len, head_dim]
    };
    const Tensor k = gather(key_cache), v = gather(value_cache);
    const Tensor q = query.narrow(0, start, q_len).transpose(0, 1);  // [num_heads, q_len, head_dim]
    Tensor o;
    if (q_len == seq_len) {
      o = at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, true, scale, true);
    } else {
      // A chunk of a longer context: row i sees the cached prefix and its own causal part.
      const auto opts = at::TensorOptions().dtype(at::kLong);
      const Tensor pos = at::arange(seq_len - q_len, seq_len, opts);
      const Tensor mask = at::arange(seq_len, opts).unsqueeze(0) <= pos.unsqueeze(1);
      o = at::scaled_dot_product_attention(q, k, v, mask, 0.0, false, scale, true);
    }
    out.narrow(0, start, q_len).copy_(o.transpose(0, 1));
  }
}

// hidden: `[num_tokens, hidden_size]`, the embedded tokens. Returns the final RMSNorm of the last layer's
// residual stream, `[num_tokens, hidden_size]` in hidden's dtype. Per layer l: norm_weights[2l] (input),
// [2l + 1] (post-attention), and the last one the final norm; linears[4l + 0..3] q/k/v, o, gate/up,
// down. Raises the kernels' errors (a position outside the rotary table, a slot outside the cache).
Tensor decoder_layers(const Tensor& hidden, const Tensor& positions, const Tensor& cos_sin_cache,
                      at::TensorList norm_weights, at::TensorList linear_weights,
                      const c10::List<std::optional<Tensor>>& linear_biases, at::IntArrayRef linear_kinds,
                      at::IntArrayRef linear_out_features, at::TensorList key_caches,
                      at::TensorList value_caches, const Tensor& slot_mapping, const Tensor& block_tables,
                      const Tensor& query_start_loc, const Tensor& seq_lens, int64_t num_heads,
                      int64_t num_kv_heads, double eps, double scale) {
  const int64_t num_layers = static_cast<int64_t>(key_caches.size());
  TORCH_CHECK(value_caches.size() == key_caches.size() &&
                  static_cast<int64_t>(norm_weights.size()) == 2 * num_layers + 1 &&
                  static_cast<int64_t>(linear_weights.size()) == 4 * num_layers &&
                  static_cast<int64_t>(linear_biases.size()) == 4 * num_layers &&
                  static_cast<int64_t>(linear_kinds.size()) == 4 * num_layers &&
                  static_cast<int64_t>(linear_out_features.size()) == 4 * num_layers,
              "decoder_layers needs 2 norms and 4 linear layers per layer, a final norm, and one KV cache "
              "pair per layer");
  const int64_t num_tokens = hidden.size(0);
  const int64_t head_dim = key_caches[0].size(3);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const StepLayout layout = step_layout(query_start_loc);
  const Tensor tables = block_tables.contiguous();
  auto proj = [&](const Tensor& x, int64_t i) {
    return linear(x, linear_weights[i], linear_biases.get(i), linear_kinds[i], linear_out_features[i]);
  };

  Tensor x = hidden, residual;
  for (int64_t l = 0; l < num_layers; ++l) {
    Tensor normed;
    if (l == 0) {
      normed = conveyor::cpu::rms_norm(x, norm_weights[0], eps);
      residual = x;
    } else {
      std::tie(normed, residual) = conveyor::cpu::fused_add_rms_norm(x, residual, norm_weights[2 * l], eps);
    }
    const Tensor qkv = proj(normed, 4 * l);
    Tensor q = qkv.narrow(1, 0, q_size).view({num_tokens, num_heads, head_dim});
    Tensor k = qkv.narrow(1, q_size, kv_size).view({num_tokens, num_kv_heads, head_dim});
    const Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({num_tokens, num_kv_heads, head_dim});
    std::tie(q, k) = conveyor::cpu::rotary_embedding(positions, q, k, cos_sin_cache);
    conveyor::cpu::reshape_and_cache(k, v, key_caches[l], value_caches[l], slot_mapping);
    const Tensor attn = at::empty(q.sizes(), q.options());
    if (layout.all_decode) {
      conveyor::cpu::paged_decode_attention(attn, q, key_caches[l], value_caches[l], tables, seq_lens,
                                            std::nullopt, std::nullopt, scale, std::nullopt, std::nullopt);
    } else {
      if (layout.decode_seqs.numel() > 0) {
        conveyor::cpu::paged_decode_attention(attn, q, key_caches[l], value_caches[l], tables, seq_lens,
                                              layout.decode_seqs, layout.decode_rows, scale, std::nullopt,
                                              std::nullopt);
      }
      prefill_attention(attn, q, key_caches[l], value_caches[l], tables, seq_lens, layout, scale);
    }
    const Tensor o = proj(attn.view({num_tokens, q_size}), 4 * l + 1);
    std::tie(normed, residual) = conveyor::cpu::fused_add_rms_norm(o, residual, norm_weights[2 * l + 1], eps);
    x = proj(conveyor::cpu::silu_and_mul(proj(normed, 4 * l + 2)), 4 * l + 3);
  }
  return std::get<0>(conveyor::cpu::fused_add_rms_norm(x, residual, norm_weights[2 * num_layers], eps));
}

}  // namespace

TORCH_LIBRARY(conveyor_decoder, m) {
  m.def(
      "decoder_layers(Tensor hidden, Tensor positions, Tensor cos_sin_cache, Tensor[] norm_weights, "
      "Tensor[] linear_weights, Tensor?[] linear_biases, int[] linear_kinds, int[] linear_out_features, "
      "Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor slot_mapping, Tensor block_tables, "
      "Tensor query_start_loc, Tensor seq_lens, int num_heads, int num_kv_heads, float eps, float scale) "
      "-> Tensor",
      &decoder_layers);
}
