// Weight-only quantized linear layers for CPU: int4 and int8 weights in blocks of 32, as ggml
// stores them (Q4_0 / Q4_1 / Q4_K codes, Q8_0), multiplied without expanding the whole weight.
//
// A single stream's decode step is a chain of matrix-vector products bound by reading weights:
// 4-bit codes are a quarter of bfloat16's bytes, 8-bit half. Unlike torch's int4 CPU kernel,
// this one keeps ggml's layout and float16 scales (a GGUF's blocks exactly). Float activations
// go through linear_tiles.h's fixed order: each block of codes becomes the floats
// `*_dequantize` writes (w = q * scale + min, one rounding), int4's in the lane order of
// lane_weight, and is multiplied as a float weight would be, so a row's result does not depend
// on the rows beside it. A few rows expand the codes in registers; more expand kWeightRows rows
// at a time into a buffer that every row tile then reads. bfloat16 rows against int4 codes on
// AVX512-BF16 take the bf16 dot-product path instead (int4_takes_bf16), which is batch
// invariant in its own order: every output takes the same operations at every row count.
//
// Layout (per output row n, groups g of group_size = K / G input channels, a multiple of 32):
//   int4: qweight uint8 [N, K / 2]; in each 32-weight block, byte i holds weight i in its low
//         nibble and weight i + 16 in its high nibble (ggml's order). w = q * scale + min.
//   int8: qweight int8 [N, K]; w = q * scale.
//   scales, mins: float16 [N, G] (ggml keeps them in float16: GGUF codes are taken exactly).

#include <torch/extension.h>

#include "linear_tiles.h"
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

// Rows [0, R) of x (float [R][K]) against NT rows of codes (q + j * row_bytes; scales and
// mins as floats [NT][G]), the codes expanded in registers: y[r * N + j]. The same operations
// per output as tiles::dense_tile on the expanded weight.
template <int R, int NT, bool kInt4, typename T>
inline void codes_tile(const float* x, int64_t K, int64_t G, const uint8_t* q, int64_t row_bytes,
                       const float* scale, const float* mn, T* y, int64_t N) {
  const int64_t blocks = K / kBlock, blocks_per_group = blocks / G;
  Vec acc[R][NT];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NT; ++j) acc[r][j] = Vec(0.f);
  Vec w[kPieces];
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t g = b / blocks_per_group;
#pragma GCC unroll 4
    for (int j = 0; j < NT; ++j) {
      load_block_lanes<kInt4>(q + j * row_bytes, b, w);
      const Vec s(scale[j * G + g]), m(kInt4 ? mn[j * G + g] : 0.f);
#pragma GCC unroll 4
      for (int64_t i = 0; i < kPieces; ++i) {
        const Vec wi = at::vec::fmadd(w[i], s, m);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r)
          acc[r][j] = at::vec::fmadd(wi, Vec::loadu(x + r * K + b * kBlock + i * Vec::size()), acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NT; ++j) y[r * N + j] = static_cast<T>(tiles::reduce(acc[r][j]));
}

// Rows of codes as the floats dequantize_kernel writes, in the float path's order: w [rows][K].
template <bool kInt4>
inline void expand_rows(const uint8_t* q, int64_t row_bytes, const float* scale, const float* mn,
                        int64_t rows, int64_t K, int64_t G, float* out) {
  const int64_t blocks = K / kBlock, blocks_per_group = blocks / G;
  Vec w[kPieces];
  for (int64_t j = 0; j < rows; ++j) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t g = j * G + b / blocks_per_group;
      const Vec s(scale[g]), m(kInt4 ? mn[g] : 0.f);
      load_block_lanes<kInt4>(q + j * row_bytes, b, w);
      for (int64_t i = 0; i < kPieces; ++i)
        at::vec::fmadd(w[i], s, m).store(out + j * K + b * kBlock + i * Vec::size());
    }
  }
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#define PAGEDLLM_BF16_DOT 1
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

#ifdef PAGEDLLM_BF16_DOT
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
void int4_linear_bf16(T* yp, const at::Tensor& x, const uint8_t* qp, const at::Half* sp,
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
#endif

// Up to this many rows the codes are expanded in registers, kRegisterWeightRows weight rows at
// a time; more rows share one expansion of tiles::kWeightRows weight rows into a buffer.
constexpr int64_t kRegisterRows = 2;
constexpr int64_t kRegisterWeightRows = 4;

// y = x @ w.T in T (x's dtype); x [M, K] contiguous. Called once per layer and token in a
// decode step, so no torch operators inside (each costs microseconds at these sizes).
template <bool kInt4, typename T>
void quant_linear_kernel(at::Tensor& y, const at::Tensor& x, const at::Tensor& qweight,
                         const at::Tensor& scales, const at::Tensor* mins) {
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0), G = scales.size(1);
  T* yp = y.data_ptr<T>();
  const auto* qp = static_cast<const uint8_t*>(qweight.data_ptr());
  const at::Half* sp = scales.data_ptr<at::Half>();
  const at::Half* mp = mins ? mins->data_ptr<at::Half>() : nullptr;
  const int64_t row_bytes = qweight.size(1);
#ifdef PAGEDLLM_BF16_DOT
  if constexpr (kInt4 && std::is_same_v<T, at::BFloat16>) {
    if (int4_takes_bf16(K)) return int4_linear_bf16(yp, x, qp, sp, mp, row_bytes, M, K, N, G);
  }
#endif
  // x as float32 once, in the codes' lane order.
  constexpr bool kFloat = std::is_same_v<T, float>;
  tiles::AlignedFloats xbuf(kFloat && !kInt4 ? 0 : M * K), widened(!kFloat && kInt4 ? M * K : 0);
  const float* xp;
  if constexpr (kFloat) {
    xp = x.data_ptr<float>();
  } else {
    const T* src = x.data_ptr<T>();
    float* dst = kInt4 ? widened.data() : xbuf.data();
    for (int64_t i = 0; i < M * K; ++i) dst[i] = static_cast<float>(src[i]);
    xp = dst;
  }
  if constexpr (kInt4) {
    reorder_for_int4(xp, M * K, xbuf.data());
    xp = xbuf.data();
  }
  const bool in_registers = M <= kRegisterRows;
  const int64_t NT = in_registers ? kRegisterWeightRows : tiles::kWeightRows;
  const int64_t pass = in_registers ? M : tiles::rows_per_pass(K);
  for (int64_t m0 = 0; m0 < M; m0 += pass) {
    const int64_t rows_x = std::min(pass, M - m0);
    const float* xm = xp + m0 * K;
    T* ym = yp + m0 * N;
    // Each thread streams a contiguous range of weight rows, NT at a time.
    at::parallel_for(0, (N + NT - 1) / NT, 4, [&](int64_t first, int64_t last) {
      const int64_t end = std::min(N, last * NT);
      std::vector<float> sm(2 * NT * G);  // the tile's scales, then its mins, as floats
      float *sf = sm.data(), *mf = sf + NT * G;
      tiles::AlignedFloats wbuf(in_registers ? 0 : NT * K);
      for (int64_t n = first * NT; n < end; n += NT) {
        const int64_t rows = std::min(NT, end - n);
        const uint8_t* q = load_tile(qp, sp, mp, row_bytes, G, n, rows, end, sf, mf);
        if (!in_registers) {
          expand_rows<kInt4>(q, row_bytes, sf, mf, rows, K, G, wbuf.data());
          tiles::dense_rows_any(rows, xm, rows_x, K, wbuf.data(), K, ym + n, N);
        } else if (rows < NT) {
          for (int64_t j = 0; j < rows; ++j) {
            for (int64_t m = 0; m < rows_x; ++m) {
              codes_tile<1, 1, kInt4, T>(xm + m * K, K, G, q + j * row_bytes, row_bytes,
                                         sf + j * G, mf + j * G, ym + m * N + n + j, N);
            }
          }
        } else if (rows_x == 2) {
          codes_tile<2, kRegisterWeightRows, kInt4, T>(xm, K, G, q, row_bytes, sf, mf, ym + n, N);
        } else {
          codes_tile<1, kRegisterWeightRows, kInt4, T>(xm, K, G, q, row_bytes, sf, mf, ym + n, N);
        }
      }
    });
  }
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

bool int4_takes_bf16(int64_t K) {
#ifdef PAGEDLLM_BF16_DOT
  return (K / kBlock) % 2 == 0;  // whole pairs of blocks
#else
  return K < 0;  // never
#endif
}

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
  m.def("int4_takes_bf16", &pagedllm::int4_takes_bf16,
        "(K): whether int4_linear multiplies bfloat16 x of K columns with bf16 dot products "
        "(AVX512-BF16) rather than in float32");
  m.def("int4_dequantize", &pagedllm::int4_dequantize, no_gil, "(out [N, K], qweight, scales, mins): the weight");
  m.def("int8_dequantize", &pagedllm::int8_dequantize, no_gil, "(out [N, K], qweight, scales): the weight");
}
