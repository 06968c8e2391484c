// The kernels' entry points, shared by their Python bindings and the fused decoder
// (decoder.cpp), which calls them from C++. Each checks its arguments.
#pragma once

#include <torch/extension.h>

#include <optional>
#include <string>

namespace pagedllm {

// norm_rotary.cpp
void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight,
              std::optional<at::Tensor> residual, double eps);
void rotary_embedding(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos_cache,
                      const at::Tensor& sin_cache, int64_t head_dim, int64_t rotary_dim);
void silu_and_mul(at::Tensor out, const at::Tensor& x);

// paged_attention.cpp
void paged_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                     int64_t sliding_window, double logits_soft_cap, int64_t skip_prefill_from,
                     const at::Tensor& sinks = at::Tensor());
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache,
                       at::Tensor v_cache, const at::Tensor& slot_mapping);

// dense_linear.cpp
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias);

// lora.cpp
void add_lora(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
              const at::Tensor& row_slots, const at::Tensor& columns);

// quant_linear.cpp, quant_int4_bf16.cpp (int4_takes_bf16)
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& mins);
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales);
bool int4_takes_bf16(int64_t K);  // bfloat16 x of K columns: bf16 dot products, not float32
void int4_dequantize(at::Tensor out, const at::Tensor& qweight, const at::Tensor& scales,
                     const at::Tensor& mins);
void int8_dequantize(at::Tensor out, const at::Tensor& qweight, const at::Tensor& scales);

// int8_act_linear.cpp
at::Tensor int8_act_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                           const std::optional<at::Tensor>& mins, int64_t bits, int64_t n,
                           const std::string& variant);

}  // namespace pagedllm
