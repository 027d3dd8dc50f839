// Prefill attention on CPUs: the rows of sequences with more than one query (prefill, chunked prefill)
// against their paged K/V, causal (row i of a chunk whose first row sits at position `first` sees the
// keys 0 .. first + i). conveyor.kernels.reference.prefill_attention is the contract (without sliding
// windows or soft caps, which the callers route to it).
//
// bfloat16 with AVX512_BF16 and a head_dim that is a multiple of 32 runs a flash-attention kernel
// (Dao et al., 2022: scores a tile at a time, an online softmax, never the whole score matrix) written
// around `vdpbf16ps`, which multiplies 16 pairs of bfloat16 and adds them into 16 float32 lanes:
//   * per KV head, its keys are packed once per call so that one vector holds 16 keys' values of two
//     consecutive dimensions (`k_packed[key / 16][d / 2][key % 16][d % 2]`), and its values so that one
//     vector holds 16 dimensions of two consecutive keys (`v_packed[key / 2][d][key % 2]`);
//   * work items are (KV head, tile of kRows query rows), the rows running position-major over the query
//     heads that share the KV head (GQA), so a tile reads each key block once for all of them;
//   * per block of kKeys keys: scores = q . k (float32, one broadcast q pair per `vdpbf16ps`), scaled;
//     keys past a row's position masked; the row's running max and sum updated; its float32 output
//     rescaled and given p . v with p rounded to bfloat16 (as flash-attention kernels in bfloat16 do;
//     the row's sum adds the float32 p).
// Everything else (float32, another head_dim, builds without AVX512_BF16) runs torch's
// scaled_dot_product_attention per sequence, as the reference does.
//
// Neither wins on every CPU: on a 2-core AVX512_BF16 EPYC the flash kernel takes a third of torch's time
// at 1,024 tokens, on a 2-core Xeon with AMX tiles (whose bfloat16 GEMMs torch's kernel reaches through
// oneDNN) three times torch's. So which one runs a sequence of a given number of query rows is set at
// start from a measurement on the machine (`set_prefill_kernels`, conveyor.kernels.selection); until
// then the flash kernel runs wherever it can.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "simd.h"

#ifndef CONVEYOR_ATTENTION_NAMESPACE
#define CONVEYOR_ATTENTION_NAMESPACE conveyor_attention
#endif
#define CONVEYOR_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)

namespace conveyor::attention {

using at::Tensor;

namespace {

// One sequence's rows through torch's kernel: K/V gathered from its blocks, a mask for a chunk.
void sdpa_sequence(const Tensor& out, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                   const Tensor& table, int64_t start, int64_t q_len, int64_t seq_len, double scale) {
  const int64_t block_size = key_cache.size(1);
  const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
  const Tensor ids = table.narrow(0, 0, num_blocks).to(at::kLong);
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
    const auto opts = at::TensorOptions().dtype(at::kLong);
    const Tensor pos = at::arange(seq_len - q_len, seq_len, opts);
    const Tensor mask = at::arange(seq_len, opts).unsqueeze(0) <= pos.unsqueeze(1);
    o = at::scaled_dot_product_attention(q, k, v, mask, 0.0, false, scale, true);
  }
  out.narrow(0, start, q_len).copy_(o.transpose(0, 1));
}

#if defined(__AVX512BF16__)
constexpr int64_t kRows = 8;   // query rows per tile (their scores stay in registers)
constexpr int64_t kKeys = 32;  // keys per block: two vectors of scores per row

// One sequence's rows with the flash kernel. query/out: [num_tokens, num_heads, head_dim] bfloat16 with
// unit stride in head_dim; caches [num_blocks, block_size, num_kv_heads, head_dim].
void flash_sequence(const Tensor& out, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                    const Tensor& table, int64_t start, int64_t q_len, int64_t seq_len, double scale) {
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2), dim = key_cache.size(3);
  const int64_t num_heads = query.size(1), group = num_heads / num_kv_heads, pairs = dim / 2;
  const int64_t first = seq_len - q_len;
  const int64_t padded = (seq_len + kKeys - 1) / kKeys * kKeys;
  const Tensor ids = table.to(at::kLong).contiguous();
  const int64_t* blocks = ids.data_ptr<int64_t>();
  const auto* kc = reinterpret_cast<const uint16_t*>(key_cache.data_ptr<at::BFloat16>());
  const auto* vc = reinterpret_cast<const uint16_t*>(value_cache.data_ptr<at::BFloat16>());
  const int64_t cache_block = key_cache.stride(0), cache_row = key_cache.stride(1);
  // Packed K and V of every KV head (zeros past the sequence).
  std::vector<uint16_t> k_packed(num_kv_heads * padded * dim), v_packed(num_kv_heads * padded * dim);
  at::parallel_for(0, num_kv_heads * (padded / 16), 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / (padded / 16), kv = item % (padded / 16);
      uint16_t* kp = k_packed.data() + h * padded * dim + kv * 16 * dim;  // [pairs][16][2]
      uint16_t* vp = v_packed.data() + h * padded * dim + kv * 16 * dim;  // [8 key pairs][dim][2]
      for (int64_t l = 0; l < 16; ++l) {
        const int64_t j = kv * 16 + l;
        const uint16_t* krow = nullptr;
        const uint16_t* vrow = nullptr;
        if (j < seq_len) {
          const int64_t offset = blocks[j / block_size] * cache_block + (j % block_size) * cache_row + h * dim;
          krow = kc + offset;
          vrow = vc + offset;
        }
        for (int64_t p = 0; p < pairs; ++p) {
          kp[(p * 16 + l) * 2] = krow ? krow[2 * p] : 0;
          kp[(p * 16 + l) * 2 + 1] = krow ? krow[2 * p + 1] : 0;
        }
        for (int64_t d = 0; d < dim; ++d) {
          vp[((l / 2) * dim + d) * 2 + l % 2] = vrow ? vrow[d] : 0;
        }
      }
    }
  });
  const int64_t rows_per_head = q_len * group;  // position-major over the group's query heads
  const int64_t tiles = (rows_per_head + kRows - 1) / kRows;
  const auto* qp = reinterpret_cast<const uint16_t*>(query.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t q_token = query.stride(0), q_head = query.stride(1);
  const int64_t o_token = out.stride(0), o_head = out.stride(1);
  const float fscale = static_cast<float>(scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, num_kv_heads * tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(kRows * dim);
    alignas(64) uint16_t probs[kRows][kKeys];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / tiles, tile = item % tiles;
      const int64_t row0 = tile * kRows, rows = std::min(kRows, rows_per_head - row0);
      const uint16_t* kh = k_packed.data() + h * padded * dim;
      const uint16_t* vh = v_packed.data() + h * padded * dim;
      const uint16_t* q[kRows];
      int64_t last_key[kRows];  // the last key each row sees (its absolute position)
      float row_max[kRows];
      __m512 row_sum[kRows];  // per lane, summed at the end
      for (int64_t r = 0; r < kRows; ++r) {
        const int64_t rr = row0 + std::min(r, rows - 1);
        const int64_t pos = rr / group, head = h * group + rr % group;
        q[r] = qp + (start + pos) * q_token + head * q_head;
        last_key[r] = first + pos;
        row_max[r] = neg_inf;
        row_sum[r] = _mm512_setzero_ps();
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      const int64_t key_end = last_key[rows - 1] + 1;  // rows run position-major: the last sees most
      for (int64_t k0 = 0; k0 < key_end; k0 += kKeys) {
        __m512 s0[kRows], s1[kRows];
        for (int64_t r = 0; r < kRows; ++r) s0[r] = s1[r] = _mm512_setzero_ps();
        const uint16_t* kb0 = kh + k0 * dim;  // 16 keys: [pairs][16][2]
        const uint16_t* kb1 = kb0 + 16 * dim;
        for (int64_t p = 0; p < pairs; ++p) {
          const __m512bh k_lo = (__m512bh)_mm512_loadu_si512(kb0 + p * 32);
          const __m512bh k_hi = (__m512bh)_mm512_loadu_si512(kb1 + p * 32);
          for (int64_t r = 0; r < kRows; ++r) {
            int32_t pair;
            std::memcpy(&pair, q[r] + 2 * p, sizeof(pair));
            const __m512bh qv = (__m512bh)_mm512_set1_epi32(pair);
            s0[r] = _mm512_dpbf16_ps(s0[r], qv, k_lo);
            s1[r] = _mm512_dpbf16_ps(s1[r], qv, k_hi);
          }
        }
        float alpha[kRows];
        const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const bool all_seen = k0 + kKeys - 1 <= last_key[0];  // row 0 sits at the tile's first position
        for (int64_t r = 0; r < kRows; ++r) {
          // Keys k0 + lane (and + 16) at or before the row's last key are seen.
          __mmask16 m0 = 0xffff, m1 = 0xffff;
          if (!all_seen) {
            const __m512i limit = _mm512_set1_epi32(static_cast<int>(last_key[r] - k0));
            m0 = _mm512_cmple_epi32_mask(lane, limit);
            m1 = _mm512_cmple_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(16)), limit);
          }
          const __m512 scale_v = _mm512_set1_ps(fscale), none = _mm512_set1_ps(neg_inf);
          const __m512 a = _mm512_mask_mul_ps(none, m0, s0[r], scale_v);
          const __m512 b = _mm512_mask_mul_ps(none, m1, s1[r], scale_v);
          const float block_max = _mm512_reduce_max_ps(_mm512_max_ps(a, b));
          if (block_max == neg_inf) {  // the row sees none of these keys
            alpha[r] = 1.0f;
            std::memset(probs[r], 0, sizeof(probs[r]));
            continue;
          }
          const float new_max = std::max(row_max[r], block_max);
          alpha[r] = row_max[r] == neg_inf ? 0.0f : std::exp(row_max[r] - new_max);
          row_max[r] = new_max;
          const __m512 shift = _mm512_set1_ps(new_max);
          const __m512 pa = _mm512_maskz_mov_ps(m0, simd::exp_ps(_mm512_sub_ps(a, shift)));
          const __m512 pb = _mm512_maskz_mov_ps(m1, simd::exp_ps(_mm512_sub_ps(b, shift)));
          const __m512bh pbf = _mm512_cvtne2ps_pbh(pb, pa);  // lanes 0-15: pa, 16-31: pb
          _mm512_storeu_si512(probs[r], (__m512i)pbf);
          row_sum[r] = _mm512_fmadd_ps(row_sum[r], _mm512_set1_ps(alpha[r]), _mm512_add_ps(pa, pb));
        }
        const uint16_t* vb = vh + k0 * dim;  // [16 key pairs][dim][2]
        for (int64_t d0 = 0; d0 < dim; d0 += 16) {
          __m512 o[kRows];
          for (int64_t r = 0; r < kRows; ++r) {
            o[r] = _mm512_mul_ps(_mm512_loadu_ps(acc.data() + r * dim + d0), _mm512_set1_ps(alpha[r]));
          }
          for (int64_t jp = 0; jp < kKeys / 2; ++jp) {
            const __m512bh vv = (__m512bh)_mm512_loadu_si512(vb + (jp * dim + d0) * 2);
            for (int64_t r = 0; r < kRows; ++r) {
              int32_t pair;
              std::memcpy(&pair, probs[r] + 2 * jp, sizeof(pair));
              o[r] = _mm512_dpbf16_ps(o[r], (__m512bh)_mm512_set1_epi32(pair), vv);
            }
          }
          for (int64_t r = 0; r < kRows; ++r) _mm512_storeu_ps(acc.data() + r * dim + d0, o[r]);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t rr = row0 + r, pos = rr / group, head = h * group + rr % group;
        uint16_t* dst = op + (start + pos) * o_token + head * o_head;
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(row_sum[r]));
        for (int64_t d0 = 0; d0 < dim; d0 += 16) {
          simd::Simd::store(reinterpret_cast<c10::BFloat16*>(dst + d0),
                            _mm512_mul_ps(_mm512_loadu_ps(acc.data() + r * dim + d0), inv));
        }
      }
    }
  });
}
#endif

}  // namespace

// Which kernel runs a sequence of q_len query rows where the flash kernel can, per attention shape
// (query heads, KV heads, head_dim): ranges of (first q_len, flash?) ascending from 1, set at start
// (set_prefill_kernels), read by every call after. A shape without ranges runs the flash kernel.
using Shape = std::tuple<int64_t, int64_t, int64_t>;
std::map<Shape, std::vector<std::pair<int64_t, bool>>>& prefill_ranges() {
  static std::map<Shape, std::vector<std::pair<int64_t, bool>>> ranges;
  return ranges;
}

bool flash_for(const Shape& shape, int64_t q_len) {
  const auto it = prefill_ranges().find(shape);
  if (it == prefill_ranges().end()) return true;
  bool flash = true;
  for (const auto& [first, use_flash] : it->second) {
    if (q_len >= first) flash = use_flash;
  }
  return flash;
}

// kernels[i] ("flash" or "sdpa") runs the sequences of first_rows[i] query rows up to the next range's,
// for layers of num_heads query heads over num_kv_heads KV heads of head_dim.
void set_prefill_kernels(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, at::IntArrayRef first_rows,
                         const std::vector<std::string>& kernels) {
  TORCH_CHECK(!first_rows.empty() && first_rows.size() == kernels.size() && first_rows[0] == 1,
              "set_prefill_kernels: first_rows must start at 1 and name one kernel each");
  std::vector<std::pair<int64_t, bool>> ranges;
  for (size_t i = 0; i < first_rows.size(); ++i) {
    TORCH_CHECK(i == 0 || first_rows[i] > first_rows[i - 1], "set_prefill_kernels: first_rows must ascend");
    TORCH_CHECK(kernels[i] == "flash" || kernels[i] == "sdpa", "set_prefill_kernels: unknown kernel '",
                kernels[i], "' (flash or sdpa)");
    ranges.emplace_back(first_rows[i], kernels[i] == "flash");
  }
  prefill_ranges()[Shape{num_heads, num_kv_heads, head_dim}] = std::move(ranges);
}

bool flash_supported(const Tensor& query) {
#if defined(__AVX512BF16__)
  return query.scalar_type() == at::kBFloat16 && query.size(-1) % 32 == 0 && query.stride(-1) == 1;
#else
  (void)query;
  return false;
#endif
}

void prefill(const Tensor& out, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
             const Tensor& block_tables, const std::vector<int64_t>& seqs, const std::vector<int64_t>& q_lens,
             const std::vector<int64_t>& starts, const std::vector<int64_t>& seq_lens, double scale) {
  const bool flash = flash_supported(query) && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                     out.stride(-1) == 1;
  const Shape shape{query.size(1), key_cache.size(2), query.size(2)};
  for (size_t i = 0; i < seqs.size(); ++i) {
    const Tensor table = block_tables[seqs[i]];
#if defined(__AVX512BF16__)
    if (flash && flash_for(shape, q_lens[i])) {
      flash_sequence(out, query, key_cache, value_cache, table, starts[i], q_lens[i], seq_lens[i], scale);
      continue;
    }
#endif
    (void)flash;
    sdpa_sequence(out, query, key_cache, value_cache, table, starts[i], q_lens[i], seq_lens[i], scale);
  }
}

namespace {

// The op: every sequence b with q_lens[b] > 1, its rows starts[b] .. + q_lens[b], seq_lens[b] tokens.
void prefill_op(const Tensor& out, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                const Tensor& block_tables, at::IntArrayRef q_lens, at::IntArrayRef starts,
                at::IntArrayRef seq_lens, double scale) {
  TORCH_CHECK(q_lens.size() == starts.size() && q_lens.size() == seq_lens.size(),
              "prefill_attention: q_lens, starts and seq_lens differ in length");
  std::vector<int64_t> seqs, ql, st, sl;
  for (size_t b = 0; b < q_lens.size(); ++b) {
    if (q_lens[b] > 1) {
      seqs.push_back(static_cast<int64_t>(b));
      ql.push_back(q_lens[b]);
      st.push_back(starts[b]);
      sl.push_back(seq_lens[b]);
    }
  }
  prefill(out, query, key_cache, value_cache, block_tables, seqs, ql, st, sl, scale);
}

bool flash_op(const Tensor& query) { return flash_supported(query); }

}  // namespace

}  // namespace conveyor::attention

CONVEYOR_LIBRARY(CONVEYOR_ATTENTION_NAMESPACE, m) {
  m.def("prefill_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, int[] q_lens, int[] starts, int[] seq_lens, float scale) -> ()",
        &conveyor::attention::prefill_op);
  m.def("flash_supported(Tensor query) -> bool", &conveyor::attention::flash_op);
  m.def("set_prefill_kernels(int num_heads, int num_kv_heads, int head_dim, int[] first_rows, str[] kernels) -> ()", &conveyor::attention::set_prefill_kernels);
}
