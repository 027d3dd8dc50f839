// CPU kernels for the model's hot paths: the `cpu` backend (conveyor.kernels.cpu), with the signatures and
// layouts of conveyor.kernels.reference (vLLM's).
//
// Why they exist: at decode batch sizes each torch op of the reference costs microseconds of dispatch and
// allocates its own intermediate, and the paged decode attention copies every sequence's K and V before
// reading them. Here each kernel is one pass over its data. Arithmetic is float32 and results are rounded
// to the tensor dtype at the same points as the reference, so both backends agree to the dtype's rounding.
//
// Layouts: packed tokens `[num_tokens, ...]`; KV cache of one layer `[num_blocks, block_size, num_kv_heads,
// head_dim]` contiguous; `slot = block_id * block_size + offset`; block_tables `[num_seqs, max_blocks]`
// int32; seq_lens `[num_seqs]` int32 (context length including this step's token).

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_kernels.h"
#include "simd.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <vector>

// The op namespace; a test builds this file a second time for AVX2 under another name.
#ifndef CONVEYOR_CPU_NAMESPACE
#define CONVEYOR_CPU_NAMESPACE conveyor_cpu
#endif
#define CONVEYOR_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)

namespace conveyor::cpu {

using at::Tensor;
using simd::prefetch;
#if defined(CONVEYOR_SIMD_VECTOR)
using simd::exp_ps;
using simd::Simd;
#endif

// Rows per at::parallel_for task: small batches stay on the calling thread.
constexpr int64_t kRowGrain = 16;
constexpr int64_t kPrefetchBlocks = 2;  // KV blocks fetched ahead of the one being computed

template <typename T>
inline float load(const T* p, int64_t i) {
  return static_cast<float>(p[i]);
}

// The value a float32 result has after a round trip through T (the reference's intermediate rounding).
template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    dst[i] = static_cast<float>(src[i]);
  }
}

#if defined(CONVEYOR_SIMD_VECTOR)
// The vector counterpart of round_to<T>.
template <typename T>
inline Simd::Vec round_to(Simd::Vec x) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return Simd::round_bf16(x);
  } else {
    return x;
  }
}

#endif

#if defined(CONVEYOR_SIMD_AVX512)
inline float dot(const float* a, const float* b, int64_t n) {
  Simd::Vec acc = Simd::zero();
  int64_t i = 0;
  for (; i + Simd::kLanes <= n; i += Simd::kLanes) {
    acc = Simd::fmadd(Simd::load(a + i), Simd::load(b + i), acc);
  }
  float sum = Simd::reduce_add(acc);
  for (; i < n; ++i) {
    sum += a[i] * b[i];
  }
  return sum;
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
  const Simd::Vec a = Simd::set1(alpha);
  int64_t i = 0;
  for (; i + Simd::kLanes <= n; i += Simd::kLanes) {
    Simd::store(y + i, Simd::fmadd(a, Simd::load(x + i), Simd::load(y + i)));
  }
  for (; i < n; ++i) {
    y[i] += alpha * x[i];
  }
}

template <>
inline void to_float<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + Simd::kLanes <= n; i += Simd::kLanes) {
    Simd::store(dst + i, Simd::load(src + i));
  }
  for (; i < n; ++i) {
    dst[i] = static_cast<float>(src[i]);
  }
}

#else
inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    sum += a[i] * b[i];
  }
  return sum;
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    y[i] += alpha * x[i];
  }
}

#endif

#if defined(CONVEYOR_SIMD_VECTOR)
// s[0..n) = softmax(s[0..n)) in float32, in place.
inline void softmax(float* s, int64_t n) {
  using Vec = Simd::Vec;
  constexpr int64_t L = Simd::kLanes;
  Vec vmax = Simd::set1(-INFINITY);
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    vmax = Simd::max(vmax, Simd::load(s + i));
  }
  float max_score = Simd::reduce_max(vmax);
  for (; i < n; ++i) {
    max_score = std::max(max_score, s[i]);
  }
  const Vec m = Simd::set1(max_score);
  Vec vsum = Simd::zero();
  for (i = 0; i + L <= n; i += L) {
    const Vec e = exp_ps(Simd::sub(Simd::load(s + i), m));
    Simd::store(s + i, e);
    vsum = Simd::add(vsum, e);
  }
  float sum = Simd::reduce_add(vsum);
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - max_score);
    sum += s[i];
  }
  const Vec inv = Simd::set1(1.f / sum);
  for (i = 0; i + L <= n; i += L) {
    Simd::store(s + i, Simd::mul(Simd::load(s + i), inv));
  }
  for (; i < n; ++i) {
    s[i] /= sum;
  }
}
#else
inline void softmax(float* s, int64_t n) {
  const float max_score = *std::max_element(s, s + n);
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    s[i] = std::exp(s[i] - max_score);
    sum += s[i];
  }
  for (int64_t i = 0; i < n; ++i) {
    s[i] /= sum;
  }
}
#endif

// s[0..n) = cap * tanh(s[0..n) / cap) (Gemma 2's attention soft-capping) when cap > 0; else unchanged.
inline void soft_cap(float* s, int64_t n, float cap) {
  if (cap <= 0.f) {
    return;
  }
  const float inv = 1.f / cap;
  for (int64_t i = 0; i < n; ++i) {
    s[i] = cap * std::tanh(s[i] * inv);
  }
}

// The attention options of paged_decode_attention, resolved once per call: the first key position a
// decode row of context `len` reads (its sliding window's, or 0), and the soft cap (0: none).
struct AttentionOptions {
  int64_t window = 0;  // 0: no sliding window
  float cap = 0.f;     // 0: no soft cap
  int64_t first_key(int64_t len) const { return window > 0 ? std::max<int64_t>(0, len - window) : 0; }
};

void check_cpu(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor (the cpu kernel backend)");
}

void check_rows(const Tensor& t, const char* name) {
  check_cpu(t, name);
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name,
              " must be [num_tokens, hidden] with unit stride in hidden");
}

void check_heads(const Tensor& t, const char* name) {
  check_cpu(t, name);
  TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1, name,
              " must be [num_tokens, num_heads, head_dim] with unit stride in head_dim");
}

// ---------------------------------------------------------------------------------------------- norms

// The sum of squares of x[0..n) in float32 (vector lanes, then the tail).
template <typename T>
inline float sum_of_squares(const T* x, int64_t n) {
  int64_t i = 0;
  float sum = 0.f;
#if defined(CONVEYOR_SIMD_VECTOR)
  if constexpr (simd::kVectorType<T>) {
    Simd::Vec acc = Simd::zero();
    for (; i + Simd::kLanes <= n; i += Simd::kLanes) {
      const Simd::Vec v = Simd::load(x + i);
      acc = Simd::fmadd(v, v, acc);
    }
    sum = Simd::reduce_add(acc);
  }
#endif
  for (; i < n; ++i) {
    const float v = load(x, i);
    sum += v * v;
  }
  return sum;
}

// dst[i] = weight[i] * T(x[i] * inv) for i < n.
template <typename T>
inline void scale_row(const T* x, const T* weight, float inv, T* dst, int64_t n) {
  int64_t i = 0;
#if defined(CONVEYOR_SIMD_VECTOR)
  if constexpr (simd::kVectorType<T>) {
    const Simd::Vec v_inv = Simd::set1(inv);
    for (; i + Simd::kLanes <= n; i += Simd::kLanes) {
      Simd::store(dst + i, Simd::mul(Simd::load(weight + i), round_to<T>(Simd::mul(Simd::load(x + i), v_inv))));
    }
  }
#endif
  for (; i < n; ++i) {
    dst[i] = static_cast<T>(load(weight, i) * round_to<T>(load(x, i) * inv));
  }
}

// out[t] = weight * T(x[t] * rsqrt(mean(x[t]^2) + eps)), as reference.rms_norm rounds it.
template <typename T>
void rms_norm_rows(const T* x, int64_t x_stride, const T* weight, T* out, int64_t num_tokens, int64_t hidden,
                   double eps) {
  at::parallel_for(0, num_tokens, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* row = x + t * x_stride;
      const float sum = sum_of_squares(row, hidden);
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + static_cast<float>(eps));
      scale_row(row, weight, inv, out + t * hidden, hidden);
    }
  });
}

// summed[t] = T(x[t] + residual[t]), out[t] = rms_norm(summed[t]); per row the rounded sum is written and
// squared in one pass, then normalized from the (cached) sum.
template <typename T>
void add_rms_norm_rows(const T* xp, int64_t x_stride, const T* rp, int64_t r_stride, const T* weight, T* summed,
                       T* out, int64_t num_tokens, int64_t hidden, double eps) {
  at::parallel_for(0, num_tokens, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* xr = xp + t * x_stride;
      const T* rr = rp + t * r_stride;
      T* dst = summed + t * hidden;
      int64_t i = 0;
      float sum = 0.f;
#if defined(CONVEYOR_SIMD_VECTOR)
      if constexpr (simd::kVectorType<T>) {
        Simd::Vec acc = Simd::zero();
        for (; i + Simd::kLanes <= hidden; i += Simd::kLanes) {
          const Simd::Vec v = round_to<T>(Simd::add(Simd::load(xr + i), Simd::load(rr + i)));
          Simd::store(dst + i, v);
          acc = Simd::fmadd(v, v, acc);
        }
        sum = Simd::reduce_add(acc);
      }
#endif
      for (; i < hidden; ++i) {
        dst[i] = static_cast<T>(load(xr, i) + load(rr, i));
        const float v = load(dst, i);
        sum += v * v;
      }
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + static_cast<float>(eps));
      scale_row(dst, weight, inv, out + t * hidden, hidden);
    }
  });
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be [hidden_size] in x's dtype");
  const Tensor w = weight.contiguous();
  Tensor out = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), w.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), x.size(0), x.size(1), eps);
  });
  return out;
}

// residual' = T(x + residual); returns (rms_norm(residual'), residual'), as reference.fused_add_rms_norm.
std::tuple<Tensor, Tensor> fused_add_rms_norm(const Tensor& x, const Tensor& residual, const Tensor& weight,
                                              double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "x and residual must have the same shape and dtype");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be [hidden_size] in x's dtype");
  const Tensor w = weight.contiguous();
  Tensor summed = at::empty(x.sizes(), x.options());
  Tensor out = at::empty(x.sizes(), x.options());
  const int64_t num_tokens = x.size(0), hidden = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fused_add_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* rp = residual.data_ptr<scalar_t>();
    scalar_t* sp = summed.data_ptr<scalar_t>();
    add_rms_norm_rows<scalar_t>(xp, x.stride(0), rp, residual.stride(0), w.data_ptr<scalar_t>(), sp,
                                out.data_ptr<scalar_t>(), num_tokens, hidden, eps);
  });
  return {out, summed};
}

// ------------------------------------------------------------------------------------ rotary, SiLU-mul

// GPT-NeoX layout: the first and second halves of the rotated width (the table's, at most head_dim) are
// the rotated pairs; a head's dims past it are copied unchanged (partial rotary).
template <typename T>
void rotate_heads(const Tensor& x, const Tensor& out, const int64_t* positions, const float* cos_sin,
                  int64_t table_stride) {
  const int64_t num_tokens = x.size(0), num_heads = x.size(1), head_dim = x.size(2), half = table_stride / 2;
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, num_tokens, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = cos_sin + positions[t] * table_stride;
      const float* sin = cos + half;
      for (int64_t h = 0; h < num_heads; ++h) {
        const T* src = xp + t * x.stride(0) + h * x.stride(1);
        T* dst = op + (t * num_heads + h) * head_dim;
        int64_t i = 0;
#if defined(CONVEYOR_SIMD_VECTOR)
        if constexpr (simd::kVectorType<T>) {
          for (; i + Simd::kLanes <= half; i += Simd::kLanes) {
            const Simd::Vec x1 = Simd::load(src + i), x2 = Simd::load(src + i + half);
            const Simd::Vec c = Simd::load(cos + i), s = Simd::load(sin + i);
            Simd::store(dst + i, Simd::sub(Simd::mul(x1, c), Simd::mul(x2, s)));
            Simd::store(dst + i + half, Simd::add(Simd::mul(x2, c), Simd::mul(x1, s)));
          }
        }
#endif
        for (; i < half; ++i) {
          const float x1 = load(src, i), x2 = load(src, i + half);
          dst[i] = static_cast<T>(x1 * cos[i] - x2 * sin[i]);
          dst[i + half] = static_cast<T>(x2 * cos[i] + x1 * sin[i]);
        }
        for (int64_t i = 2 * half; i < head_dim; ++i) dst[i] = src[i];
      }
    }
  });
}

std::tuple<Tensor, Tensor> rotary_embedding(const Tensor& positions, const Tensor& query, const Tensor& key,
                                            const Tensor& cos_sin_cache) {
  check_heads(query, "query");
  check_heads(key, "key");
  check_cpu(positions, "positions");
  TORCH_CHECK(
      positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.size(0) == query.size(0),
      "positions must be [num_tokens] int64");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.dim() == 2 &&
                  cos_sin_cache.size(1) <= query.size(2) && cos_sin_cache.size(1) % 2 == 0 &&
                  cos_sin_cache.size(1) > 0 && key.size(2) == query.size(2),
              "cos_sin_cache must be [max_position, rotary_dim] float32, rotary_dim even and at most head_dim");
  const Tensor pos = positions.contiguous();
  const Tensor table = cos_sin_cache.contiguous();
  const int64_t max_position = table.size(0);
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < pos.size(0); ++t) {
    TORCH_CHECK(pp[t] >= 0 && pp[t] < max_position, "position ", pp[t], " is outside the rotary table of ",
                max_position, " positions");
  }
  Tensor q_out = at::empty(query.sizes(), query.options());
  Tensor k_out = at::empty(key.sizes(), key.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "rotary_embedding", [&] {
    rotate_heads<scalar_t>(query, q_out, pp, table.data_ptr<float>(), table.size(1));
    rotate_heads<scalar_t>(key, k_out, pp, table.data_ptr<float>(), table.size(1));
  });
  return {q_out, k_out};
}

// 2 sqrt(2 / pi): tanh GELU is g * sigmoid(kGelu2Z * (g + 0.044715 g^3)), as (1 + tanh(t)) / 2 =
// sigmoid(2 t) (Hendrycks & Gimpel's tanh approximation, torch's gelu(approximate="tanh")).
constexpr float kGelu2Z = 1.5957691216057308f;
constexpr float kGeluCubic = 0.044715f;

// dst[i] = T(act(gate[i])) * up[i] for i < n, act = SiLU, or tanh GELU with gelu: both g * sigmoid(z),
// z = g or kGelu2Z * g * (1 + 0.044715 g^2).
template <typename T>
void gated_row(const T* gate, const T* up, T* dst, int64_t n, bool gelu) {
  int64_t i = 0;
#if defined(CONVEYOR_SIMD_VECTOR)
  if constexpr (simd::kVectorType<T>) {
    const Simd::Vec one = Simd::set1(1.f), two_z = Simd::set1(kGelu2Z), cubic = Simd::set1(kGeluCubic);
    for (; i + Simd::kLanes <= n; i += Simd::kLanes) {
      const Simd::Vec g = Simd::load(gate + i);
      const Simd::Vec z =
          gelu ? Simd::mul(Simd::mul(g, two_z), Simd::fmadd(Simd::mul(g, g), cubic, one)) : g;
      const Simd::Vec act = Simd::div(g, Simd::add(one, exp_ps(Simd::sub(Simd::zero(), z))));
      Simd::store(dst + i, Simd::mul(round_to<T>(act), Simd::load(up + i)));
    }
  }
#endif
  for (; i < n; ++i) {
    const float g = load(gate, i);
    const float z = gelu ? g * kGelu2Z * (1.f + kGeluCubic * g * g) : g;
    dst[i] = static_cast<T>(round_to<T>(g / (1.f + std::exp(-z))) * load(up, i));
  }
}

Tensor gated_and_mul(const Tensor& x, bool gelu) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x must be [num_tokens, 2 * intermediate_size]");
  const int64_t num_tokens = x.size(0), inter = x.size(1) / 2;
  Tensor out = at::empty({num_tokens, inter}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gated_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, num_tokens, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* gate = xp + t * x.stride(0);
        gated_row(gate, gate + inter, op + t * inter, inter, gelu);
      }
    });
  });
  return out;
}

// out = T(silu(gate)) * up, as reference.silu_and_mul rounds it.
Tensor silu_and_mul(const Tensor& x) { return gated_and_mul(x, false); }

// out = T(gelu_tanh(gate)) * up, as reference.gelu_tanh_and_mul rounds it.
Tensor gelu_tanh_and_mul(const Tensor& x) { return gated_and_mul(x, true); }

// ----------------------------------------------------------------------------------------- KV cache

void reshape_and_cache(const Tensor& key, const Tensor& value, const Tensor& key_cache,
                       const Tensor& value_cache, const Tensor& slot_mapping) {
  check_heads(key, "key");
  check_heads(value, "value");
  check_cpu(key_cache, "key_cache");
  check_cpu(slot_mapping, "slot_mapping");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "KV caches must be contiguous");
  TORCH_CHECK(
      key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == value_cache.scalar_type(),
      "key/value must have the caches' dtype");
  TORCH_CHECK(key.size(1) == key_cache.size(2) && key.size(2) == key_cache.size(3) &&
                  value.sizes() == key.sizes() && value_cache.sizes() == key_cache.sizes(),
              "key/value must be [num_tokens, num_kv_heads, head_dim] of the caches' shape");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == key.size(0),
              "slot_mapping must be [num_tokens] int64");
  const Tensor slots = slot_mapping.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t num_kv_heads = key.size(1), head_dim = key.size(2), slot_size = num_kv_heads * head_dim;
  for (int64_t t = 0; t < slots.size(0); ++t) {
    TORCH_CHECK(sp[t] < num_slots, "slot ", sp[t], " is outside the cache's ", num_slots, " slots");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "reshape_and_cache", [&] {
    const size_t row_bytes = head_dim * sizeof(scalar_t);
    for (const auto& [src, cache] : {std::pair{&key, &key_cache}, std::pair{&value, &value_cache}}) {
      const scalar_t* s = src->data_ptr<scalar_t>();
      scalar_t* c = cache->data_ptr<scalar_t>();
      for (int64_t t = 0; t < slots.size(0); ++t) {
        if (sp[t] < 0) {
          continue;  // vLLM's padding convention: a negative slot is not written
        }
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          std::memcpy(c + sp[t] * slot_size + h * head_dim, s + t * src->stride(0) + h * src->stride(1),
                      row_bytes);
        }
      }
    }
  });
}

// ------------------------------------------------------------------------------- decode attention

// Each decode sequence walks its block table once for K and once for V: every slot (all KV heads) is
// converted to float32 once and used by all query heads of its group, and the next blocks are prefetched
// because blocks sit anywhere in the cache. Only positions below the sequence's length are read, so
// never-written slots are never touched; with a sliding window the walk starts at the window's first
// key, so blocks wholly before it are never read either. Scores (soft-capped when asked), softmax and
// the weighted sum of values are float32, as in vLLM's CPU and CUDA paged-attention kernels.
template <typename T>
void decode_attention(const Tensor& out, const Tensor& query, const Tensor& key_cache,
                      const Tensor& value_cache, const Tensor& block_tables, const Tensor& seq_lens,
                      const int64_t* ids, const int64_t* rows, int64_t num_decode, double scale,
                      AttentionOptions options) {
  const int64_t num_heads = query.size(1);
  const int64_t head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2);
  const int64_t groups = num_heads / num_kv_heads;  // query heads per KV head
  const int64_t slot_size = num_kv_heads * head_dim;
  const int64_t block_elems = block_size * slot_size;
  const int64_t max_blocks = block_tables.size(1);
  const T* q_ptr = query.data_ptr<T>();
  const T* k_ptr = key_cache.data_ptr<T>();
  const T* v_ptr = value_cache.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();

  at::parallel_for(0, num_decode, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(num_heads * head_dim), acc(num_heads * head_dim), slot(slot_size), scores;
    for (int64_t d = begin; d < end; ++d) {
      const int64_t seq = ids ? ids[d] : d;
      const int64_t row = rows ? rows[d] : d;
      const int64_t len = lens[seq];
      const int32_t* table = tables + seq * max_blocks;
      const int64_t num_blocks = (len + block_size - 1) / block_size;
      const int64_t begin = options.first_key(len), n = len - begin;  // keys begin .. len - 1
      const int64_t first_block = begin / block_size;
      for (int64_t h = 0; h < num_heads; ++h) {
        to_float(q_ptr + row * query.stride(0) + h * query.stride(1), q.data() + h * head_dim, head_dim);
        for (int64_t x = 0; x < head_dim; ++x) {
          q[h * head_dim + x] *= static_cast<float>(scale);
        }
      }
      scores.resize(num_heads * n);  // scores[h * n + t - begin]
      const int64_t walked = num_blocks - first_block;  // blocks holding keys begin .. len - 1
      for (int64_t b = first_block; b < first_block + std::min(kPrefetchBlocks, walked); ++b) {
        prefetch(k_ptr + table[b] * block_elems, block_elems);
      }
      for (int64_t b = first_block; b < num_blocks; ++b) {
        const int64_t ahead = b - first_block + kPrefetchBlocks;  // walk index of the block fetched now
        if (ahead < walked) {
          prefetch(k_ptr + table[first_block + ahead] * block_elems, block_elems);
        } else if (ahead - walked < walked) {
          prefetch(v_ptr + table[first_block + ahead - walked] * block_elems, block_elems);
        }
        const int64_t first = std::max(b * block_size, begin);
        const int64_t count = std::min((b + 1) * block_size, len) - first;
        const T* base = k_ptr + table[b] * block_elems + (first - b * block_size) * slot_size;
        for (int64_t i = 0; i < count; ++i) {
          to_float(base + i * slot_size, slot.data(), slot_size);
          for (int64_t h = 0; h < num_heads; ++h) {
            scores[h * n + first - begin + i] =
                dot(q.data() + h * head_dim, slot.data() + (h / groups) * head_dim, head_dim);
          }
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        soft_cap(scores.data() + h * n, n, options.cap);
        softmax(scores.data() + h * n, n);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = first_block; b < num_blocks; ++b) {
        if (b + kPrefetchBlocks < num_blocks) {
          prefetch(v_ptr + table[b + kPrefetchBlocks] * block_elems, block_elems);
        }
        const int64_t first = std::max(b * block_size, begin);
        const int64_t count = std::min((b + 1) * block_size, len) - first;
        const T* base = v_ptr + table[b] * block_elems + (first - b * block_size) * slot_size;
        for (int64_t i = 0; i < count; ++i) {
          to_float(base + i * slot_size, slot.data(), slot_size);
          for (int64_t h = 0; h < num_heads; ++h) {
            axpy(scores[h * n + first - begin + i], slot.data() + (h / groups) * head_dim,
                 acc.data() + h * head_dim, head_dim);
          }
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        T* dst = out_ptr + row * out.stride(0) + h * out.stride(1);
        for (int64_t x = 0; x < head_dim; ++x) {
          dst[x] = static_cast<T>(acc[h * head_dim + x]);
        }
      }
    }
  });
}

#if defined(CONVEYOR_SIMD_VECTOR)
constexpr int64_t kPrefetchTokens = 16;  // how far ahead K and V rows are fetched

// The same attention as decode_attention, for head_dim = kLanes * V, in vector registers: one task per
// (decode sequence, KV head), so a step's work splits evenly over threads whatever the lengths. Each K
// row is widened to float32 once for the group's query heads; their dot products are finished kLanes
// tokens at a time (Simd::reduce); the weighted sum of V rows accumulates in registers, kHeadsPerPass
// heads per pass over V. Scores, softmax and sums are float32 as in decode_attention; only the order of
// additions inside a dot product differs. With a sliding window only keys from the window's first on
// are read, as there.
template <typename T, int V>
void decode_attention_vec(const Tensor& out, const Tensor& query, const Tensor& key_cache,
                          const Tensor& value_cache, const Tensor& block_tables, const Tensor& seq_lens,
                          const int64_t* ids, const int64_t* rows, int64_t num_decode, double scale,
                          AttentionOptions options) {
  using Vec = Simd::Vec;
  constexpr int64_t L = Simd::kLanes, H = Simd::kHeadsPerPass, head_dim = L * V;
  const int64_t num_heads = query.size(1);
  const int64_t block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2);
  const int64_t groups = num_heads / num_kv_heads;
  const int64_t slot_size = num_kv_heads * head_dim;
  const int64_t block_elems = block_size * slot_size;
  const int64_t max_blocks = block_tables.size(1);
  const T* q_ptr = query.data_ptr<T>();
  const T* k_ptr = key_cache.data_ptr<T>();
  const T* v_ptr = value_cache.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const Vec vscale = Simd::set1(static_cast<float>(scale));
  // Contexts differ by 10x and more, so a static split leaves one thread waiting for the other: the
  // threads take tasks one at a time, most keys to read first.
  auto keys_read = [&](int64_t d) {
    const int64_t len = lens[ids ? ids[d] : d];
    return len - options.first_key(len);
  };
  std::vector<int64_t> order(num_decode);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return keys_read(a) > keys_read(b); });
  const int64_t num_tasks = num_decode * num_kv_heads;
  std::atomic<int64_t> next_task{0};

  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<Vec> q(groups * V), partial(groups * L);
    std::vector<float> scores, result(head_dim);
    for (int64_t task = next_task++; task < num_tasks; task = next_task++) {
      const int64_t d = order[task / num_kv_heads], kv = task % num_kv_heads;
      const int64_t seq = ids ? ids[d] : d;
      const int64_t row = rows ? rows[d] : d;
      const int64_t len = lens[seq];
      const int64_t begin = options.first_key(len), n = len - begin;  // keys begin .. len - 1
      const int32_t* table = tables + seq * max_blocks;
      const int64_t head0 = kv * groups;
      // Row t of this KV head in the K or V cache (blocks sit anywhere, so rows ahead are fetched by hand).
      auto cache_row = [&](const T* cache, int64_t t) {
        return cache + table[t / block_size] * block_elems + (t % block_size) * slot_size + kv * head_dim;
      };
      for (int64_t g = 0; g < groups; ++g) {
        const T* src = q_ptr + row * query.stride(0) + (head0 + g) * query.stride(1);
        for (int v = 0; v < V; ++v) {
          q[g * V + v] = Simd::mul(Simd::load(src + L * v), vscale);
        }
      }
      const int64_t padded = (n + L - 1) / L * L;
      scores.resize(groups * padded);  // scores[g * padded + t - begin]
      // Between two attentions the matmuls stream every layer's weights through the caches, so this
      // task's K and V rows come from memory, scattered over its blocks: a row at a time, 16 ahead,
      // kept too few reads in flight (on a 2-core EPYC the embedded model's attention ran at 10 GB/s
      // after a layer's MLP, 35 GB/s when its KV was still cached). So every K row is requested into
      // L2 up front, and each V row while its K row is scored; the nearer L1 prefetches stay.
      for (int64_t t = begin; t < len; ++t) prefetch<2>(cache_row(k_ptr, t), head_dim);
      for (int64_t t0 = begin; t0 < len; t0 += L) {
        for (int64_t i = 0; i < L; ++i) {
          const int64_t t = t0 + i;
          if (t >= len) {
            for (int64_t g = 0; g < groups; ++g) partial[g * L + i] = Simd::zero();
            continue;
          }
          if (t + kPrefetchTokens < len) prefetch(cache_row(k_ptr, t + kPrefetchTokens), head_dim);
          prefetch<2>(cache_row(v_ptr, t), head_dim);
          const T* k = cache_row(k_ptr, t);
          Vec kf[V];
          for (int v = 0; v < V; ++v) kf[v] = Simd::load(k + L * v);
          for (int64_t g = 0; g < groups; ++g) {
            Vec acc = Simd::mul(q[g * V], kf[0]);
            for (int v = 1; v < V; ++v) acc = Simd::fmadd(q[g * V + v], kf[v], acc);
            partial[g * L + i] = acc;
          }
        }
        for (int64_t g = 0; g < groups; ++g) {
          Simd::store(scores.data() + g * padded + t0 - begin, Simd::reduce(partial.data() + g * L));
        }
      }
      for (int64_t g = 0; g < groups; ++g) {
        soft_cap(scores.data() + g * padded, n, options.cap);
        softmax(scores.data() + g * padded, n);
      }
      for (int64_t g0 = 0; g0 < groups; g0 += H) {
        const int64_t heads = std::min(H, groups - g0);
        Vec acc[H][V];
        for (int64_t h = 0; h < H; ++h)
          for (int v = 0; v < V; ++v) acc[h][v] = Simd::zero();
        const float* s0 = scores.data() + g0 * padded;
        for (int64_t t = begin; t < len; ++t) {
          if (t + kPrefetchTokens < len) prefetch(cache_row(v_ptr, t + kPrefetchTokens), head_dim);
          const T* vrow = cache_row(v_ptr, t);
          Vec p[H];
          for (int64_t h = 0; h < heads; ++h) p[h] = Simd::set1(s0[h * padded + t - begin]);
          for (int v = 0; v < V; ++v) {
            const Vec vf = Simd::load(vrow + L * v);
            acc[0][v] = Simd::fmadd(p[0], vf, acc[0][v]);
            for (int64_t h = 1; h < heads; ++h) acc[h][v] = Simd::fmadd(p[h], vf, acc[h][v]);
          }
        }
        for (int64_t h = 0; h < heads; ++h) {
          for (int v = 0; v < V; ++v) Simd::store(result.data() + L * v, acc[h][v]);
          T* dst = out_ptr + row * out.stride(0) + (head0 + g0 + h) * out.stride(1);
          for (int64_t x = 0; x < head_dim; ++x) dst[x] = static_cast<T>(result[x]);
        }
      }
    }
  });
}

#endif

// Writes out[query_rows[i]] for decode sequence seq_ids[i]; without seq_ids/query_rows, every sequence is
// a decode and sequence i's query is row i. sliding_window W: the row (at position len - 1) reads keys
// len - W .. len - 1 only; logits_soft_cap: scores s become cap * tanh(s / cap) before the softmax.
void paged_decode_attention(const Tensor& out, const Tensor& query, const Tensor& key_cache,
                            const Tensor& value_cache, const Tensor& block_tables, const Tensor& seq_lens,
                            const std::optional<Tensor>& seq_ids, const std::optional<Tensor>& query_rows,
                            double scale, std::optional<int64_t> sliding_window,
                            std::optional<double> logits_soft_cap) {
  check_heads(query, "query");
  check_heads(out, "out");
  check_cpu(key_cache, "key_cache");
  check_cpu(block_tables, "block_tables");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "KV caches must be contiguous");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && out.scalar_type() == query.scalar_type() &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "query, out and the KV caches must share a dtype");
  TORCH_CHECK(query.size(2) == key_cache.size(3) && query.size(1) % key_cache.size(2) == 0,
              "num_heads must be a multiple of num_kv_heads and head_dim must match the caches");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(seq_ids.has_value() == query_rows.has_value(), "pass both seq_ids and query_rows, or neither");
  TORCH_CHECK(!sliding_window.has_value() || *sliding_window >= 1, "sliding_window must be at least 1, got ",
              sliding_window.value_or(0));
  TORCH_CHECK(!logits_soft_cap.has_value() || *logits_soft_cap > 0, "logits_soft_cap must be positive, got ",
              logits_soft_cap.value_or(0));
  AttentionOptions options;
  options.window = sliding_window.value_or(0);
  options.cap = static_cast<float>(logits_soft_cap.value_or(0));
  const Tensor tables = block_tables.contiguous();
  const Tensor lens = seq_lens.contiguous();
  const int64_t num_seqs = lens.size(0);
  Tensor ids, rows;
  int64_t num_decode = num_seqs;
  if (seq_ids.has_value()) {
    ids = seq_ids->to(at::kLong).contiguous();
    rows = query_rows->to(at::kLong).contiguous();
    num_decode = ids.size(0);
    TORCH_CHECK(rows.size(0) == num_decode, "seq_ids and query_rows must have the same length");
  } else {
    TORCH_CHECK(query.size(0) == num_seqs, "without seq_ids every sequence must have exactly one query row");
  }
  const int64_t* id_ptr = ids.defined() ? ids.data_ptr<int64_t>() : nullptr;
  const int64_t* row_ptr = rows.defined() ? rows.data_ptr<int64_t>() : nullptr;
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int64_t capacity = tables.size(1) * key_cache.size(1);
  for (int64_t d = 0; d < num_decode; ++d) {
    const int64_t seq = id_ptr ? id_ptr[d] : d;
    const int64_t row = row_ptr ? row_ptr[d] : d;
    TORCH_CHECK(seq >= 0 && seq < num_seqs && row >= 0 && row < query.size(0), "decode sequence ", d,
                " is out of range");
    TORCH_CHECK(lp[seq] >= 1 && lp[seq] <= capacity, "seq_lens[", seq, "] = ", lp[seq],
                " does not fit its block table of ", capacity, " slots");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
#if defined(CONVEYOR_SIMD_VECTOR)
    if constexpr (simd::kVectorType<scalar_t>) {
      constexpr int64_t L = Simd::kLanes;
      switch (query.size(2)) {
        case 4 * L:
          return decode_attention_vec<scalar_t, 4>(out, query, key_cache, value_cache, tables, lens, id_ptr,
                                                   row_ptr, num_decode, scale, options);
        case 8 * L:
          return decode_attention_vec<scalar_t, 8>(out, query, key_cache, value_cache, tables, lens, id_ptr,
                                                   row_ptr, num_decode, scale, options);
        default:
          break;
      }
    }
#endif
    decode_attention<scalar_t>(out, query, key_cache, value_cache, tables, lens, id_ptr, row_ptr, num_decode,
                               scale, options);
  });
}

}  // namespace conveyor::cpu

CONVEYOR_LIBRARY(CONVEYOR_CPU_NAMESPACE, m) {
  using namespace conveyor::cpu;
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)",
        &fused_add_rms_norm);
  m.def(
      "rotary_embedding(Tensor positions, Tensor query, Tensor key, Tensor cos_sin_cache) -> (Tensor, "
      "Tensor)",
      &rotary_embedding);
  m.def("silu_and_mul(Tensor x) -> Tensor", &silu_and_mul);
  m.def("gelu_tanh_and_mul(Tensor x) -> Tensor", &gelu_tanh_and_mul);
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping) -> ()",
      &reshape_and_cache);
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor? seq_ids, Tensor? query_rows, float scale, "
      "int? sliding_window=None, float? logits_soft_cap=None) -> ()",
      &paged_decode_attention);
}
