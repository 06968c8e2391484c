// bfloat16 activations against int4 codes with AVX512-BF16 dot products (quant_linear.cpp's
// int4 path for bfloat16 x where the CPU has them; int4_takes_bf16 says when). Elsewhere this
// file builds to the answer "never".

#include <torch/extension.h>

#include "linear_tiles.h"
#include "ops.h"
#include "quant_blocks.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace pagedllm {
namespace quant {

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
namespace {

// bfloat16 activations against int4 codes with AVX512-BF16 dot products, two blocks at a time.
// A code q becomes the bfloat16 number 128 + q by OR-ing it into the mantissa of 128 (exact, no
// conversion instruction); the 128 * sum(x) that adds per block is taken back through the min
// term (`mn` holds min - 128 * scale). x_perm orders each pair of blocks (A, B) of a row as
// A0-15 B0-15 A16-31 B16-31, the order the codes unpack in, so the dot product's lanes 0-7 sum
// block A and lanes 8-15 block B. Every output takes the same operations whichever kernel
// below computes it (pair_step over the pairs in order, then finish), so a row's result does
// not depend on the rows beside it or on how many there are.

// A pair of blocks' codes (32 bytes) as bfloat16 128 + q: lo = the low nibbles, hi = the high.
inline void unpack_pair(const uint8_t* codes, __m512bh& lo, __m512bh& hi) {
  const __m512i low_nibble = _mm512_set1_epi16(0x000F), bf16_128 = _mm512_set1_epi16(0x4300);
  const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)));
  lo = (__m512bh)_mm512_ternarylogic_epi32(v, low_nibble, bf16_128, 0xEA);
  hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(v, 4), bf16_128);
}

// Block A's scale in lanes 0-7, block B's in 8-15.
inline __m512 pair_scale(const float* scale, int64_t ga, int64_t gb) {
  return _mm512_insertf32x8(_mm512_set1_ps(scale[ga]), _mm256_set1_ps(scale[gb]), 1);
}

inline __m512 pair_step(__m512 acc, __m512bh lo, __m512bh hi, __m512 s, const at::BFloat16* x) {
  const auto x0 = (__m512bh)_mm512_loadu_si512(x), x1 = (__m512bh)_mm512_loadu_si512(x + kBlock);
  const __m512 d = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), lo, x0), hi, x1);
  return _mm512_fmadd_ps(d, s, acc);
}

inline float finish(__m512 acc, const float* mn, const float* xsum, int64_t G) {
  return _mm512_reduce_add_ps(acc) + dot(mn, xsum, G);
}

// R rows of x_perm against NT rows of codes (q + j * row_bytes) unpacked in registers
// (decode): y[r * y_stride + j].
template <int R, int NT, typename T>
inline void int4_rows_bf16(const at::BFloat16* x_perm, const float* xsum, int64_t K, int64_t G,
                           const uint8_t* q, int64_t row_bytes, const float* scale,
                           const float* mn, T* y, int64_t y_stride) {
  const int64_t blocks = K / kBlock, blocks_per_group = blocks / G;
  __m512 acc[NT][R];
  for (int j = 0; j < NT; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; b += 2) {
    const int64_t ga = b / blocks_per_group, gb = (b + 1) / blocks_per_group;
    for (int j = 0; j < NT; ++j) {
      __m512bh lo, hi;
      unpack_pair(q + j * row_bytes + b * 16, lo, hi);
      const __m512 s = pair_scale(scale + j * G, ga, gb);
      for (int r = 0; r < R; ++r) acc[j][r] = pair_step(acc[j][r], lo, hi, s, x_perm + r * K + b * kBlock);
    }
  }
  for (int j = 0; j < NT; ++j)
    for (int r = 0; r < R; ++r)
      y[r * y_stride + j] = static_cast<T>(finish(acc[j][r], mn + j * G, xsum + r * G, G));
}

// Weight rows' codes unpacked once for many rows of x (prefill, big batches): per weight row
// and pair of blocks, lo, hi and the pair's scale as three vectors, read by every tile of rows.
struct UnpackedPanel {
  explicit UnpackedPanel(int64_t max_rows, int64_t K) : pairs(K / kBlock / 2), buf(max_rows * pairs * 48) {}
  void fill(const uint8_t* q, int64_t row_bytes, const float* scale, int64_t rows, int64_t K,
            int64_t G) {
    const int64_t blocks_per_group = K / kBlock / G;
    float* out = buf.data();
    for (int64_t j = 0; j < rows; ++j) {
      for (int64_t p = 0; p < pairs; ++p, out += 48) {
        __m512bh lo, hi;
        unpack_pair(q + j * row_bytes + p * 32, lo, hi);
        _mm512_store_ps(out, (__m512)lo);
        _mm512_store_ps(out + 16, (__m512)hi);
        const float* sj = scale + j * G;
        _mm512_store_ps(out + 32, pair_scale(sj, 2 * p / blocks_per_group, (2 * p + 1) / blocks_per_group));
      }
    }
  }
  const float* row(int64_t j) { return buf.data() + j * pairs * 48; }
  int64_t pairs;
  tiles::AlignedFloats buf;  // [rows][pairs][lo, hi, scale: 16 floats each]
};

// R rows of x_perm against NT unpacked weight rows w[j] (pair_step's operations per output).
template <int R, int NT, typename T>
inline void int4_panel_bf16(const at::BFloat16* x_perm, const float* xsum, int64_t K, int64_t G,
                            const float* const* w, int64_t pairs, const float* mn, T* y,
                            int64_t y_stride) {
  __m512 acc[NT][R];
#pragma GCC unroll 8
  for (int j = 0; j < NT; ++j)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const at::BFloat16* xr = x_perm + r * K + p * 2 * kBlock;
#pragma GCC unroll 8
      for (int j = 0; j < NT; ++j) {
        const float* wj = w[j] + p * 48;
        acc[j][r] = pair_step(acc[j][r], (__m512bh)_mm512_load_ps(wj), (__m512bh)_mm512_load_ps(wj + 16),
                              _mm512_load_ps(wj + 32), xr);
      }
    }
  }
  float sums[NT][R];
#pragma GCC unroll 8
  for (int j = 0; j < NT; ++j)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) sums[j][r] = _mm512_reduce_add_ps(acc[j][r]);
  for (int j = 0; j < NT; ++j)
    for (int r = 0; r < R; ++r)
      y[r * y_stride + j] = static_cast<T>(sums[j][r] + dot(mn + j * G, xsum + r * G, G));
}

// From this many rows of x the codes are unpacked once per panel of kPanelRows weight rows.
constexpr int64_t kPanelMinRows = 16;
constexpr int64_t kPanelRows = 16;
constexpr int kPanelTileRows = 4, kPanelTileN = 4;  // x rows by weight rows in registers

// R = kPanelTileRows rows of x at a time (fewer at the end) against NT weight rows of a panel.
template <int NT, typename T>
inline void panel_rows(const at::BFloat16* xq, const float* xs, int64_t M, int64_t K, int64_t G,
                       const float* const* w, int64_t pairs, const float* mf, T* y, int64_t N) {
  int64_t m = 0;
  for (; m + kPanelTileRows <= M; m += kPanelTileRows)
    int4_panel_bf16<kPanelTileRows, NT>(xq + m * K, xs + m * G, K, G, w, pairs, mf, y + m * N, N);
  for (; m < M; ++m) int4_panel_bf16<1, NT>(xq + m * K, xs + m * G, K, G, w, pairs, mf, y + m * N, N);
}

// x_perm [M, K] against all N weight rows, a panel at a time per thread.
template <typename T>
void int4_panels_bf16(T* yp, const at::BFloat16* xq, const float* xs, const uint8_t* qp,
                      const at::Half* sp, const at::Half* mp, int64_t row_bytes, int64_t M,
                      int64_t K, int64_t N, int64_t G) {
  at::parallel_for(0, (N + kPanelRows - 1) / kPanelRows, 1, [&](int64_t first, int64_t last) {
    std::vector<float> sm(2 * kPanelRows * G);
    float *sf = sm.data(), *mf = sf + kPanelRows * G;
    UnpackedPanel panel(kPanelRows, K);
    const int64_t end = std::min(N, last * kPanelRows);
    for (int64_t n = first * kPanelRows; n < end; n += kPanelRows) {
      const int64_t rows = std::min(kPanelRows, end - n);
      const uint8_t* qn = load_tile(qp, sp, mp, row_bytes, G, n, rows, end, sf, mf);
      for (int64_t i = 0; i < rows * G; ++i) mf[i] -= 128.f * sf[i];
      panel.fill(qn, row_bytes, sf, rows, K, G);
      int64_t j = 0;
      for (; j + kPanelTileN <= rows; j += kPanelTileN) {
        const float* w[kPanelTileN];
        for (int t = 0; t < kPanelTileN; ++t) w[t] = panel.row(j + t);
        panel_rows<kPanelTileN>(xq, xs, M, K, G, w, panel.pairs, mf + j * G, yp + n + j, N);
      }
      for (; j < rows; ++j) {
        const float* w[1] = {panel.row(j)};
        panel_rows<1>(xq, xs, M, K, G, w, panel.pairs, mf + j * G, yp + n + j, N);
      }
    }
  });
}

// bfloat16 x [M, K] (K whole pairs of blocks) against int4 codes with int4_rows_bf16, or for
// many rows the panels.
template <typename T>
void int4_bf16_kernel(T* yp, const at::Tensor& x, const uint8_t* qp, const at::Half* sp,
                      const at::Half* mp, int64_t row_bytes, int64_t M, int64_t K, int64_t N,
                      int64_t G) {
  const T* src = x.data_ptr<T>();
  std::vector<float> xsum(M * G);  // each group's sum, for the min term
  const int64_t group = K / G;
  for (int64_t i = 0; i < M * G; ++i) {
    float s = 0.f;
    for (int64_t k = 0; k < group; ++k) s += static_cast<float>(src[i * group + k]);
    xsum[i] = s;
  }
  std::vector<at::BFloat16> x_perm(M * K);
  for (int64_t b = 0; b < M * K; b += 2 * kBlock) {  // K is whole pairs: rows too
    for (int64_t i = 0; i < 16; ++i) {
      x_perm[b + i] = src[b + i];                     // A 0-15
      x_perm[b + 16 + i] = src[b + kBlock + i];       // B 0-15
      x_perm[b + 32 + i] = src[b + 16 + i];           // A 16-31
      x_perm[b + 48 + i] = src[b + kBlock + 16 + i];  // B 16-31
    }
  }
  if (M >= kPanelMinRows) return int4_panels_bf16(yp, x_perm.data(), xsum.data(), qp, sp, mp, row_bytes, M, K, N, G);
  constexpr int kRowsN = 4;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> sm(2 * kRowsN * G);
    float *sf = sm.data(), *mf = sf + kRowsN * G;
    const float* xs = xsum.data();
    const at::BFloat16* xq = x_perm.data();
    for (int64_t n = begin; n < end; n += kRowsN) {
      const int64_t rows = std::min<int64_t>(kRowsN, end - n);
      const uint8_t* qn = load_tile(qp, sp, mp, row_bytes, G, n, rows, end, sf, mf);
      T* yn = yp + n;
      for (int64_t i = 0; i < rows * G; ++i) mf[i] -= 128.f * sf[i];
      if (rows < kRowsN) {
        for (int64_t j = 0; j < rows; ++j) {
          for (int64_t m = 0; m < M; ++m) {
            int4_rows_bf16<1, 1>(xq + m * K, xs + m * G, K, G, qn + j * row_bytes, row_bytes,
                                 sf + j * G, mf + j * G, yn + m * N + j, N);
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
          int4_rows_bf16<3, 2>(xl, xs + m * G, K, G, qn + j * row_bytes, row_bytes, sf + j * G,
                               mf + j * G, yn + m * N + j, N);
        }
      } else if (left == 2) {
        int4_rows_bf16<2, kRowsN>(xl, xs + m * G, K, G, qn, row_bytes, sf, mf, yn + m * N, N);
      } else if (left == 1) {
        int4_rows_bf16<1, kRowsN>(xl, xs + m * G, K, G, qn, row_bytes, sf, mf, yn + m * N, N);
      }
    }
  });
}

}  // namespace

void int4_linear_bf16(at::BFloat16* y, const at::Tensor& x, const uint8_t* qp, const at::Half* sp,
                      const at::Half* mp, int64_t row_bytes, int64_t M, int64_t K, int64_t N,
                      int64_t G) {
  int4_bf16_kernel(y, x, qp, sp, mp, row_bytes, M, K, N, G);
}

}  // namespace quant

// Whole pairs of blocks: each dot product takes two.
bool int4_takes_bf16(int64_t K) { return (K / quant::kBlock) % 2 == 0; }

#else

void int4_linear_bf16(at::BFloat16*, const at::Tensor&, const uint8_t*, const at::Half*,
                      const at::Half*, int64_t, int64_t, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "int4_linear_bf16: this build has no AVX512-BF16");
}

}  // namespace quant

bool int4_takes_bf16(int64_t) { return false; }

#endif

}  // namespace pagedllm
