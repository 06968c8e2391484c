// The KV cache's row formats (pagedllm/attention/kv_quant.py is their torch twin): a row (one
// token, one KV head) is head_dim floats of the cache's dtype, or head_dim one-byte codes (int8,
// fp8 e4m3, fp8 e5m2) followed by the row's float32 scale. Reading widens a row to floats;
// writing a quantized row does kv_quant.quantize's arithmetic, so both write the same bytes.
#pragma once

#include <torch/extension.h>

#include <ATen/cpu/vec/functional.h>  // load_to_float (vec.h alone lacks it on AVX-512)
#include <ATen/cpu/vec/vec.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace pagedllm {

constexpr int64_t kScaleBytes = 4;

template <typename T>
constexpr bool is_code_v = std::is_same_v<T, int8_t> || std::is_same_v<T, c10::Float8_e4m3fn> ||
                           std::is_same_v<T, c10::Float8_e5m2>;

template <typename T>
constexpr float max_code() {
  if constexpr (std::is_same_v<T, int8_t>) return 127.f;
  if constexpr (std::is_same_v<T, c10::Float8_e4m3fn>) return 448.f;
  return 57344.f;  // e5m2
}

inline bool is_code_type(at::ScalarType t) {
  return t == at::kChar || t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2;
}

// Elements of one cache row of type t for head_dim values.
inline int64_t row_elements(int64_t head_dim, at::ScalarType t) {
  return is_code_type(t) ? head_dim + kScaleBytes : head_dim;
}

// Every fp8 bit pattern as a float: a table lookup per code instead of the bit arithmetic.
template <typename T>
inline const float* fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = static_cast<float>(c10::bit_cast<T>(static_cast<uint8_t>(i)));
    return t;
  }();
  return table.data();
}

// One row of head_dim = num_vecs * Vec::size() values, as floats, into dst.
template <typename T>
inline void row_to_float(const T* src, float* dst, int64_t num_vecs) {
  using Vec = at::vec::Vectorized<float>;
  const int64_t n = num_vecs * Vec::size();
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else if constexpr (is_code_v<T>) {
    float scale;
    std::memcpy(&scale, reinterpret_cast<const char*>(src) + n, sizeof(float));
    const auto* codes = reinterpret_cast<const uint8_t*>(src);
    if constexpr (std::is_same_v<T, int8_t>) {
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]) * scale;
    } else {
#if defined(__AVX2__) && defined(__F16C__)
      // fp8 bits -> half bits, widened by F16C, 8 at a time: e5m2 is a half's top byte; e4m3's
      // exponent and mantissa shifted into a half's read 2^8 too small, so the scale takes the
      // 2^8 (exact: a power of two), and every product equals the table's.
      constexpr bool e4m3 = std::is_same_v<T, c10::Float8_e4m3fn>;
      const __m256 s = _mm256_set1_ps(e4m3 ? scale * 256.f : scale);
      for (int64_t i = 0; i < n; i += 8) {
        __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i)));
        if constexpr (e4m3) {
          x = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x80)), 8),
                           _mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x7F)), 7));
        } else {
          x = _mm_slli_epi16(x, 8);
        }
        _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtph_ps(x), s));
      }
#else
      const float* table = fp8_table<T>();
      for (int64_t i = 0; i < n; ++i) dst[i] = table[codes[i]] * scale;
#endif
    }
  } else {
    for (int64_t i = 0; i < num_vecs; ++i) {
      Vec out;
      at::vec::load_to_float<T>(src + i * Vec::size(), out);
      out.store(dst + i * Vec::size());
    }
  }
}

// x [n] -> n codes of T and the float32 scale after them, at dst.
template <typename T, typename In>
inline void quantize_row(const In* x, int64_t n, T* dst) {
  constexpr float kMax = max_code<T>();
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::abs(static_cast<float>(x[i])));
  const float scale = amax / kMax;
  const float inv = scale > 0.f ? 1.f / scale : 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float y = std::min(std::max(static_cast<float>(x[i]) * inv, -kMax), kMax);
    if constexpr (std::is_same_v<T, int8_t>) {
      dst[i] = static_cast<int8_t>(std::nearbyint(y));  // half to even, as torch.round
    } else {
      dst[i] = static_cast<T>(y);
    }
  }
  std::memcpy(reinterpret_cast<char*>(dst) + n, &scale, sizeof(float));
}

}  // namespace pagedllm
