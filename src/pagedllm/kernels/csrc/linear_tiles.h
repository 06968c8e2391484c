// y = x @ w.T with one order of operations per output element, whatever the number of rows in
// the step, a row's place among them, or the weight's format (float, or int4 / int8 codes
// expanded to the floats `*_dequantize` writes). For each (row m, weight row n):
//   acc (Vec::size() lanes) = fma(w[n, k:k+V], x[m, k:k+V], acc) for k = 0, V, 2V, ... in order,
//   y[m, n] = vec_reduce_all(acc) (a fixed tree), then the K % V tail added in order.
// Tiles of R rows x NT weight rows only choose which outputs are computed side by side, so a
// row's result is bit for bit the same alone, in any batch, and from codes or their float copy
// (the batch invariance of docs/determinism.md). The order depends on V, so on the CPU's vector
// width: machines with other instruction sets give other (equally invariant) results.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <vector>

namespace pagedllm {
namespace tiles {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t V = Vec::size();
// Rows x weight rows per tile: 12 accumulators and a weight vector within AVX2's 16
// registers, x read by the multiply-adds themselves (of the shapes tried on the AVX2 machine,
// 2 x 6 and 2 x 7 were the fastest; `cpu_microbench.py --fixed-order` times the result).
constexpr int kRows = 2;
constexpr int kWeightRows = 6;

// Rows of x per pass over the weight: a pass's rows stay in L2 while every weight tile reads
// them.
inline int64_t rows_per_pass(int64_t K) {
  const int64_t rows = (256 * 1024) / (K * int64_t(sizeof(float)));
  return std::max<int64_t>(kRows, rows / kRows * kRows);
}

// A float buffer aligned for vector loads (a std::vector's data is not, and loads that cross
// cache lines slow the tiles down).
struct AlignedFloats {
  explicit AlignedFloats(int64_t n) : storage(n + 16) {}
  float* data() {
    auto p = reinterpret_cast<std::uintptr_t>(storage.data());
    return reinterpret_cast<float*>((p + 63) & ~std::uintptr_t(63));
  }
  std::vector<float> storage;
};

inline float reduce(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// V weights as floats. A bfloat16 is a float's top 16 bits, so widening is exact: a bfloat16
// weight gives the same products as its float32 copy.
inline Vec load_weights(const float* w) { return Vec::loadu(w); }
inline Vec load_weights(const c10::BFloat16* w) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return Vec(_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
#else
  alignas(64) float wf[V];
  for (int64_t i = 0; i < V; ++i) wf[i] = static_cast<float>(w[i]);
  return Vec::loadu(wf);
#endif
}

// The K % V tail, then the output: the same for every tile shape.
template <typename T, typename W>
inline T finish(const Vec& acc, const float* x, const W* w, int64_t k, int64_t K) {
  float sum = reduce(acc);
  for (; k < K; ++k) sum += static_cast<float>(w[k]) * x[k];
  return static_cast<T>(sum);
}

// R rows of x (float, row stride x_stride) against NT weight rows (float or bfloat16, stride
// w_stride): out[r * out_stride + j].
template <int R, int NT, typename T, typename W>
inline void dense_tile(const float* x, int64_t x_stride, const W* w, int64_t w_stride,
                       int64_t K, T* out, int64_t out_stride) {
  Vec acc[R][NT];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NT; ++j) acc[r][j] = Vec(0.f);
  int64_t k = 0;
  for (; k + V <= K; k += V) {
    // One weight vector live at a time: 12 accumulators leave no room for more.
#pragma GCC unroll 8
    for (int j = 0; j < NT; ++j) {
      const Vec wv = load_weights(w + j * w_stride + k);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r][j] = at::vec::fmadd(wv, Vec::loadu(x + r * x_stride + k), acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NT; ++j)
      out[r * out_stride + j] = finish<T>(acc[r][j], x + r * x_stride, w + j * w_stride, k, K);
}

// All M rows of x against NT (<= kWeightRows) weight rows: kRows rows at a time, then the
// last one.
template <int NT, typename T, typename W>
inline void dense_rows(const float* x, int64_t M, int64_t K, const W* w, int64_t w_stride,
                       T* y, int64_t N) {
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) dense_tile<kRows, NT>(x + m * K, K, w, w_stride, K, y + m * N, N);
  if (M - m == 1) dense_tile<1, NT>(x + m * K, K, w, w_stride, K, y + m * N, N);
}

// dense_rows for any NT in 1..kWeightRows.
template <typename T, typename W>
inline void dense_rows_any(int64_t NT, const float* x, int64_t M, int64_t K, const W* w,
                           int64_t w_stride, T* y, int64_t N) {
  static_assert(kWeightRows == 6 && kRows == 2, "dense_rows and dense_rows_any follow the tile");
  switch (NT) {
    case 6: dense_rows<6>(x, M, K, w, w_stride, y, N); break;
    case 5: dense_rows<5>(x, M, K, w, w_stride, y, N); break;
    case 4: dense_rows<4>(x, M, K, w, w_stride, y, N); break;
    case 3: dense_rows<3>(x, M, K, w, w_stride, y, N); break;
    case 2: dense_rows<2>(x, M, K, w, w_stride, y, N); break;
    default: dense_rows<1>(x, M, K, w, w_stride, y, N); break;
  }
}

}  // namespace tiles
}  // namespace pagedllm
