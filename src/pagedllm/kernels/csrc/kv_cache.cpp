// Writing this step's K/V into the paged cache (vLLM's reshape_and_cache): a row copy per token
// and KV head into a float cache (converted first if it has another dtype), or the row quantized
// into codes and a scale (kv_format.h) in an int8 / fp8 cache. torch's index_copy_ over the
// cache's flattened view took ~0.2 ms per call for 64 tokens here.

#include <torch/extension.h>

#include "kv_format.h"
#include "ops.h"

#include <cstring>

namespace pagedllm {
namespace {

template <typename In, typename Code>
void quantize_into(const at::Tensor& x, char* cache_base, const int64_t* slots, int64_t block_size,
                   int64_t c_block, int64_t c_token, int64_t c_head) {
  const int64_t num_tokens = x.size(0), heads = x.size(1), head_dim = x.size(2);
  const In* src = x.data_ptr<In>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    char* row = cache_base + (slots[t] / block_size) * c_block + (slots[t] % block_size) * c_token;
    for (int64_t h = 0; h < heads; ++h) {
      quantize_row(src + t * x.stride(0) + h * x.stride(1), head_dim,
                   reinterpret_cast<Code*>(row + h * c_head));
    }
  }
}

template <typename In>
void quantize_dispatch(const at::Tensor& x, at::ScalarType code, char* base, const int64_t* slots,
                       int64_t block_size, int64_t c_block, int64_t c_token, int64_t c_head) {
  switch (code) {
    case at::kChar:
      return quantize_into<In, int8_t>(x, base, slots, block_size, c_block, c_token, c_head);
    case at::kFloat8_e4m3fn:
      return quantize_into<In, c10::Float8_e4m3fn>(x, base, slots, block_size, c_block, c_token, c_head);
    default:
      return quantize_into<In, c10::Float8_e5m2>(x, base, slots, block_size, c_block, c_token, c_head);
  }
}

}  // namespace

// key/value [T, kv_heads, head_dim] into the caches [num_blocks, block_size, kv_heads, row] at
// flat slots slot_mapping[T] (block_id * block_size + offset).
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache,
                       at::Tensor v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes(), "key/value: [T, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.strides() == v_cache.strides() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "k/v caches: [num_blocks, block_size, kv_heads, row], one layout and dtype");
  const at::ScalarType cache_type = k_cache.scalar_type();
  const bool quantized = is_code_type(cache_type);
  TORCH_CHECK(key.size(1) == k_cache.size(2) &&
                  row_elements(key.size(2), cache_type) == k_cache.size(3),
              "key/value heads and head_dim must match the cache");
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "key and value must have one dtype");
  TORCH_CHECK(key.scalar_type() == at::kFloat || key.scalar_type() == at::kBFloat16 ||
                  key.scalar_type() == at::kHalf,
              "key/value: float32, bfloat16 or float16");
  if (!quantized && key.scalar_type() != cache_type) {  // a float cache of another dtype
    return reshape_and_cache(key.to(cache_type), value.to(cache_type), k_cache, v_cache,
                             slot_mapping);
  }
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == key.size(0),
              "slot_mapping: [T] int64");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 &&
                  k_cache.stride(1) == k_cache.size(2) * k_cache.size(3) &&
                  k_cache.stride(2) == k_cache.size(3) && k_cache.stride(3) == 1,
              "each cache token row and each key/value head must be contiguous");
  const int64_t num_tokens = key.size(0), heads = key.size(1), head_dim = key.size(2);
  const int64_t block_size = k_cache.size(1), num_slots = k_cache.size(0) * block_size;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " out of range");
  }
  auto* k_base = static_cast<char*>(k_cache.data_ptr());
  auto* v_base = static_cast<char*>(v_cache.data_ptr());
  const int64_t cs = k_cache.element_size();
  const int64_t c_block = k_cache.stride(0) * cs, c_token = k_cache.stride(1) * cs;
  const int64_t c_head = k_cache.stride(2) * cs;
  if (quantized) {
    auto run = [&](auto tag) {
      using In = decltype(tag);
      quantize_dispatch<In>(key, cache_type, k_base, slots, block_size, c_block, c_token, c_head);
      quantize_dispatch<In>(value, cache_type, v_base, slots, block_size, c_block, c_token, c_head);
    };
    switch (key.scalar_type()) {
      case at::kFloat: run(float{}); break;
      case at::kBFloat16: run(at::BFloat16{}); break;
      default: run(at::Half{}); break;
    }
    return;
  }
  const auto* key_ptr = static_cast<const char*>(key.data_ptr());
  const auto* value_ptr = static_cast<const char*>(value.data_ptr());
  const int64_t es = key.element_size(), row_bytes = head_dim * es;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t dst = (slots[t] / block_size) * c_block + (slots[t] % block_size) * c_token;
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(k_base + dst + h * c_head, key_ptr + (t * key.stride(0) + h * key.stride(1)) * es, row_bytes);
      std::memcpy(v_base + dst + h * c_head, value_ptr + (t * value.stride(0) + h * value.stride(1)) * es, row_bytes);
    }
  }
}

}  // namespace pagedllm

void register_kv_cache(pybind11::module& m) {
  m.def("reshape_and_cache", &pagedllm::reshape_and_cache,
        "write key/value [T, kv_heads, head_dim] into the caches at slot_mapping [T] (int64); "
        "an int8 / fp8 cache gets each row's codes and float32 scale");
}
