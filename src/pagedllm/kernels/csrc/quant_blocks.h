// Blocks of int4 / int8 codes as ggml stores them, for the weight-only quantized linear layers
// (quant_linear.cpp, and its AVX512-BF16 kernel in quant_int4_bf16.cpp): loading a block's
// codes as float vectors, the float path's lane order for int4, the float16 scales and mins
// converted per tile with a prefetch of the rows ahead, and the weights' checks.
#pragma once

#include <torch/extension.h>

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <cstdint>

namespace pagedllm {
namespace quant {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kBlock = 32;
constexpr int64_t kPieces = kBlock / Vec::size();
constexpr int kRowTile = 4;  // bfloat16 rows sharing each unpacked block of codes
constexpr int64_t kPrefetchBytes = 4096;  // measured: 1-16 KB ahead all gain ~30% over none

inline float reduce_sum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// Block b of a row's codes as kPieces float vectors (the block's 32 weights in order).
template <bool kInt4>
inline void load_block(const uint8_t* row, int64_t b, Vec* w) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (kInt4) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16)));
    w[0] = Vec(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15))));
    w[1] = Vec(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)));
  } else {
    const auto* p = reinterpret_cast<const __m128i*>(row + b * kBlock);
    w[0] = Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p))));
    w[1] = Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1))));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  // Eight codes per vector: widened to 32-bit integers, then converted (the scalar loop of the
  // plain build left GCC's code at a byte a cycle, ten times slower than reading them).
  if constexpr (kInt4) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16));
    const __m128i nibble = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(bytes, nibble);                     // codes 0-15
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);  // codes 16-31
    w[0] = Vec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)));
    w[1] = Vec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))));
    w[2] = Vec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)));
    w[3] = Vec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))));
  } else {
    const auto* p = reinterpret_cast<const __m128i*>(row + b * kBlock);
    for (int i = 0; i < 2; ++i) {
      const __m128i v = _mm_loadu_si128(p + i);
      w[2 * i] = Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)));
      w[2 * i + 1] = Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))));
    }
  }
#else
  alignas(64) float f[kBlock];
  if constexpr (kInt4) {
    const uint8_t* p = row + b * 16;
    for (int i = 0; i < 16; ++i) {
      f[i] = static_cast<float>(p[i] & 15);
      f[i + 16] = static_cast<float>(p[i] >> 4);
    }
  } else {
    const auto* p = reinterpret_cast<const int8_t*>(row + b * kBlock);
    for (int i = 0; i < kBlock; ++i) f[i] = static_cast<float>(p[i]);
  }
  for (int64_t i = 0; i < kPieces; ++i) w[i] = Vec::loadu(f + i * Vec::size());
#endif
}

// The float path's lane order for int4 codes: piece i (of kPieces vectors), lane L holds the
// block's weight lane_weight(i, L). A block's 16 bytes, as four 32-bit words repeated across
// the vector, give every piece with one shift and one mask per lane (no byte shuffles, which
// held the natural order's kernel to 9 cycles a block): lane L takes word L % 4 and nibble
// L / 4 + (V / 4) * i of it, byte 4 * (L % 4) + nibble / 2, the weight that byte holds in its
// low (even nibble) or high half (+16). x is reordered the same way once per call; the sums
// then run over the same products in the same order at every row count.
inline int64_t lane_weight(int64_t i, int64_t lane) {
  const int64_t nibble = lane / 4 + (Vec::size() / 4) * i;
  return 4 * (lane % 4) + nibble / 2 + 16 * (nibble % 2);
}

// Block b of a row's codes as kPieces float vectors in the float path's order: int4 in
// lane_weight's, int8 in the natural order (its codes are whole bytes).
template <bool kInt4>
inline void load_block_lanes(const uint8_t* row, int64_t b, Vec* w) {
  if constexpr (!kInt4) {
    load_block<false>(row, b, w);
  } else {
#if defined(CPU_CAPABILITY_AVX2)
    const __m256i words = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16)));
    const __m256i nibble = _mm256_set1_epi32(15);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const __m256i shift = _mm256_setr_epi32(8 * i, 8 * i, 8 * i, 8 * i, 8 * i + 4, 8 * i + 4, 8 * i + 4, 8 * i + 4);
      w[i] = Vec(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(words, shift), nibble)));
    }
#elif defined(CPU_CAPABILITY_AVX512)
    const __m512i words = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16)));
    const __m512i nibble = _mm512_set1_epi32(15);
#pragma GCC unroll 2
    for (int i = 0; i < 2; ++i) {
      const int s = 16 * i;
      const __m512i shift = _mm512_setr_epi32(s, s, s, s, s + 4, s + 4, s + 4, s + 4, s + 8, s + 8, s + 8,
                                              s + 8, s + 12, s + 12, s + 12, s + 12);
      w[i] = Vec(_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(words, shift), nibble)));
    }
#else
    alignas(64) float f[kBlock];
    const uint8_t* p = row + b * 16;
    for (int64_t i = 0; i < kPieces; ++i) {
      for (int64_t lane = 0; lane < Vec::size(); ++lane) {
        const int64_t k = lane_weight(i, lane);
        f[i * Vec::size() + lane] = static_cast<float>(k < 16 ? p[k] & 15 : p[k - 16] >> 4);
      }
    }
    for (int64_t i = 0; i < kPieces; ++i) w[i] = Vec::loadu(f + i * Vec::size());
#endif
  }
}

// x [M, K] (K whole blocks) in the float path's order for int4 codes.
inline void reorder_for_int4(const float* x, int64_t count, float* out) {
  int64_t at_lane[kBlock];
  for (int64_t i = 0; i < kPieces; ++i)
    for (int64_t lane = 0; lane < Vec::size(); ++lane) at_lane[i * Vec::size() + lane] = lane_weight(i, lane);
  for (int64_t b = 0; b < count; b += kBlock)
    for (int64_t j = 0; j < kBlock; ++j) out[b + j] = x[b + at_lane[j]];
}

// float16 [count] -> float [count].
inline void half_to_float(const at::Half* src, float* dst, int64_t count) {
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX2) && defined(__F16C__)
  // F16C: ATen's AVX2 load_to_float<Half> converts one number at a time.
  for (; i + 8 <= count; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
#endif
  for (; i + Vec::size() <= count; i += Vec::size()) {
    Vec v;
    at::vec::load_to_float<at::Half>(src + i, v);
    v.store(dst + i);
  }
  for (; i < count; ++i) dst[i] = static_cast<float>(src[i]);
}

inline float dot(const float* a, const float* b, int64_t count) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= count; i += Vec::size()) acc = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc);
  float sum = reduce_sum(acc);
  for (; i < count; ++i) sum += a[i] * b[i];
  return sum;
}

// qweight, scales and mins fit a [N, K] weight in blocks of 32 (quant_linear.cpp).
void check_weights(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor* mins,
                   int64_t K, bool int4);

// The codes of weight rows [n, n + rows), their scales and mins converted into sf and mf, and a
// prefetch of the rows kPrefetchBytes ahead within the thread's range [.., end).
inline const uint8_t* load_tile(const uint8_t* qp, const at::Half* sp, const at::Half* mp,
                                int64_t row_bytes, int64_t G, int64_t n, int64_t rows,
                                int64_t end, float* sf, float* mf) {
  half_to_float(sp + n * G, sf, rows * G);
  if (mp) half_to_float(mp + n * G, mf, rows * G);
  const uint8_t* qn = qp + n * row_bytes;
  // Cold weights stream at a few GB/s a core unless fetched ahead of use: ask for the rows
  // kPrefetchBytes ahead (within this thread's range) while this tile computes.
  if ((n + rows) * row_bytes + kPrefetchBytes <= end * row_bytes) {
    const uint8_t* ahead = qn + kPrefetchBytes;
    for (int64_t off = 0; off < rows * row_bytes; off += 64) __builtin_prefetch(ahead + off, 0, 2);
    const int64_t ahead_rows = kPrefetchBytes / row_bytes;
    __builtin_prefetch(sp + (n + ahead_rows) * G, 0, 2);
    if (mp) __builtin_prefetch(mp + (n + ahead_rows) * G, 0, 2);
  }
  return qn;
}

// bfloat16 y [M, N] = x [M, K] @ the int4 weight.T with AVX512-BF16 dot products
// (quant_int4_bf16.cpp), for a K that int4_takes_bf16; without AVX512-BF16, an error.
void int4_linear_bf16(at::BFloat16* y, const at::Tensor& x, const uint8_t* qp, const at::Half* sp,
                      const at::Half* mp, int64_t row_bytes, int64_t M, int64_t K, int64_t N,
                      int64_t G);

}  // namespace quant
}  // namespace pagedllm
