// The C++ CPU kernels (cpu_kernels.cpp) as functions, for the decoder's layer loop (decoder.cpp) to call
// without a trip through the dispatcher. Signatures, layouts and errors are those of the ops registered
// under `conveyor_cpu` (see conveyor.kernels.reference for the contract).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace conveyor::cpu {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps);

std::tuple<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& positions, const at::Tensor& query,
                                                    const at::Tensor& key, const at::Tensor& cos_sin_cache);

at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor gelu_tanh_and_mul(const at::Tensor& x);

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& slot_mapping);

void paged_decode_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, const std::optional<at::Tensor>& seq_ids,
                            const std::optional<at::Tensor>& query_rows, double scale,
                            std::optional<int64_t> sliding_window, std::optional<double> logits_soft_cap);

}  // namespace conveyor::cpu
