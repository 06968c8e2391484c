// Weight-only quantized linear layers for CPU: int4 and int8 weights in blocks of 32, as ggml
// stores them (Q4_0 / Q4_1 / Q4_K codes, Q8_0), multiplied without expanding the weight first.
//
// A single stream's decode step is a chain of matrix-vector products bound by reading weights:
// 4-bit codes are a quarter of bfloat16's bytes, 8-bit half. Unlike torch's int4 CPU kernel,
// this one keeps ggml's layout and float16 scales (a GGUF's blocks exactly), takes float32
// activations at full speed, and a single bfloat16 row with AVX512-BF16 dot products; each
// thread streams its own rows, prefetched ahead. Many rows are left to a float GEMM on the
// expanded weight (`*_dequantize`, layers/quantization/int_linear.py).
//
// Layout (per output row n, groups g of group_size = K / G input channels, a multiple of 32):
//   int4: qweight uint8 [N, K / 2]; in each 32-weight block, byte i holds weight i in its low
//         nibble and weight i + 16 in its high nibble (ggml's order). w = q * scale + min.
//   int8: qweight int8 [N, K]; w = q * scale.
//   scales, mins: float16 [N, G] (ggml keeps them in float16: GGUF codes are taken exactly).
// y[m, n] = sum_g scale[n, g] * dot(x[m, g], q[n, g]) + min[n, g] * sum(x[m, g]), in float32:
// each block of codes is expanded to floats once and used for every row of x.

#include <torch/extension.h>

#include "ops.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <vector>

namespace pagedllm {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kBlock = 32;
constexpr int64_t kPieces = kBlock / Vec::size();
constexpr int kRowTile = 4;  // rows of x sharing each expanded block of codes
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

// NT weight rows (codes q + j * row_bytes, scales and mins as floats [NT][G]) against R rows of
// x (float [R][K], group sums xsum [R][G]): y[r * y_stride + j]. The NT x R accumulators are
// independent chains of fused multiply-adds, which keeps the FMA units busy at one row of x.
template <int R, int NT, bool kInt4, typename T>
inline void dot_tile(const float* x, const float* xsum, int64_t K, int64_t G, const uint8_t* q,
                     int64_t row_bytes, const float* scale, const float* mn, T* y,
                     int64_t y_stride) {
  const int64_t blocks_per_group = K / G / kBlock;
  Vec acc[NT][R];
  for (int j = 0; j < NT; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = Vec(0.f);
  Vec w[kPieces];
  if (blocks_per_group == 1) {
    // ggml's layout, a scale per block: each block's product scaled as it is made, without the
    // per-group partial sums of the general case below (which GCC keeps on the stack and
    // zeroes with a memset per group: 5x slower at one row on AVX2).
    for (int64_t b = 0; b < G; ++b) {
#pragma GCC unroll 8
      for (int j = 0; j < NT; ++j) {
        load_block<kInt4>(q + j * row_bytes, b, w);
        const Vec s(scale[j * G + b]);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const float* xr = x + r * K + b * kBlock;
          Vec p = w[0] * Vec::loadu(xr);
#pragma GCC unroll 8
          for (int64_t i = 1; i < kPieces; ++i) p = at::vec::fmadd(w[i], Vec::loadu(xr + i * Vec::size()), p);
          acc[j][r] = at::vec::fmadd(p, s, acc[j][r]);
        }
      }
    }
  }
  int64_t b = 0;
  for (int64_t g = 0; g < G && blocks_per_group > 1; ++g) {
    Vec t[NT][R];
    for (int j = 0; j < NT; ++j)
      for (int r = 0; r < R; ++r) t[j][r] = Vec(0.f);
    for (int64_t end = b + blocks_per_group; b < end; ++b) {
      for (int j = 0; j < NT; ++j) {
        load_block<kInt4>(q + j * row_bytes, b, w);
        for (int64_t i = 0; i < kPieces; ++i) {
          const int64_t k = b * kBlock + i * Vec::size();
          for (int r = 0; r < R; ++r) t[j][r] = at::vec::fmadd(w[i], Vec::loadu(x + r * K + k), t[j][r]);
        }
      }
    }
    for (int j = 0; j < NT; ++j) {
      const Vec s(scale[j * G + g]);
      for (int r = 0; r < R; ++r) acc[j][r] = at::vec::fmadd(t[j][r], s, acc[j][r]);
    }
  }
  for (int j = 0; j < NT; ++j) {
    for (int r = 0; r < R; ++r) {
      const float m = kInt4 ? dot(mn + j * G, xsum + r * G, G) : 0.f;
      y[r * y_stride + j] = static_cast<T>(reduce_sum(acc[j][r]) + m);
    }
  }
}

#if defined(CPU_CAPABILITY_AVX2)
// dot_tile<1, 4> for ggml's layout (a scale per block of 32) in plain AVX2 intrinsics, every
// accumulator a register (GCC keeps dot_tile's arrays on the stack): one row of x, loaded once
// per block for the four weight rows. The same operations in the same order as dot_tile, so
// the same results.
template <bool kInt4, typename T>
inline void one_row_avx2(const float* x, const float* xsum, int64_t G, const uint8_t* q,
                         int64_t row_bytes, const float* scale, const float* mn, T* y) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
  const __m128i nibble = _mm_set1_epi8(15);
  auto block = [&](const uint8_t* row, int64_t b, __m256 x0, __m256 x1, __m256 x2, __m256 x3) {
    __m128i c0, c1;
    if constexpr (kInt4) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16));
      c0 = _mm_and_si128(bytes, nibble);
      c1 = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
    } else {
      c0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * kBlock));
      c1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * kBlock + 16));
    }
    auto widen = [](__m128i c) {
      return kInt4 ? _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c)) : _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c));
    };
    __m256 p = _mm256_mul_ps(widen(c0), x0);
    p = _mm256_fmadd_ps(widen(_mm_srli_si128(c0, 8)), x1, p);
    p = _mm256_fmadd_ps(widen(c1), x2, p);
    return _mm256_fmadd_ps(widen(_mm_srli_si128(c1, 8)), x3, p);
  };
  for (int64_t b = 0; b < G; ++b) {
    const float* xb = x + b * kBlock;
    const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8);
    const __m256 x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);
    acc0 = _mm256_fmadd_ps(block(q, b, x0, x1, x2, x3), _mm256_set1_ps(scale[b]), acc0);
    acc1 = _mm256_fmadd_ps(block(q + row_bytes, b, x0, x1, x2, x3), _mm256_set1_ps(scale[G + b]), acc1);
    acc2 = _mm256_fmadd_ps(block(q + 2 * row_bytes, b, x0, x1, x2, x3), _mm256_set1_ps(scale[2 * G + b]), acc2);
    acc3 = _mm256_fmadd_ps(block(q + 3 * row_bytes, b, x0, x1, x2, x3), _mm256_set1_ps(scale[3 * G + b]), acc3);
  }
  const __m256 accs[4] = {acc0, acc1, acc2, acc3};
  for (int j = 0; j < 4; ++j) {
    const float m = kInt4 ? dot(mn + j * G, xsum, G) : 0.f;
    y[j] = static_cast<T>(reduce_sum(Vec(accs[j])) + m);
  }
}
#endif

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#define PAGEDLLM_BF16_DOT 1
// R rows of bfloat16 activations against NT rows of int4 codes with AVX512-BF16 dot products
// (decode), two blocks at a time. A code q becomes the bfloat16 number 128 + q by OR-ing it
// into the mantissa of 128 (no conversion instruction); the 128 * sum(x) that adds per block is
// taken back through the min term (`mn` holds min - 128 * scale). x_perm orders each pair of
// blocks (A, B) of a row as A0-15 B0-15 A16-31 B16-31, the order the codes unpack in, so the
// dot product's lanes 0-7 sum block A and lanes 8-15 block B. y[r * y_stride + j].
template <int R, int NT, typename T>
inline void int4_rows_bf16(const at::BFloat16* x_perm, const float* xsum, int64_t K, int64_t G,
                           const uint8_t* q, int64_t row_bytes, const float* scale,
                           const float* mn, T* y, int64_t y_stride) {
  const int64_t blocks = K / kBlock, blocks_per_group = blocks / G;
  const __m512i low_nibble = _mm512_set1_epi16(0x000F), bf16_128 = _mm512_set1_epi16(0x4300);
  __m512 acc[NT][R];
  for (int j = 0; j < NT; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; b += 2) {
    __m512bh x0[R], x1[R];
    for (int r = 0; r < R; ++r) {
      x0[r] = (__m512bh)_mm512_loadu_si512(x_perm + r * K + b * kBlock);
      x1[r] = (__m512bh)_mm512_loadu_si512(x_perm + r * K + b * kBlock + kBlock);
    }
    const int64_t ga = b / blocks_per_group, gb = (b + 1) / blocks_per_group;
    for (int j = 0; j < NT; ++j) {
      const __m512i v = _mm512_cvtepu8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j * row_bytes + b * 16)));
      const auto lo = (__m512bh)_mm512_ternarylogic_epi32(v, low_nibble, bf16_128, 0xEA);
      const auto hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(v, 4), bf16_128);
      const float* sj = scale + j * G;
      const __m512 s = _mm512_insertf32x8(_mm512_set1_ps(sj[ga]), _mm256_set1_ps(sj[gb]), 1);
      for (int r = 0; r < R; ++r) {
        const __m512 d = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), lo, x0[r]), hi, x1[r]);
        acc[j][r] = _mm512_fmadd_ps(d, s, acc[j][r]);
      }
    }
  }
  for (int j = 0; j < NT; ++j) {
    for (int r = 0; r < R; ++r) {
      const float sum = _mm512_reduce_add_ps(acc[j][r]) + dot(mn + j * G, xsum + r * G, G);
      y[r * y_stride + j] = static_cast<T>(sum);
    }
  }
}
#endif

void check_weights(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor* mins,
                   int64_t K, bool int4) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous(), "qweight: [N, K or K / 2], contiguous");
  TORCH_CHECK(qweight.scalar_type() == (int4 ? at::kByte : at::kChar),
              int4 ? "int4 qweight: uint8" : "int8 qweight: int8");
  TORCH_CHECK(qweight.size(1) * (int4 ? 2 : 1) == K, "qweight's columns do not match K = ", K);
  TORCH_CHECK(scales.dim() == 2 && scales.is_contiguous() && scales.scalar_type() == at::kHalf &&
                  scales.size(0) == qweight.size(0),
              "scales: float16 [N, G], contiguous");
  const int64_t G = scales.size(1);
  TORCH_CHECK(G > 0 && K % G == 0 && (K / G) % kBlock == 0,
              "the group size K / G must be a multiple of 32");
  if (mins) {
    TORCH_CHECK(mins->sizes() == scales.sizes() && mins->is_contiguous() &&
                    mins->scalar_type() == at::kHalf,
                "mins: float16 [N, G] like scales");
  }
}

// y = x @ w.T in T (x's dtype); x [M, K] contiguous. Called once per layer and token in a
// decode step, so no torch operators inside (each costs microseconds at these sizes).
template <bool kInt4, typename T>
void quant_linear_kernel(at::Tensor& y, const at::Tensor& x, const at::Tensor& qweight,
                         const at::Tensor& scales, const at::Tensor* mins) {
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0), G = scales.size(1);
  // x as float32 once, with each group's sum for the min term.
  std::vector<float> xbuf;
  const float* xp;
  if constexpr (std::is_same_v<T, float>) {
    xp = x.data_ptr<float>();
  } else {
    xbuf.resize(M * K);
    const T* src = x.data_ptr<T>();
    for (int64_t i = 0; i < M * K; ++i) xbuf[i] = static_cast<float>(src[i]);
    xp = xbuf.data();
  }
  std::vector<float> xsum(kInt4 ? M * G : 0);
  if constexpr (kInt4) {
    const int64_t group = K / G;
    for (int64_t i = 0; i < M * G; ++i) {
      float s = 0.f;
      for (int64_t k = 0; k < group; ++k) s += xp[i * group + k];
      xsum[i] = s;
    }
  }
  T* yp = y.data_ptr<T>();
#ifdef PAGEDLLM_BF16_DOT
  // bfloat16 rows and whole pairs of blocks: the AVX512-BF16 path (int4_rows_bf16).
  bool bf16_dot = false;
  std::vector<at::BFloat16> x_perm;
  if constexpr (kInt4 && std::is_same_v<T, at::BFloat16>) {
    bf16_dot = (K / kBlock) % 2 == 0;
    if (bf16_dot) {
      x_perm.resize(M * K);
      const T* src = x.data_ptr<T>();
      for (int64_t b = 0; b < M * K; b += 2 * kBlock) {  // K is whole pairs: rows too
        for (int64_t i = 0; i < 16; ++i) {
          x_perm[b + i] = src[b + i];                     // A 0-15
          x_perm[b + 16 + i] = src[b + kBlock + i];       // B 0-15
          x_perm[b + 32 + i] = src[b + 16 + i];           // A 16-31
          x_perm[b + 48 + i] = src[b + kBlock + 16 + i];  // B 16-31
        }
      }
    }
  }
#endif
  const auto* qp = static_cast<const uint8_t*>(qweight.data_ptr());
  const at::Half* sp = scales.data_ptr<at::Half>();
  const at::Half* mp = mins ? mins->data_ptr<at::Half>() : nullptr;
  const int64_t row_bytes = qweight.size(1);
  // Each thread streams a contiguous range of weight rows, kRowsN at a time.
  constexpr int kRowsN = 4;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> sm(2 * kRowsN * G);  // the tile's scales, then its mins, as floats
    float* sf = sm.data();
    float* mf = sf + kRowsN * G;
    const float* xs = xsum.data();
    for (int64_t n = begin; n < end; n += kRowsN) {
      const int64_t rows = std::min<int64_t>(kRowsN, end - n);
      half_to_float(sp + n * G, sf, rows * G);
      if (mp) half_to_float(mp + n * G, mf, rows * G);
      const uint8_t* qn = qp + n * row_bytes;
      T* yn = yp + n;
      // Cold weights stream at a few GB/s a core unless fetched ahead of use: ask for the
      // rows kPrefetchBytes ahead (within this thread's range) while this tile computes.
      const int64_t tile_bytes = rows * row_bytes;
      if ((n + rows) * row_bytes + kPrefetchBytes <= end * row_bytes) {
        const uint8_t* ahead = qn + kPrefetchBytes;
        for (int64_t off = 0; off < tile_bytes; off += 64) __builtin_prefetch(ahead + off, 0, 2);
        const int64_t ahead_rows = kPrefetchBytes / row_bytes;
        __builtin_prefetch(sp + (n + ahead_rows) * G, 0, 2);
        if (mp) __builtin_prefetch(mp + (n + ahead_rows) * G, 0, 2);
      }
#ifdef PAGEDLLM_BF16_DOT
      if constexpr (kInt4 && std::is_same_v<T, at::BFloat16>) {
        if (bf16_dot) {
          for (int64_t i = 0; i < rows * G; ++i) mf[i] -= 128.f * sf[i];
          const at::BFloat16* xq = x_perm.data();
          if (rows < kRowsN) {
            for (int64_t j = 0; j < rows; ++j) {
              for (int64_t m = 0; m < M; ++m) {
                int4_rows_bf16<1, 1>(xq + m * K, xs + m * G, K, G, qn + j * row_bytes,
                                     row_bytes, sf + j * G, mf + j * G, yn + m * N + j, N);
              }
            }
            continue;
          }
          int64_t m = 0;
          for (; m + kRowTile <= M; m += kRowTile) {
            for (int64_t j = 0; j < kRowsN; j += 2) {
              int4_rows_bf16<kRowTile, 2>(xq + m * K, xs + m * G, K, G, qn + j * row_bytes,
                                          row_bytes, sf + j * G, mf + j * G, yn + m * N + j, N);
            }
          }
          const int64_t left = M - m;
          const at::BFloat16* xl = xq + m * K;
          if (left == 3) {
            for (int64_t j = 0; j < kRowsN; j += 2) {
              int4_rows_bf16<3, 2>(xl, xs + m * G, K, G, qn + j * row_bytes, row_bytes,
                                   sf + j * G, mf + j * G, yn + m * N + j, N);
            }
          } else if (left == 2) {
            int4_rows_bf16<2, kRowsN>(xl, xs + m * G, K, G, qn, row_bytes, sf, mf, yn + m * N, N);
          } else if (left == 1) {
            int4_rows_bf16<1, kRowsN>(xl, xs + m * G, K, G, qn, row_bytes, sf, mf, yn + m * N, N);
          }
          continue;
        }
      }
#endif
      if (rows < kRowsN) {
        for (int64_t j = 0; j < rows; ++j) {
          for (int64_t m = 0; m < M; ++m) {
            dot_tile<1, 1, kInt4, T>(xp + m * K, xs + m * G, K, G, qn + j * row_bytes, row_bytes,
                                  sf + j * G, mf + j * G, yn + m * N + j, N);
          }
        }
        continue;
      }
      int64_t m = 0;
      for (; m + kRowTile <= M; m += kRowTile) {
        dot_tile<kRowTile, 2, kInt4, T>(xp + m * K, xs + m * G, K, G, qn, row_bytes, sf, mf,
                                     yn + m * N, N);
        dot_tile<kRowTile, 2, kInt4, T>(xp + m * K, xs + m * G, K, G, qn + 2 * row_bytes,
                                     row_bytes, sf + 2 * G, mf + 2 * G, yn + m * N + 2, N);
      }
      const float* xm = xp + m * K;
      const float* xsm = xs + m * G;
      switch (M - m) {  // the last 1-3 rows, in one pass over the codes
        case 3:
          dot_tile<3, 2, kInt4, T>(xm, xsm, K, G, qn, row_bytes, sf, mf, yn + m * N, N);
          dot_tile<3, 2, kInt4, T>(xm, xsm, K, G, qn + 2 * row_bytes, row_bytes, sf + 2 * G,
                                mf + 2 * G, yn + m * N + 2, N);
          break;
        case 2:
          dot_tile<2, kRowsN, kInt4, T>(xm, xsm, K, G, qn, row_bytes, sf, mf, yn + m * N, N);
          break;
        case 1:
#if defined(CPU_CAPABILITY_AVX2)
          if (K == G * kBlock) {
            one_row_avx2<kInt4, T>(xm, xsm, G, qn, row_bytes, sf, mf, yn + m * N);
            break;
          }
#endif
          dot_tile<1, kRowsN, kInt4, T>(xm, xsm, K, G, qn, row_bytes, sf, mf, yn + m * N, N);
          break;
      }
    }
  });
}

template <bool kInt4>
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const at::Tensor* mins) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: [M, K], contiguous");
  check_weights(qweight, scales, mins, x.size(1), kInt4);
  at::Tensor y = at::empty({x.size(0), qweight.size(0)}, x.options());
  switch (x.scalar_type()) {
    case at::kFloat: quant_linear_kernel<kInt4, float>(y, x, qweight, scales, mins); break;
    case at::kBFloat16: quant_linear_kernel<kInt4, at::BFloat16>(y, x, qweight, scales, mins); break;
    case at::kHalf: quant_linear_kernel<kInt4, at::Half>(y, x, qweight, scales, mins); break;
    default: TORCH_CHECK(false, "quantized linear: float32, bfloat16 or float16 x, not ", x.scalar_type());
  }
  return y;
}

}  // namespace

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& mins) {
  return quant_linear<true>(x, qweight, scales, &mins);
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  return quant_linear<false>(x, qweight, scales, nullptr);
}

namespace {

// The weight [N, K] in `dtype`: for products with many rows, which a float GEMM does better.
template <bool kInt4, typename T>
void dequantize_kernel(at::Tensor& out, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor* mins) {
  const int64_t N = out.size(0), K = out.size(1), G = scales.size(1);
  const int64_t blocks_per_group = K / G / kBlock, row_bytes = qweight.size(1);
  const auto* qp = static_cast<const uint8_t*>(qweight.data_ptr());
  const at::Half* sp = scales.data_ptr<at::Half>();
  const at::Half* mp = mins ? mins->data_ptr<at::Half>() : nullptr;
  T* op = out.data_ptr<T>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    Vec w[kPieces];
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t b = 0; b < K / kBlock; ++b) {
        const int64_t g = n * G + b / blocks_per_group;
        const Vec s(static_cast<float>(sp[g]));
        const Vec m(mp ? static_cast<float>(mp[g]) : 0.f);
        load_block<kInt4>(qp + n * row_bytes, b, w);
        T* dst = op + n * K + b * kBlock;
        if constexpr (std::is_same_v<T, float>) {
          for (int64_t i = 0; i < kPieces; ++i) at::vec::fmadd(w[i], s, m).store(dst + i * Vec::size());
        } else {
          for (int64_t i = 0; i < kPieces; i += 2) {
            at::vec::convert_from_float<T>(at::vec::fmadd(w[i], s, m), at::vec::fmadd(w[i + 1], s, m))
                .store(dst + i * Vec::size());
          }
        }
      }
    }
  });
}

// Into `out` [N, K] (float32, bfloat16 or float16, contiguous): a caller can reuse one buffer.
template <bool kInt4>
void dequantize(at::Tensor out, const at::Tensor& qweight, const at::Tensor& scales,
                const at::Tensor* mins) {
  const int64_t K = qweight.size(1) * (kInt4 ? 2 : 1);
  check_weights(qweight, scales, mins, K, kInt4);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == qweight.size(0) && out.size(1) == K &&
                  out.is_contiguous(),
              "out: [N, K], contiguous");
  const at::ScalarType dtype = out.scalar_type();
  switch (dtype) {
    case at::kFloat: dequantize_kernel<kInt4, float>(out, qweight, scales, mins); break;
    case at::kBFloat16: dequantize_kernel<kInt4, at::BFloat16>(out, qweight, scales, mins); break;
    case at::kHalf: dequantize_kernel<kInt4, at::Half>(out, qweight, scales, mins); break;
    default: TORCH_CHECK(false, "dequantize: float32, bfloat16 or float16, not ", dtype);
  }
}

}  // namespace

void int4_dequantize(at::Tensor out, const at::Tensor& qweight, const at::Tensor& scales,
                     const at::Tensor& mins) {
  dequantize<true>(out, qweight, scales, &mins);
}

void int8_dequantize(at::Tensor out, const at::Tensor& qweight, const at::Tensor& scales) {
  dequantize<false>(out, qweight, scales, nullptr);
}

}  // namespace pagedllm

void register_quant_linear(pybind11::module& m) {
  // Without the GIL, as torch's own operators run: the server's HTTP thread can work meanwhile.
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("int4_linear", &pagedllm::int4_linear, no_gil,
        "x [M, K] @ int4 weight.T -> [M, N] in x's dtype: (x, qweight uint8 [N, K / 2], "
        "scales float16 [N, G], mins float16 [N, G])");
  m.def("int8_linear", &pagedllm::int8_linear, no_gil,
        "x [M, K] @ int8 weight.T -> [M, N] in x's dtype: (x, qweight int8 [N, K], scales "
        "float16 [N, G])");
  m.def("int4_dequantize", &pagedllm::int4_dequantize, no_gil, "(out [N, K], qweight, scales, mins): the weight");
  m.def("int8_dequantize", &pagedllm::int8_dequantize, no_gil, "(out [N, K], qweight, scales): the weight");
}
