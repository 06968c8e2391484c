// int8_act.h's tiles with AVX512-VNNI: vpdpbusd sums four unsigned-code x signed-activation
// products into each 32-bit lane, one lane per output row of a tile. Zen 4 and 5 and Intel
// Ice Lake / Sapphire Rapids and later have it.

#include "int8_act.h"

#ifdef PAGEDLLM_INT8_ACT_VNNI512
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace pagedllm {
namespace int8_act {
namespace {

inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// int6's codes u = q + 32 in chunk j's layout: lo, the block's codes 4j + i (first half), hi,
// its codes 16 + 4j + i (second half). Each is a nibble and its pair of high bits, moved from
// bits 4 (j % 2) (lo) or 4 (j % 2) + 2 (hi) of the byte to bits 4-5 (what the 16-bit shifts
// bring in from the neighbouring byte falls outside them).
inline void int6_codes(const uint8_t* cb, int j, __m512i& lo, __m512i& hi) {
  const __m512i nibble = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(0x30);
  const __m512i v = _mm512_loadu_si512(cb + j * 64), pairs = _mm512_loadu_si512(cb + 256 + j / 2 * 64);
  const __m512i lo_pairs = j % 2 ? pairs : _mm512_slli_epi16(pairs, 4);
  const __m512i hi_pairs = j % 2 ? _mm512_srli_epi16(pairs, 2) : _mm512_slli_epi16(pairs, 2);
  lo = _mm512_ternarylogic_epi32(_mm512_and_si512(v, nibble), lo_pairs, high, 0xF8);  // a | (b & c)
  hi = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(v, 4), nibble), hi_pairs, high, 0xF8);
}

// Where the codes of tile t and block b lie: in the weights (t0 = b0 = 0), or in a panel's
// codes unpacked for a span of blocks (RowsTile<6, ...>::panel).
struct TileCodes {
  const uint8_t* base;
  int64_t tile_bytes, t0, b0;
};

// R activation rows from row m against NT tiles from t: y[(m + r) * ldy + 16 (t + n) + lane].
// Each activation broadcast feeds NT tiles, each unpacked code vector R rows. kHalves: scales
// per block (2: int8x, int6); kMins: int4, and int8x or int6 with a min that is not 0; kZero:
// what 8-bit codes carry (128; int6's unpacked to bytes, 32).
template <int R, int NT, int kBits, int kHalves, bool kMins, int kZero = 128>
inline void rows_tiles(const Activations& x, int64_t m, const Weights& w, TileCodes src, int64_t t, Span span,
                       float* y, int64_t ldy) {
  const int64_t blocks = w.blocks(), K = w.K, tile_bytes = src.tile_bytes;
  constexpr int64_t kBlockBytes = kBlock * kTile * kBits / 8;
  const uint8_t* codes = src.base + (t - src.t0) * tile_bytes;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __mmask16 mask[NT];
  __m512 acc[NT][R];
  for (int n = 0; n < NT; ++n) {
    const int64_t live = std::min<int64_t>(kTile, w.N - (t + n) * kTile);
    mask[n] = static_cast<__mmask16>((1u << live) - 1);
    for (int r = 0; r < R; ++r) {
      float* out = y + (m + r) * ldy + (t + n) * kTile;
      acc[n][r] = span.first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask[n], out);
    }
  }
  for (int64_t b = span.b0; b < span.b1; ++b) {
    const uint8_t* cb = codes + (b - src.b0) * kBlockBytes;
    __m512i isum[NT][R], isum_hi[NT][R];  // int6: the second half's, summed with the first's
    // One half block (kHalves == 2) or the whole block: its exact sums, then its scale applied.
    for (int h = 0; h < kHalves; ++h) {
      for (int n = 0; n < NT; ++n)
        for (int r = 0; r < R; ++r) isum[n][r] = _mm512_setzero_si512();
      if constexpr (kBits == 4) {
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          __m512i lo[NT], hi[NT];
          for (int n = 0; n < NT; ++n) {
            const __m512i v = _mm512_loadu_si512(cb + n * tile_bytes + j * 64);
            lo[n] = _mm512_and_si512(v, nibble);
            hi[n] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
          }
          for (int r = 0; r < R; ++r) {
            const int8_t* xb = x.q + (m + r) * K + b * kBlock;
            const __m512i xl = broadcast4(xb + 4 * j), xh = broadcast4(xb + 16 + 4 * j);
            for (int n = 0; n < NT; ++n) {
              isum[n][r] = _mm512_dpbusd_epi32(isum[n][r], lo[n], xl);
              isum[n][r] = _mm512_dpbusd_epi32(isum[n][r], hi[n], xh);
            }
          }
        }
      } else if constexpr (kBits == 6) {
        // Each chunk holds codes of both halves: both are summed on the first half's turn.
        if (h == 1) {
          for (int n = 0; n < NT; ++n)
            for (int r = 0; r < R; ++r) isum[n][r] = isum_hi[n][r];
        } else {
          for (int n = 0; n < NT; ++n)
            for (int r = 0; r < R; ++r) isum_hi[n][r] = _mm512_setzero_si512();
#pragma GCC unroll 4
          for (int j = 0; j < 4; ++j) {
            __m512i lo[NT], hi[NT];
            for (int n = 0; n < NT; ++n) int6_codes(cb + n * tile_bytes, j, lo[n], hi[n]);
            for (int r = 0; r < R; ++r) {
              const int8_t* xb = x.q + (m + r) * K + b * kBlock;
              const __m512i xl = broadcast4(xb + 4 * j), xh = broadcast4(xb + 16 + 4 * j);
              for (int n = 0; n < NT; ++n) {
                isum[n][r] = _mm512_dpbusd_epi32(isum[n][r], lo[n], xl);
                isum_hi[n][r] = _mm512_dpbusd_epi32(isum_hi[n][r], hi[n], xh);
              }
            }
          }
          for (int r = 0; r < R; ++r) {  // the codes carry +32: take back 32 * sum(x)
            const int32_t* sum16 = x.sum16 + (m + r) * 2 * blocks + 2 * b;
            const __m512i bias = _mm512_set1_epi32(32 * sum16[0]), bias_hi = _mm512_set1_epi32(32 * sum16[1]);
            for (int n = 0; n < NT; ++n) {
              isum[n][r] = _mm512_sub_epi32(isum[n][r], bias);
              isum_hi[n][r] = _mm512_sub_epi32(isum_hi[n][r], bias_hi);
            }
          }
        }
      } else {
        constexpr int kChunks = 8 / kHalves;
#pragma GCC unroll 8
        for (int j = h * kChunks; j < (h + 1) * kChunks; ++j) {
          __m512i v[NT];
          for (int n = 0; n < NT; ++n) v[n] = _mm512_loadu_si512(cb + n * tile_bytes + j * 64);
          for (int r = 0; r < R; ++r) {
            const __m512i xb = broadcast4(x.q + (m + r) * K + b * kBlock + 4 * j);
            for (int n = 0; n < NT; ++n) isum[n][r] = _mm512_dpbusd_epi32(isum[n][r], v[n], xb);
          }
        }
        for (int r = 0; r < R; ++r) {  // the codes carry +kZero: take back kZero * sum(x)
          const int32_t sum = kHalves == 1 ? x.sum[(m + r) * blocks + b] : x.sum16[(m + r) * 2 * blocks + 2 * b + h];
          const __m512i bias = _mm512_set1_epi32(kZero * sum);
          for (int n = 0; n < NT; ++n) isum[n][r] = _mm512_sub_epi32(isum[n][r], bias);
        }
      }
      for (int n = 0; n < NT; ++n) {
        const int64_t at = (((t + n) * blocks + b) * kHalves + h) * kTile;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.scales + at)));
        for (int r = 0; r < R; ++r) {
          const float xd = x.d[(m + r) * blocks + b];
          acc[n][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[n][r]), _mm512_mul_ps(d, _mm512_set1_ps(xd)), acc[n][r]);
        }
      }
    }
    if constexpr (kMins) {
      for (int n = 0; n < NT; ++n) {
        const int64_t at = ((t + n) * blocks + b) * kTile;
        const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.mins + at)));
        for (int r = 0; r < R; ++r) {
          const float xs = x.d[(m + r) * blocks + b] * static_cast<float>(x.sum[(m + r) * blocks + b]);
          acc[n][r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xs), acc[n][r]);
        }
      }
    }
  }
  for (int n = 0; n < NT; ++n)
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + (m + r) * ldy + (t + n) * kTile, mask[n], acc[n][r]);
}

template <int kBits, int kHalves, bool kMins>
struct RowsTile {
  const Activations& x;
  const Weights& w;
  float* y;
  int64_t ldy;
  void panel(int64_t, int64_t, Span) const {}
  template <int R, int NT>
  void operator()(int64_t m, int64_t t, Span span) const {
    rows_tiles<R, NT, kBits, kHalves, kMins>(x, m, w, TileCodes{w.codes, w.tile_bytes(), 0, 0}, t, span, y, ldy);
  }
};

// int6: with few rows each tile's codes are unpacked as they stream; with many (blocked), each
// panel's span of blocks is unpacked once into bytes (int8x's layout, u = q + 32 in each) that
// every row then reads from cache, as int8x's codes: one more byte store per code, instead of
// the unpacking's loads and shifts per code for every four rows.
template <bool kMins>
struct RowsTile<6, 2, kMins> {
  const Activations& x;
  const Weights& w;
  float* y;
  int64_t ldy;
  TileCodes unpacked{nullptr, 0, 0, 0};
  void panel(int64_t p0, int64_t p1, Span span) {
    thread_local std::vector<uint8_t> buffer;
    buffer.resize(kPanelTiles * kSpanBlocks * 512);
    const int64_t blocks = span.b1 - span.b0;
    unpacked = TileCodes{buffer.data(), blocks * 512, p0, span.b0};
    for (int64_t t = p0; t < p1; ++t) {
      for (int64_t b = span.b0; b < span.b1; ++b) {
        const uint8_t* cb = w.codes + t * w.tile_bytes() + b * 384;
        uint8_t* out = buffer.data() + (t - p0) * blocks * 512 + (b - span.b0) * 512;
        for (int j = 0; j < 4; ++j) {  // chunk 4h + j of int8x's layout: codes 16h + 4j + i
          __m512i lo, hi;
          int6_codes(cb, j, lo, hi);
          _mm512_storeu_si512(out + j * 64, lo);
          _mm512_storeu_si512(out + (4 + j) * 64, hi);
        }
      }
    }
  }
  template <int R, int NT>
  void operator()(int64_t m, int64_t t, Span span) const {
    if (unpacked.base)
      rows_tiles<R, NT, 8, 2, kMins, 32>(x, m, w, unpacked, t, span, y, ldy);
    else
      rows_tiles<R, NT, 6, 2, kMins>(x, m, w, TileCodes{w.codes, w.tile_bytes(), 0, 0}, t, span, y, ldy);
  }
};

template <int kBits, int kHalves, bool kMins>
void tiles(const Activations& x, int64_t M, const Weights& w, int64_t t0, int64_t t1, float* y, int64_t ldy) {
  // One row (decode) one tile at a time: one stream of codes; two tiles' interleaved streams
  // read 5-20% slower on a Zen 5 (docs/performance.md, I15).
  if (M == 1) return walk_tiles<1, 1>(M, w, t0, t1, RowsTile<kBits, kHalves, kMins>{x, w, y, ldy});
  walk_tiles<4, 2>(M, w, t0, t1, RowsTile<kBits, kHalves, kMins>{x, w, y, ldy});
}

}  // namespace

void tiles_avx512_vnni(const Activations& x, int64_t M, const Weights& w, int64_t t0, int64_t t1, float* y,
                       int64_t ldy) {
  if (w.bits == 4)
    tiles<4, 1, true>(x, M, w, t0, t1, y, ldy);
  else if (w.bits == 6)
    w.mins ? tiles<6, 2, true>(x, M, w, t0, t1, y, ldy) : tiles<6, 2, false>(x, M, w, t0, t1, y, ldy);
  else if (w.halves == 2)
    w.mins ? tiles<8, 2, true>(x, M, w, t0, t1, y, ldy) : tiles<8, 2, false>(x, M, w, t0, t1, y, ldy);
  else
    tiles<8, 1, false>(x, M, w, t0, t1, y, ldy);
}

}  // namespace int8_act
}  // namespace pagedllm
#endif
