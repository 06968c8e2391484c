// int8_act.h's tiles with AVX2: vpmaddubsw (unsigned code x signed activation, pairs summed to
// 16 bits) then vpmaddwd by ones (to 32 bits), eight output rows per 256-bit register, a tile
// as two halves. int8 codes are made signed again and their signs moved onto the activations
// (|q| * sign(x, q)), so no pair can saturate 16 bits: 2 * 128 * 127 < 32768. int4's pairs are
// small enough to add up a whole block in 16 bits before widening (rows_tile_int4).
//
// The same loops with AVX-VNNI (kVnni: Intel's client cores since Alder Lake, Zen 5; 256-bit
// registers, no AVX-512): vpdpbusd adds the four products of a lane to 32 bits in one
// instruction, exact, with nothing held in 16 bits.

#include "int8_act.h"

#ifdef PAGEDLLM_INT8_ACT_AVX2
#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace pagedllm {
namespace int8_act {
namespace {

constexpr int kInt4Rows = 4;  // rows of an int4 call: 2 x 4 accumulators, 5 more registers

inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// acc + the products of unsigned a0, a1 and signed b0, b1, four to a 32-bit lane, exact: vpdpbusd,
// or each chunk's pairs (at most 2 * 63 * 127: int4's and int6's codes) added in 16 bits.
template <bool kVnni>
inline __m256i add_dot8(__m256i acc, __m256i a0, __m256i b0, __m256i a1, __m256i b1) {
#ifdef PAGEDLLM_INT8_ACT_AVX_VNNI
  if constexpr (kVnni) return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc, a0, b0), a1, b1);
#endif
  const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(a0, b0), _mm256_maddubs_epi16(a1, b1));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

// The same for one chunk of a <= 128 (each pair at most 2 * 128 * 127).
template <bool kVnni>
inline __m256i add_dot4(__m256i acc, __m256i a, __m256i b) {
#ifdef PAGEDLLM_INT8_ACT_AVX_VNNI
  if constexpr (kVnni) return _mm256_dpbusd_avx_epi32(acc, a, b);
#endif
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)));
}

// int6's codes u = q + 32 for half g of a block in chunk j's layout, for 8 of the tile's rows
// (h): the nibble and its pair of high bits moved to bits 4-5 (int8_act_avx512_vnni.cpp).
inline __m256i int6_codes(const uint8_t* cb, int g, int j, int h) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + j * 64 + h * 32));
  const __m256i nib = g == 0 ? _mm256_and_si256(v, nibble) : _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
  __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + 256 + j / 2 * 64 + h * 32));
  const int at = 4 * (j % 2) + 2 * g;
  if (at < 4) pairs = _mm256_sll_epi16(pairs, _mm_cvtsi32_si128(4 - at));
  if (at > 4) pairs = _mm256_srli_epi16(pairs, 2);
  return _mm256_or_si256(nib, _mm256_and_si256(pairs, _mm256_set1_epi8(0x30)));
}

// kHalves: scales per block (2: int8x, int6); kMins: int4, and int8x or int6 with a min not 0.
template <bool kVnni, int R, int kBits, int kHalves, bool kMins>
inline void rows_tile(const Activations& x, int64_t m, const Weights& w, int64_t t, Span span, float* y,
                      int64_t ldy) {
  const int64_t blocks = w.blocks(), K = w.K;
  const uint8_t* codes = w.codes + t * w.tile_bytes();
  const uint16_t* scales = w.scales + t * blocks * kHalves * kTile;
  const uint16_t* mins = kMins ? w.mins + t * blocks * kTile : nullptr;
  constexpr int64_t kBlockBytes = kBlock * kTile * kBits / 8;
  const __m256i nibble = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(-128);
  const int64_t live = std::min<int64_t>(kTile, w.N - t * kTile);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) {
    if (span.first) {
      acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    } else {
      alignas(32) float tmp[kTile] = {};
      std::memcpy(tmp, y + (m + r) * ldy + t * kTile, live * sizeof(float));
      acc[r][0] = _mm256_load_ps(tmp);
      acc[r][1] = _mm256_load_ps(tmp + 8);
    }
  }
  for (int64_t b = span.b0; b < span.b1; ++b) {
    const uint8_t* cb = codes + b * kBlockBytes;
    __m256i isum[R][2];  // [row][which 8 of the tile's 16 output rows]
    for (int g = 0; g < kHalves; ++g) {  // the whole block, or each half block of int8x
      for (int r = 0; r < R; ++r) isum[r][0] = isum[r][1] = _mm256_setzero_si256();
      for (int h = 0; h < 2; ++h) {
        if constexpr (kBits == 4) {
#pragma GCC unroll 4
          for (int j = 0; j < 4; ++j) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + j * 64 + h * 32));
            const __m256i lo = _mm256_and_si256(v, nibble);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
            for (int r = 0; r < R; ++r) {
              const int8_t* xb = x.q + (m + r) * K + b * kBlock;
              isum[r][h] = add_dot8<kVnni>(isum[r][h], lo, broadcast4(xb + 4 * j), hi, broadcast4(xb + 16 + 4 * j));
            }
          }
        } else if constexpr (kBits == 6) {
#pragma GCC unroll 2
          for (int j = 0; j < 4; j += 2) {
            const __m256i c0 = int6_codes(cb, g, j, h), c1 = int6_codes(cb, g, j + 1, h);
            for (int r = 0; r < R; ++r) {
              const int8_t* xb = x.q + (m + r) * K + b * kBlock + 16 * g;
              isum[r][h] = add_dot8<kVnni>(isum[r][h], c0, broadcast4(xb + 4 * j), c1, broadcast4(xb + 4 * j + 4));
            }
          }
          for (int r = 0; r < R; ++r)  // the codes carry +32: take back 32 * sum(x)
            isum[r][h] = _mm256_sub_epi32(isum[r][h], _mm256_set1_epi32(32 * x.sum16[(m + r) * 2 * blocks + 2 * b + g]));
        } else {
          constexpr int kChunks = 8 / kHalves;
#pragma GCC unroll 8
          for (int j = g * kChunks; j < (g + 1) * kChunks; ++j) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + j * 64 + h * 32));
            const __m256i q = _mm256_xor_si256(v, flip);  // the signed code
            const __m256i a = _mm256_abs_epi8(q);
            for (int r = 0; r < R; ++r) {
              const __m256i xs = _mm256_sign_epi8(broadcast4(x.q + (m + r) * K + b * kBlock + 4 * j), q);
              isum[r][h] = add_dot4<kVnni>(isum[r][h], a, xs);
            }
          }
        }
      }
      for (int h = 0; h < 2; ++h) {
        const uint16_t* s = scales + (b * kHalves + g) * kTile + h * 8;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
        for (int r = 0; r < R; ++r) {
          const float xd = x.d[(m + r) * blocks + b];
          acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][h]), _mm256_mul_ps(d, _mm256_set1_ps(xd)), acc[r][h]);
        }
      }
    }
    if constexpr (kMins) {
      for (int h = 0; h < 2; ++h) {
        const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + b * kTile + h * 8)));
        for (int r = 0; r < R; ++r) {
          const float xs = x.d[(m + r) * blocks + b] * static_cast<float>(x.sum[(m + r) * blocks + b]);
          acc[r][h] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xs), acc[r][h]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    float* out = y + (m + r) * ldy + t * kTile;
    if (live == kTile) {
      _mm256_storeu_ps(out, acc[r][0]);
      _mm256_storeu_ps(out + 8, acc[r][1]);
    } else {
      alignas(32) float tmp[kTile];
      _mm256_store_ps(tmp, acc[r][0]);
      _mm256_store_ps(tmp + 8, acc[r][1]);
      std::memcpy(out, tmp, live * sizeof(float));
    }
  }
}

// int4 at 2 or more rows: R rows against one tile, each half of the tile's 16 outputs in turn (the
// sums of 8 outputs for R rows fit in registers where both halves' would spill). A block's 32
// products per output sum in 16 bits: each lane of vpmaddubsw adds two products of at most
// 15 * 127, and a block puts 8 such pairs into a lane (16 * 15 * 127 = 30480 < 32768); one
// vpmaddwd by ones per block widens them to 32 bits, exact. One row (decode) keeps rows_tile,
// which reads each of the tile's cache lines once. 8-15% faster than rows_tile's two rows at 8
// to 512 rows in a best-of-5 loop on a Zen 3; end to end within that machine's noise
// (docs/performance.md, I14).
template <bool kVnni, int R>
inline void rows_tile_int4(const Activations& x, int64_t m, const Weights& w, int64_t t, Span span, float* y,
                           int64_t ldy) {
  const int64_t blocks = w.blocks(), K = w.K;
  const uint8_t* codes = w.codes + t * w.tile_bytes();
  const uint16_t* scales = w.scales + t * blocks * kTile;
  const uint16_t* mins = w.mins + t * blocks * kTile;
  const int64_t live = std::min<int64_t>(kTile, w.N - t * kTile);
  for (int h = 0; h < 2 && 8 * h < live; ++h) {
    const int64_t live_h = std::min<int64_t>(8, live - 8 * h);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) {
      const float* out = y + (m + r) * ldy + t * kTile + 8 * h;
      if (span.first) {
        acc[r] = _mm256_setzero_ps();
      } else if (live_h == 8) {
        acc[r] = _mm256_loadu_ps(out);
      } else {
        alignas(32) float tmp[8] = {};
        std::memcpy(tmp, out, live_h * sizeof(float));
        acc[r] = _mm256_load_ps(tmp);
      }
    }
    for (int64_t b = span.b0; b < span.b1; ++b) {
      const uint8_t* cb = codes + b * 256 + h * 32;
      const int8_t* xb = x.q + m * K + b * kBlock;
      __m256i isum[R];  // 16-bit sums of pairs (32-bit sums of fours with VNNI)
      for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
#pragma GCC unroll 2
      for (int j = 0; j < 4; ++j) {
        const __m256i nibble = _mm256_set1_epi8(0x0F);
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + j * 64));
        const __m256i lo = _mm256_and_si256(v, nibble);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        for (int r = 0; r < R; ++r) {
          const __m256i x0 = broadcast4(xb + r * K + 4 * j), x1 = broadcast4(xb + r * K + 16 + 4 * j);
          if constexpr (kVnni) {
            isum[r] = add_dot8<true>(isum[r], lo, x0, hi, x1);
          } else {
            isum[r] = _mm256_add_epi16(isum[r], _mm256_maddubs_epi16(lo, x0));
            isum[r] = _mm256_add_epi16(isum[r], _mm256_maddubs_epi16(hi, x1));
          }
        }
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + b * kTile + 8 * h)));
      const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + b * kTile + 8 * h)));
      for (int r = 0; r < R; ++r) {
        const float xd = x.d[(m + r) * blocks + b];
        const __m256i s32 = kVnni ? isum[r] : _mm256_madd_epi16(isum[r], _mm256_set1_epi16(1));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), _mm256_mul_ps(d, _mm256_set1_ps(xd)), acc[r]);
        acc[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(x.dsum[(m + r) * blocks + b]), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      float* out = y + (m + r) * ldy + t * kTile + 8 * h;
      if (live_h == 8) {
        _mm256_storeu_ps(out, acc[r]);
      } else {
        alignas(32) float tmp[8];
        _mm256_store_ps(tmp, acc[r]);
        std::memcpy(out, tmp, live_h * sizeof(float));
      }
    }
  }
}

template <bool kVnni, int kBits, int kHalves, bool kMins>
struct RowsTile {
  const Activations& x;
  const Weights& w;
  float* y;
  int64_t ldy;
  bool int4_rows = false;  // int4 at 2 rows or more through rows_tile_int4
  void panel(int64_t, int64_t, Span) const {}
  template <int R, int NT>
  void operator()(int64_t m, int64_t t, Span span) const {
    static_assert(NT == 1, "one tile at a time (16 registers)");
    if constexpr (kBits == 4 && R > 1) {
      if (int4_rows) return rows_tile_int4<kVnni, R>(x, m, w, t, span, y, ldy);
    }
    rows_tile<kVnni, R, kBits, kHalves, kMins>(x, m, w, t, span, y, ldy);
  }
};

// rows_tile_int4 up to this many rows (decode batches and shorter prompt chunks): at 2048 rows it
// measured 9-15% slower than rows_tile's two rows (docs/performance.md, I14).
constexpr int64_t kInt4RowsUpTo = 512;

template <bool kVnni, int kBits, int kHalves, bool kMins>
void tiles(const Activations& x, int64_t M, const Weights& w, int64_t t0, int64_t t1, float* y, int64_t ldy) {
  using Rows = RowsTile<kVnni, kBits, kHalves, kMins>;
  if constexpr (kBits == 4) {
    if (M <= kInt4RowsUpTo)  // up to kInt4Rows rows a call, the last few in one call
      return walk_tiles<kInt4Rows, 1, true>(M, w, t0, t1, Rows{x, w, y, ldy, true});
  }
  walk_tiles<2, 1>(M, w, t0, t1, Rows{x, w, y, ldy});
}

template <bool kVnni>
void tiles_of_kind(const Activations& x, int64_t M, const Weights& w, int64_t t0, int64_t t1, float* y,
                   int64_t ldy) {
  if (w.bits == 4)
    tiles<kVnni, 4, 1, true>(x, M, w, t0, t1, y, ldy);
  else if (w.bits == 6)
    w.mins ? tiles<kVnni, 6, 2, true>(x, M, w, t0, t1, y, ldy) : tiles<kVnni, 6, 2, false>(x, M, w, t0, t1, y, ldy);
  else if (w.halves == 2)
    w.mins ? tiles<kVnni, 8, 2, true>(x, M, w, t0, t1, y, ldy) : tiles<kVnni, 8, 2, false>(x, M, w, t0, t1, y, ldy);
  else
    tiles<kVnni, 8, 1, false>(x, M, w, t0, t1, y, ldy);
}

}  // namespace

void tiles_avx2(const Activations& x, int64_t M, const Weights& w, int64_t t0, int64_t t1, float* y,
                int64_t ldy) {
  tiles_of_kind<false>(x, M, w, t0, t1, y, ldy);
}

#ifdef PAGEDLLM_INT8_ACT_AVX_VNNI
void tiles_avx_vnni(const Activations& x, int64_t M, const Weights& w, int64_t t0, int64_t t1, float* y,
                    int64_t ldy) {
  tiles_of_kind<true>(x, M, w, t0, t1, y, ldy);
}
#endif

}  // namespace int8_act
}  // namespace pagedllm
#endif
