// The decoder's layer loop for CPUs in one op (conveyor.kernels.cpu.DecoderLayers): every layer of a
// model of conveyor.server.model.models.llama for one step, the same kernels in the same order as its
// Python forward, called from C++, with the features the Python layers switch on: per-head RMSNorm of q
// and k (Qwen3, Gemma 3), sandwich norms and GeGLU (Gemma 2/3), Granite's residual multiplier, sliding
// windows and a local rotary table per layer, and attention soft-capping.
//
// Why: at decode batch sizes a layer is about sixteen small ops, and from Python each costs its
// dispatch (argument parsing, the boxed call of a custom op, a Python frame per module). Here the ops
// are plain C++ calls (the CPU kernels directly, the linear layers through the dispatcher's unboxed
// path) and the step's attention layout (which rows decode, which sequences prefill) is read once, not
// per layer. On 2 cores it took a bfloat16 step of the embedded model from 40.5 to 39.3 ms (the
// profiler had put the Python between ops at 6 ms; most of that was its own cost).
//
// Prefill rows attend through attention.cpp (causal, or a chunk against its cached prefix). A step
// with prefill rows of a model with sliding windows or soft caps is not run here: the Python layers run
// it (conveyor.kernels.reference.prefill_attention's masked and soft-capped paths); its decode steps are.
//
// Linear layers come in the kinds conveyor.kernels.cpu.linear_kind names: a plain weight (`at::linear`),
// a oneDNN-packed weight (`mkldnn::_linear_pointwise`, kernels/onednn.py), this library's panel-packed
// kernel (`conveyor_linear::linear`, linear.cpp; float32, or bfloat16 with AVX512_BF16), and a GGUF-
// quantized weight by either of its methods (`conveyor_quant::linear`, quant.cpp).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "cpu_kernels.h"

namespace conveyor::attention {  // attention.cpp, in the same library
void prefill(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
             const at::Tensor& value_cache, const at::Tensor& block_tables, const std::vector<int64_t>& seqs,
             const std::vector<int64_t>& q_lens, const std::vector<int64_t>& starts,
             const std::vector<int64_t>& seq_lens, double scale);
}  // namespace conveyor::attention

namespace conveyor::lora {  // lora.cpp, in the same library
at::Tensor add_lora(at::Tensor y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
                    const at::Tensor& indices, at::IntArrayRef output_slices, at::IntArrayRef slot_ranks);
}  // namespace conveyor::lora

namespace {

using at::Tensor;

enum LinearKind : int64_t { kPlain = 0, kOneDNN = 1, kPanel = 2, kQuantDot = 3, kQuantDequant = 4, kQuantInt8 = 5 };
enum Activation : int64_t { kSilu = 0, kGeluTanh = 1 };

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
    case kQuantDot:
    case kQuantDequant:
    case kQuantInt8: {  // quant.cpp's `linear`, its method being kind - kQuantDot
      static auto op = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("conveyor_quant::linear", "")
                           .typed<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&, int64_t)>();
      return op.call(x, weight, bias, kind - kQuantDot);
    }
    default:
      TORCH_CHECK(false, "unknown linear kind ", kind);
  }
}

// Sequences with at most this many query rows (draft tokens being verified, a short chunk) run through the
// decode kernel one row at a time, as conveyor.kernels.cpu.MAX_DECODE_KERNEL_QUERY_LEN says (and why).
constexpr int64_t kMaxDecodeKernelQueryLen = 16;

// Which query rows of the step the decode kernel computes (one-token sequences, and every row of short
// multi-row ones against the keys up to its own position) and which sequences prefill, read once per step
// from query_start_loc `[num_seqs + 1]` int32, seq_lens `[num_seqs]` int32 and the block tables.
struct StepLayout {
  bool all_decode = true;
  // Empty when all_decode: the rows, their sequences' block tables `[D, max_blocks]` int32, the keys each
  // row sees `[D]` int32, and 0..D-1 (the kernel's sequence index of each row).
  Tensor decode_rows, decode_tables, decode_lens, decode_ids;
  std::vector<int64_t> prefill_seqs, starts, q_lens;
};

StepLayout step_layout(const Tensor& query_start_loc, const Tensor& seq_lens, const Tensor& block_tables) {
  const Tensor loc = query_start_loc.to(at::kLong).contiguous();
  const Tensor lens = seq_lens.to(at::kLong).contiguous();
  const int64_t* lp = loc.data_ptr<int64_t>();
  const int64_t* sp = lens.data_ptr<int64_t>();
  const int64_t num_seqs = loc.size(0) - 1;
  StepLayout layout;
  std::vector<int64_t> seqs, rows, row_lens;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q_len = lp[b + 1] - lp[b];
    TORCH_CHECK(q_len >= 1, "sequence ", b, " has no query rows in query_start_loc");
    if (q_len > 1) layout.all_decode = false;
    if (q_len <= kMaxDecodeKernelQueryLen) {
      for (int64_t i = 0; i < q_len; ++i) {
        seqs.push_back(b);
        rows.push_back(lp[b] + i);
        row_lens.push_back(sp[b] - q_len + 1 + i);
      }
    } else {
      layout.prefill_seqs.push_back(b);
      layout.starts.push_back(lp[b]);
      layout.q_lens.push_back(q_len);
    }
  }
  if (!layout.all_decode) {
    const auto opts = at::TensorOptions().dtype(at::kLong);
    const Tensor seq_index = at::tensor(seqs, opts);
    layout.decode_rows = at::tensor(rows, opts);
    layout.decode_tables = block_tables.index_select(0, seq_index).contiguous();
    layout.decode_lens = at::tensor(row_lens, opts).to(at::kInt);
    layout.decode_ids = at::arange(static_cast<int64_t>(rows.size()), opts);
  }
  return layout;
}

// The rows of prefilling sequences, as conveyor.kernels.reference.prefill_attention computes them
// (attention.cpp: a flash kernel in bfloat16 with AVX512_BF16, torch's otherwise).
void prefill_attention(const Tensor& out, const Tensor& query, const Tensor& key_cache,
                       const Tensor& value_cache, const Tensor& block_tables, const Tensor& seq_lens,
                       const StepLayout& layout, double scale) {
  const Tensor lens = seq_lens.to(at::kLong);
  const int64_t* lp = lens.data_ptr<int64_t>();
  std::vector<int64_t> lengths;
  for (const int64_t b : layout.prefill_seqs) lengths.push_back(lp[b]);
  conveyor::attention::prefill(out, query, key_cache, value_cache, block_tables, layout.prefill_seqs,
                               layout.q_lens, layout.starts, lengths, scale);
}

// The gated MLP's activation: SiLU(gate) * up or tanh-GELU(gate) * up, with the C++ kernels
// conveyor.server.model.models.llama.LlamaMLP calls too.
Tensor gated_activation(const Tensor& gate_up, int64_t activation) {
  if (activation == kSilu) {
    return conveyor::cpu::silu_and_mul(gate_up);
  }
  TORCH_CHECK(activation == kGeluTanh, "unknown activation ", activation);
  return conveyor::cpu::gelu_tanh_and_mul(gate_up);
}

// hidden: `[num_tokens, hidden_size]`, the embedded tokens. Returns the final RMSNorm of the last layer's
// residual stream, `[num_tokens, hidden_size]` in hidden's dtype.
//
// Per layer l: norm_weights[npl * l + 0..npl-1] with npl = norms_per_layer: input, post-attention, and
// with 4 the pre- and post-feedforward norms (sandwich norms); the last one is the final norm.
// qk_norm_weights: [2l] q's and [2l + 1] k's per-head norm, or none. linears[4l + 0..3]: q/k/v, o,
// gate/up, down. sliding_windows[l]: the tokens layer l attends to, 0 for the whole sequence; such a
// layer rotates with local_cos_sin_cache where one is given,
// and writes and reads its K/V through window_slot_mapping and window_block_tables where they are given
// (the sliding layers' own blocks). logits_soft_cap: attention scores become
// cap * tanh(s / cap). residual_multiplier scales each branch before it joins the residual stream
// (without sandwich norms). activation: kSilu or kGeluTanh. lora_a, lora_b: per layer the LoRA slots of
// q/k/v, o, gate/up and down (`4 * num_layers`, lora.cpp's layouts), or none; lora_ranks: each of their
// slots' ranks, projection by projection (0: the slot's adapter does not adapt it); lora_indices: each
// token's slot (-1: the base model), given with them: each projection's output gets its adapters' deltas.
//
// Raises the kernels' errors (a position outside the rotary table, a slot outside the cache), and an
// error for a step with prefill rows past kMaxDecodeKernelQueryLen when a layer slides or scores are
// soft-capped (the decode kernel applies both; prefill_attention neither).
Tensor decoder_layers(const Tensor& hidden, const Tensor& positions, const Tensor& cos_sin_cache,
                      const std::optional<Tensor>& local_cos_sin_cache, at::TensorList norm_weights,
                      int64_t norms_per_layer, at::TensorList qk_norm_weights, at::TensorList linear_weights,
                      const c10::List<std::optional<Tensor>>& linear_biases, at::IntArrayRef linear_kinds,
                      at::IntArrayRef linear_out_features, at::TensorList key_caches,
                      at::TensorList value_caches, const Tensor& slot_mapping, const Tensor& block_tables,
                      const std::optional<Tensor>& window_slot_mapping,
                      const std::optional<Tensor>& window_block_tables, const Tensor& query_start_loc, const Tensor& seq_lens, int64_t num_heads,
                      int64_t num_kv_heads, double eps, double scale, at::IntArrayRef sliding_windows,
                      std::optional<double> logits_soft_cap, double residual_multiplier, int64_t activation,
                      at::TensorList lora_a, at::TensorList lora_b, at::IntArrayRef lora_ranks,
                      const std::optional<Tensor>& lora_indices) {
  const int64_t num_layers = static_cast<int64_t>(key_caches.size());
  const int64_t npl = norms_per_layer;
  const auto count = [](auto list) { return static_cast<int64_t>(list.size()); };
  TORCH_CHECK((npl == 2 || npl == 4) && count(value_caches) == num_layers &&
                  count(norm_weights) == npl * num_layers + 1 &&
                  (qk_norm_weights.empty() || count(qk_norm_weights) == 2 * num_layers) &&
                  count(linear_weights) == 4 * num_layers && count(linear_biases) == 4 * num_layers &&
                  count(linear_kinds) == 4 * num_layers && count(linear_out_features) == 4 * num_layers &&
                  count(sliding_windows) == num_layers &&
                  (lora_a.empty() || (count(lora_a) == 4 * num_layers && count(lora_b) == 4 * num_layers)),
              "decoder_layers needs 2 or 4 norms, 4 linear layers, a window and one KV cache pair per layer, "
              "a final norm, and q/k norms and LoRA slots for every layer or none");
  const int64_t num_tokens = hidden.size(0);
  const int64_t head_dim = key_caches[0].size(3);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  // Sliding layers whose K/V has blocks of its own read them through the window tables.
  const bool own_window_blocks = window_slot_mapping.has_value() && window_slot_mapping->defined();
  TORCH_CHECK(own_window_blocks == (window_block_tables.has_value() && window_block_tables->defined()),
              "window_slot_mapping and window_block_tables come together");
  const StepLayout layout = step_layout(query_start_loc, seq_lens, block_tables);
  const StepLayout window_layout =
      own_window_blocks ? step_layout(query_start_loc, seq_lens, *window_block_tables) : StepLayout();
  // A window no sequence of the step reaches cuts nothing: a row at position p < max_len <= W sees 0..p.
  const int64_t max_len = seq_lens.numel() ? seq_lens.max().item<int64_t>() : 0;
  auto cuts = [max_len](int64_t w) { return w > 0 && w < max_len; };
  const bool windows = std::any_of(sliding_windows.begin(), sliding_windows.end(), cuts);
  TORCH_CHECK(layout.prefill_seqs.empty() || (!windows && !logits_soft_cap.has_value()),
              "a step with prefill rows of a model with sliding windows (shorter than the step's longest "
              "sequence) or soft caps runs the Python layers");
  const Tensor full_tables = block_tables.contiguous();
  const Tensor window_tables = own_window_blocks ? window_block_tables->contiguous() : full_tables;
  const bool lora = !lora_a.empty() && lora_indices.has_value() && lora_indices->defined();
  auto proj = [&](const Tensor& x, int64_t i) {
    Tensor y = linear(x, linear_weights[i], linear_biases.get(i), linear_kinds[i], linear_out_features[i]);
    if (!lora) return y;
    const int64_t out = y.size(1);
    std::vector<int64_t> slices{out};  // o and down: one slice; q/k/v and gate/up: their parts
    if (i % 4 == 0) slices = {q_size, kv_size, kv_size};
    if (i % 4 == 2) slices = {out / 2, out / 2};
    const int64_t slots = lora_a[i].size(0);
    return conveyor::lora::add_lora(y.contiguous(), x, lora_a[i], lora_b[i], *lora_indices, slices,
                                    lora_ranks.slice(i * slots, slots));
  };
  auto head_norm = [&](const Tensor& x, int64_t i, int64_t heads) {
    return conveyor::cpu::rms_norm(x.reshape({-1, head_dim}), qk_norm_weights[i], eps)
        .view({num_tokens, heads, head_dim});
  };

  Tensor x = hidden, residual;
  for (int64_t l = 0; l < num_layers; ++l) {
    const Tensor* norm = &norm_weights[npl * l];
    Tensor normed;
    if (l == 0) {
      normed = conveyor::cpu::rms_norm(x, norm[0], eps);
      residual = x;
    } else {
      std::tie(normed, residual) = conveyor::cpu::fused_add_rms_norm(x, residual, norm[0], eps);
    }
    const Tensor qkv = proj(normed, 4 * l);
    Tensor q = qkv.narrow(1, 0, q_size).view({num_tokens, num_heads, head_dim});
    Tensor k = qkv.narrow(1, q_size, kv_size).view({num_tokens, num_kv_heads, head_dim});
    const Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({num_tokens, num_kv_heads, head_dim});
    if (!qk_norm_weights.empty()) {
      q = head_norm(q, 2 * l, num_heads);
      k = head_norm(k, 2 * l + 1, num_kv_heads);
    }
    const int64_t window = sliding_windows[l];
    const bool local = window > 0 && local_cos_sin_cache.has_value() && local_cos_sin_cache->defined();
    std::tie(q, k) = conveyor::cpu::rotary_embedding(positions, q, k, local ? *local_cos_sin_cache : cos_sin_cache);
    const bool own = window > 0 && own_window_blocks;
    const StepLayout& lay = own ? window_layout : layout;
    const Tensor& tables = own ? window_tables : full_tables;
    conveyor::cpu::reshape_and_cache(k, v, key_caches[l], value_caches[l], own ? *window_slot_mapping : slot_mapping);
    const Tensor attn = at::empty(q.sizes(), q.options());
    const std::optional<int64_t> layer_window = cuts(window) ? std::optional<int64_t>(window) : std::nullopt;
    if (lay.all_decode) {
      conveyor::cpu::paged_decode_attention(attn, q, key_caches[l], value_caches[l], tables, seq_lens,
                                            std::nullopt, std::nullopt, scale, layer_window, logits_soft_cap);
    } else {
      if (lay.decode_rows.numel() > 0) {
        conveyor::cpu::paged_decode_attention(attn, q, key_caches[l], value_caches[l], lay.decode_tables,
                                              lay.decode_lens, lay.decode_ids, lay.decode_rows, scale,
                                              layer_window, logits_soft_cap);
      }
      prefill_attention(attn, q, key_caches[l], value_caches[l], tables, seq_lens, lay, scale);
    }
    Tensor o = proj(attn.view({num_tokens, q_size}), 4 * l + 1);
    if (npl == 4) {  // Gemma 2/3: the branch is normed before it joins, and the MLP's output too
      std::tie(normed, residual) =
          conveyor::cpu::fused_add_rms_norm(conveyor::cpu::rms_norm(o, norm[1], eps), residual, norm[2], eps);
      x = conveyor::cpu::rms_norm(proj(gated_activation(proj(normed, 4 * l + 2), activation), 4 * l + 3),
                                  norm[3], eps);
      continue;
    }
    if (residual_multiplier != 1.0) {  // Granite
      o = o * residual_multiplier;
    }
    std::tie(normed, residual) = conveyor::cpu::fused_add_rms_norm(o, residual, norm[1], eps);
    x = proj(gated_activation(proj(normed, 4 * l + 2), activation), 4 * l + 3);
    if (residual_multiplier != 1.0) {
      x = x * residual_multiplier;
    }
  }
  return std::get<0>(
      conveyor::cpu::fused_add_rms_norm(x, residual, norm_weights[npl * num_layers], eps));
}

}  // namespace

TORCH_LIBRARY(conveyor_decoder, m) {
  m.def(
      "decoder_layers(Tensor hidden, Tensor positions, Tensor cos_sin_cache, Tensor? local_cos_sin_cache, "
      "Tensor[] norm_weights, int norms_per_layer, Tensor[] qk_norm_weights, Tensor[] linear_weights, "
      "Tensor?[] linear_biases, int[] linear_kinds, int[] linear_out_features, Tensor(a!)[] key_caches, "
      "Tensor(b!)[] value_caches, Tensor slot_mapping, Tensor block_tables, Tensor? window_slot_mapping, "
      "Tensor? window_block_tables, Tensor query_start_loc, "
      "Tensor seq_lens, int num_heads, int num_kv_heads, float eps, float scale, int[] sliding_windows, "
      "float? logits_soft_cap, float residual_multiplier, int activation, Tensor[] lora_a, Tensor[] lora_b, "
      "int[] lora_ranks, Tensor? lora_indices) -> Tensor",
      &decoder_layers);
}
