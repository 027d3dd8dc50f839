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
//   * per block of kKeys keys: scores = q . k (float32, one broadcast q pair per `vdpbf16ps`); keys past
//     a row's position masked; p = 2^(s * scale * log2(e) - m) (the scale and the shift one multiply-add)
//     with m the row's running maximum; the row's running sum updated; its float32 output
//     rescaled and given p . v with p rounded to bfloat16 (as flash-attention kernels in bfloat16 do;
//     the row's sum adds the float32 p).
// Where the build and the CPU have AMX-BF16, the same algorithm can run its two matrix products on the
// tiles (amx_sequence). Everything else (float32, another head_dim, builds without AVX512_BF16) runs
// torch's scaled_dot_product_attention per sequence, as the reference does.
//
// None wins on every CPU: on a 2-core AVX512_BF16 EPYC the flash kernel takes a third of torch's time
// at 1,024 tokens, on a 2-core Xeon with AMX tiles (whose bfloat16 GEMMs torch's kernel reaches through
// oneDNN) three times torch's, and the AMX kernel there 0.55x torch's. So which one runs a sequence of a
// given number of query rows is set at start from a measurement on the machine (`set_prefill_kernels`,
// conveyor.kernels.selection); until then the flash kernel runs wherever it can.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <sys/syscall.h>
#include <torch/library.h>
#include <unistd.h>

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

// The online softmax's update of one row for a block of scores (Milakov & Gimelshein, 2018), in base 2:
// block_max the block's largest s * scale * log2(e) (finite), row_max the row's so far (-inf before its
// first block). Raises row_max to block_max where that is larger and returns the factor the row's sum
// and output so far are rescaled by (1 when the maximum stays, 0 for the first block).
inline float raise_max(float block_max, float& row_max) {
  if (block_max <= row_max) return 1.0f;
  const float alpha = row_max == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp2(row_max - block_max);
  row_max = block_max;
  return alpha;
}

// K and V of every KV head of one sequence packed for the bfloat16 dot products (zeros past seq_len up to
// padded, a multiple of 16): k_packed[h][key / 16][d / 2][key % 16][d % 2] (16 keys' values of two
// consecutive dimensions per 32 values), v_packed[h][key / 2][d][key % 2] (16 dimensions of two
// consecutive keys per 32 values). Both hold num_kv_heads * padded * head_dim values.
void pack_kv(std::vector<uint16_t>& k_packed, std::vector<uint16_t>& v_packed, const Tensor& key_cache,
             const Tensor& value_cache, const Tensor& table, int64_t seq_len, int64_t padded) {
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2), dim = key_cache.size(3);
  const int64_t pairs = dim / 2;
  const Tensor ids = table.to(at::kLong).contiguous();
  const int64_t* blocks = ids.data_ptr<int64_t>();
  const auto* kc = reinterpret_cast<const uint16_t*>(key_cache.data_ptr<at::BFloat16>());
  const auto* vc = reinterpret_cast<const uint16_t*>(value_cache.data_ptr<at::BFloat16>());
  const int64_t cache_block = key_cache.stride(0), cache_row = key_cache.stride(1);
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
}

// One sequence's rows with the flash kernel. query/out: [num_tokens, num_heads, head_dim] bfloat16 with
// unit stride in head_dim; caches [num_blocks, block_size, num_kv_heads, head_dim].
void flash_sequence(const Tensor& out, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                    const Tensor& table, int64_t start, int64_t q_len, int64_t seq_len, double scale) {
  const int64_t num_kv_heads = key_cache.size(2), dim = key_cache.size(3);
  const int64_t num_heads = query.size(1), group = num_heads / num_kv_heads, pairs = dim / 2;
  const int64_t first = seq_len - q_len;
  const int64_t padded = (seq_len + kKeys - 1) / kKeys * kKeys;
  std::vector<uint16_t> k_packed(num_kv_heads * padded * dim), v_packed(num_kv_heads * padded * dim);
  pack_kv(k_packed, v_packed, key_cache, value_cache, table, seq_len, padded);
  const int64_t rows_per_head = q_len * group;  // position-major over the group's query heads
  const int64_t tiles = (rows_per_head + kRows - 1) / kRows;
  const auto* qp = reinterpret_cast<const uint16_t*>(query.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t q_token = query.stride(0), q_head = query.stride(1);
  const int64_t o_token = out.stride(0), o_head = out.stride(1);
  // Softmax terms in base 2, as amx_sequence: p = 2^(s * c - m), c = scale * log2(e).
  const float log2_scale = static_cast<float>(scale * 1.4426950408889634);
  const __m512 c_v = _mm512_set1_ps(log2_scale);
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
      float row_max[kRows];  // of s * scale * log2(e)
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
          const __m512 none = _mm512_set1_ps(neg_inf);
          const __m512 a = all_seen ? s0[r] : _mm512_mask_mov_ps(none, m0, s0[r]);
          const __m512 b = all_seen ? s1[r] : _mm512_mask_mov_ps(none, m1, s1[r]);
          const float block_max = _mm512_reduce_max_ps(_mm512_max_ps(a, b)) * log2_scale;
          if (block_max == neg_inf) {  // the row sees none of these keys
            alpha[r] = 1.0f;
            std::memset(probs[r], 0, sizeof(probs[r]));
            continue;
          }
          alpha[r] = raise_max(block_max, row_max[r]);
          const __m512 shift = _mm512_set1_ps(-row_max[r]);
          __m512 pa = simd::exp2_ps(_mm512_fmadd_ps(a, c_v, shift));
          __m512 pb = simd::exp2_ps(_mm512_fmadd_ps(b, c_v, shift));
          if (!all_seen) {
            pa = _mm512_maskz_mov_ps(m0, pa);
            pb = _mm512_maskz_mov_ps(m1, pb);
          }
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

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#define CONVEYOR_ATTENTION_AMX 1
// The AMX tiles' register file is off until the process asks Linux for it (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, Documentation/arch/x86/xstate.rst); once for the process.
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kGetPerm = 0x1022, kReqPerm = 0x1023, kXtiledata = 18;
    unsigned long bits = 0;
    if (syscall(SYS_arch_prctl, kGetPerm, &bits) == 0 && (bits & (1ul << kXtiledata))) return true;
    return syscall(SYS_arch_prctl, kReqPerm, kXtiledata) == 0;
  }();
  return permitted;
}

// Palette 1 with every tile 16 rows of 64 bytes (16 float32, or 32 bfloat16 as 16 pairs).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) {
      colsb[t] = 64;
      rows[t] = 16;
    }
  }
};

constexpr int64_t kAmxRows = 16;  // query rows per tile: one AMX tile's rows
constexpr int64_t kAmxKeys = 64;  // keys per block: four score tiles

// The flash kernel's algorithm with the two matrix products on AMX tiles (`tdpbf16ps`: a 16 x 32
// bfloat16 tile times a 32 x 16 one, pairs along the inner dimension, into 16 x 16 float32), the
// softmax in AVX-512 between them. The packed K and V are the flash kernel's layouts, which are the
// tiles' B layouts: 16 keys' pairs of dimensions per 64-byte row for Q.K^T, 16 dimensions' pairs of
// keys per row for P.V. Tiles: tmm0-3 the scores of 64 keys, tmm4 a Q (then P) tile, tmm5 a K (then V)
// tile, tmm6 one 16-dimension slice of P.V. Work items are (KV head, tile of 16 rows), the tiles of a
// head taken from both ends in turn so that each thread's share of the causal triangle is even.
void amx_sequence(const Tensor& out, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                  const Tensor& table, int64_t start, int64_t q_len, int64_t seq_len, double scale) {
  const int64_t num_kv_heads = key_cache.size(2), dim = key_cache.size(3);
  const int64_t num_heads = query.size(1), group = num_heads / num_kv_heads;
  const int64_t first = seq_len - q_len;
  const int64_t padded = (seq_len + kAmxKeys - 1) / kAmxKeys * kAmxKeys;
  std::vector<uint16_t> k_packed(num_kv_heads * padded * dim), v_packed(num_kv_heads * padded * dim);
  pack_kv(k_packed, v_packed, key_cache, value_cache, table, seq_len, padded);
  const int64_t rows_per_head = q_len * group;
  const int64_t tiles = (rows_per_head + kAmxRows - 1) / kAmxRows;
  const auto* qp = reinterpret_cast<const uint16_t*>(query.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t q_token = query.stride(0), q_head = query.stride(1);
  const int64_t o_token = out.stride(0), o_head = out.stride(1);
  const float log2_scale = static_cast<float>(scale * 1.4426950408889634);
  const __m512 c_v = _mm512_set1_ps(log2_scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, num_kv_heads * tiles, 1, [&](int64_t begin, int64_t end) {
    const TileConfig config;
    _tile_loadconfig(&config);
    std::vector<float> acc(kAmxRows * dim);
    std::vector<uint16_t> q_tile(kAmxRows * dim);
    alignas(64) float scores[kAmxRows][kAmxKeys];
    alignas(64) float pv[kAmxRows][16];
    alignas(64) uint16_t probs[kAmxRows][kAmxKeys];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / tiles, j = item % tiles;
      const int64_t tile = j % 2 == 0 ? j / 2 : tiles - 1 - j / 2;
      const int64_t row0 = tile * kAmxRows, rows = std::min(kAmxRows, rows_per_head - row0);
      const uint16_t* kh = k_packed.data() + h * padded * dim;
      const uint16_t* vh = v_packed.data() + h * padded * dim;
      int64_t last_key[kAmxRows];
      float row_max[kAmxRows];  // of s * scale * log2(e)
      __m512 row_sum[kAmxRows];  // per lane, summed at the end
      for (int64_t r = 0; r < kAmxRows; ++r) {
        const int64_t rr = row0 + std::min(r, rows - 1);
        const int64_t pos = rr / group, head = h * group + rr % group;
        std::memcpy(q_tile.data() + r * dim, qp + (start + pos) * q_token + head * q_head, dim * 2);
        last_key[r] = first + pos;
        row_max[r] = neg_inf;
        row_sum[r] = _mm512_setzero_ps();
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      const int64_t key_end = last_key[rows - 1] + 1;
      for (int64_t k0 = 0; k0 < key_end; k0 += kAmxKeys) {
        // scores[r][key] = q_r . k_key for 64 keys, 32 dimensions per step.
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t d0 = 0; d0 < dim; d0 += 32) {
          _tile_loadd(4, q_tile.data() + d0, dim * 2);
          const uint16_t* kb = kh + k0 * dim + d0 * 16;  // [16 pairs][16 keys][2] of keys k0 ..
          _tile_loadd(5, kb, 64);
          _tile_dpbf16ps(0, 4, 5);
          _tile_loadd(5, kb + 16 * dim, 64);
          _tile_dpbf16ps(1, 4, 5);
          _tile_loadd(5, kb + 32 * dim, 64);
          _tile_dpbf16ps(2, 4, 5);
          _tile_loadd(5, kb + 48 * dim, 64);
          _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(0, &scores[0][0], kAmxKeys * 4);
        _tile_stored(1, &scores[0][16], kAmxKeys * 4);
        _tile_stored(2, &scores[0][32], kAmxKeys * 4);
        _tile_stored(3, &scores[0][48], kAmxKeys * 4);
        // Softmax terms in base 2: p = 2^(s * c - m), c = scale * log2(e), m the row's running maximum
        // of s * c (so the scale and the shift are one multiply-add per 16 scores).
        float alpha[kAmxRows];
        const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const bool all_seen = k0 + kAmxKeys - 1 <= last_key[0];
        const __m512 none = _mm512_set1_ps(neg_inf);
        for (int64_t r = 0; r < kAmxRows; ++r) {
          __m512 s[4];
          __mmask16 m[4] = {0xffff, 0xffff, 0xffff, 0xffff};
          for (int c = 0; c < 4; ++c) {
            s[c] = _mm512_load_ps(&scores[r][16 * c]);
            if (!all_seen) {
              const __m512i limit = _mm512_set1_epi32(static_cast<int>(last_key[r] - k0 - 16 * c));
              m[c] = _mm512_cmple_epi32_mask(lane, limit);
              s[c] = _mm512_mask_mov_ps(none, m[c], s[c]);
            }
          }
          const float block_max =
              _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(s[0], s[1]), _mm512_max_ps(s[2], s[3]))) * log2_scale;
          if (block_max == neg_inf) {  // the row sees none of these keys
            alpha[r] = 1.0f;
            std::memset(probs[r], 0, sizeof(probs[r]));
            continue;
          }
          alpha[r] = raise_max(block_max, row_max[r]);
          const __m512 shift = _mm512_set1_ps(-row_max[r]);
          __m512 p[4];
          for (int c = 0; c < 4; ++c) {
            p[c] = simd::exp2_ps(_mm512_fmadd_ps(s[c], c_v, shift));
            if (!all_seen) p[c] = _mm512_maskz_mov_ps(m[c], p[c]);
          }
          _mm512_store_si512(&probs[r][0], (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
          _mm512_store_si512(&probs[r][32], (__m512i)_mm512_cvtne2ps_pbh(p[3], p[2]));
          row_sum[r] = _mm512_fmadd_ps(row_sum[r], _mm512_set1_ps(alpha[r]),
                                       _mm512_add_ps(_mm512_add_ps(p[0], p[1]), _mm512_add_ps(p[2], p[3])));
        }
        // acc = acc * alpha + P . V, 16 dimensions per tile: P's two 32-key tiles against V's.
        const uint16_t* vb = vh + k0 * dim;  // [key pairs][dim][2]
        for (int64_t d0 = 0; d0 < dim; d0 += 16) {
          _tile_zero(6);
          _tile_loadd(4, &probs[0][0], kAmxKeys * 2);
          _tile_loadd(5, vb + d0 * 2, dim * 4);
          _tile_dpbf16ps(6, 4, 5);
          _tile_loadd(4, &probs[0][32], kAmxKeys * 2);
          _tile_loadd(5, vb + 16 * dim * 2 + d0 * 2, dim * 4);
          _tile_dpbf16ps(6, 4, 5);
          _tile_stored(6, &pv[0][0], 64);
          for (int64_t r = 0; r < kAmxRows; ++r) {
            float* a = acc.data() + r * dim + d0;
            _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_loadu_ps(a), _mm512_set1_ps(alpha[r]), _mm512_load_ps(pv[r])));
          }
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
    _tile_release();
  });
}
#endif

}  // namespace

// The prefill kernels: the flash kernel (AVX512_BF16), its AMX form, torch's per sequence.
enum class Kernel { kFlash, kAmx, kSdpa };

// Which kernel runs a sequence of q_len query rows, per attention shape (query heads, KV heads,
// head_dim): ranges of (first q_len, kernel) ascending from 1, set at start (set_prefill_kernels), read
// by every call after. A shape without ranges runs the flash kernel where it can.
using Shape = std::tuple<int64_t, int64_t, int64_t>;
std::map<Shape, std::vector<std::pair<int64_t, Kernel>>>& prefill_ranges() {
  static std::map<Shape, std::vector<std::pair<int64_t, Kernel>>> ranges;
  return ranges;
}

Kernel kernel_for(const Shape& shape, int64_t q_len) {
  Kernel kernel = Kernel::kFlash;
  const auto it = prefill_ranges().find(shape);
  if (it == prefill_ranges().end()) return kernel;
  for (const auto& [first, chosen] : it->second) {
    if (q_len >= first) kernel = chosen;
  }
  return kernel;
}

bool flash_supported(const Tensor& query) {
#if defined(__AVX512BF16__)
  return query.scalar_type() == at::kBFloat16 && query.size(-1) % 32 == 0 && query.stride(-1) == 1;
#else
  (void)query;
  return false;
#endif
}

bool amx_supported(const Tensor& query) {
#if defined(CONVEYOR_ATTENTION_AMX)
  return flash_supported(query) && amx_permitted();
#else
  (void)query;
  return false;
#endif
}

// kernels[i] ("flash", "amx" or "sdpa") runs the sequences of first_rows[i] query rows up to the next
// range's, for layers of num_heads query heads over num_kv_heads KV heads of head_dim.
void set_prefill_kernels(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, at::IntArrayRef first_rows,
                         const std::vector<std::string>& kernels) {
  TORCH_CHECK(!first_rows.empty() && first_rows.size() == kernels.size() && first_rows[0] == 1,
              "set_prefill_kernels: first_rows must start at 1 and name one kernel each");
  std::vector<std::pair<int64_t, Kernel>> ranges;
  for (size_t i = 0; i < first_rows.size(); ++i) {
    TORCH_CHECK(i == 0 || first_rows[i] > first_rows[i - 1], "set_prefill_kernels: first_rows must ascend");
    const std::string& name = kernels[i];
    TORCH_CHECK(name == "flash" || name == "amx" || name == "sdpa", "set_prefill_kernels: unknown kernel '",
                name, "' (flash, amx or sdpa)");
    ranges.emplace_back(first_rows[i], name == "flash" ? Kernel::kFlash
                                       : name == "amx" ? Kernel::kAmx
                                                       : Kernel::kSdpa);
  }
  prefill_ranges()[Shape{num_heads, num_kv_heads, head_dim}] = std::move(ranges);
}

void prefill(const Tensor& out, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
             const Tensor& block_tables, const std::vector<int64_t>& seqs, const std::vector<int64_t>& q_lens,
             const std::vector<int64_t>& starts, const std::vector<int64_t>& seq_lens, double scale) {
  const bool flash = flash_supported(query) && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                     out.stride(-1) == 1;
  const bool amx = flash && amx_supported(query);
  const Shape shape{query.size(1), key_cache.size(2), query.size(2)};
  for (size_t i = 0; i < seqs.size(); ++i) {
    const Tensor table = block_tables[seqs[i]];
    const Kernel kernel = kernel_for(shape, q_lens[i]);
#if defined(CONVEYOR_ATTENTION_AMX)
    if (amx && kernel == Kernel::kAmx) {
      amx_sequence(out, query, key_cache, value_cache, table, starts[i], q_lens[i], seq_lens[i], scale);
      continue;
    }
#endif
#if defined(__AVX512BF16__)
    if (flash && kernel != Kernel::kSdpa) {
      flash_sequence(out, query, key_cache, value_cache, table, starts[i], q_lens[i], seq_lens[i], scale);
      continue;
    }
#endif
    (void)flash;
    (void)amx;
    (void)kernel;
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

bool amx_op(const Tensor& query) { return amx_supported(query); }

}  // namespace

}  // namespace conveyor::attention

CONVEYOR_LIBRARY(CONVEYOR_ATTENTION_NAMESPACE, m) {
  m.def("prefill_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, int[] q_lens, int[] starts, int[] seq_lens, float scale) -> ()",
        &conveyor::attention::prefill_op);
  m.def("flash_supported(Tensor query) -> bool", &conveyor::attention::flash_op);
  m.def("amx_supported(Tensor query) -> bool", &conveyor::attention::amx_op);
  m.def("set_prefill_kernels(int num_heads, int num_kv_heads, int head_dim, int[] first_rows, str[] kernels) -> ()", &conveyor::attention::set_prefill_kernels);
}
