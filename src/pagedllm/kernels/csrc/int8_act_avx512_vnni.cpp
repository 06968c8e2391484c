// int8_act.h's tiles with AVX512-VNNI: vpdpbusd sums four unsigned-code x signed-activation
// products into each 32-bit lane, one lane per output row of a tile. Zen 4 and Intel
// Ice Lake / Sapphire Rapids and later have it.

#include "int8_act.h"

#ifdef PAGEDLLM_INT8_ACT_VNNI512
#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace pagedllm {
namespace int8_act {
namespace {

inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// R activation rows from row m against NT tiles from t: y[(m + r) * ldy + 16 (t + n) + lane].
// Each activation broadcast feeds NT tiles, each unpacked code vector R rows. kHalves: scales
// per block (2: int8x); kMins: int4 and int8x.
template <int R, int NT, int kBits, int kHalves, bool kMins>
inline void rows_tiles(const Activations& x, int64_t m, const Weights& w, int64_t t, Span span, float* y,
                       int64_t ldy) {
  const int64_t blocks = w.blocks(), K = w.K, tile_bytes = w.tile_bytes();
  const uint8_t* codes = w.codes + t * tile_bytes;
  constexpr int64_t kBlockBytes = kBlock * kTile * kBits / 8;
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
    const uint8_t* cb = codes + b * kBlockBytes;
    __m512i isum[NT][R];
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
        for (int r = 0; r < R; ++r) {  // the codes carry +128: take back 128 * sum(x)
          const int32_t sum = kHalves == 1 ? x.sum[(m + r) * blocks + b] : x.sum16[(m + r) * 2 * blocks + 2 * b + h];
          const __m512i bias = _mm512_set1_epi32(128 * sum);
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
  template <int R, int NT>
  void operator()(int64_t m, int64_t t, Span span) const {
    rows_tiles<R, NT, kBits, kHalves, kMins>(x, m, w, t, span, y, ldy);
  }
};

template <int kBits, int kHalves, bool kMins>
void tiles(const Activations& x, int64_t M, const Weights& w, int64_t t0, int64_t t1, float* y, int64_t ldy) {
  walk_tiles<4, 2>(M, w, t0, t1, RowsTile<kBits, kHalves, kMins>{x, w, y, ldy});
}

}  // namespace

void tiles_avx512_vnni(const Activations& x, int64_t M, const Weights& w, int64_t t0, int64_t t1, float* y,
                       int64_t ldy) {
  if (w.bits == 4)
    tiles<4, 1, true>(x, M, w, t0, t1, y, ldy);
  else if (w.halves == 2)
    tiles<8, 2, true>(x, M, w, t0, t1, y, ldy);
  else
    tiles<8, 1, false>(x, M, w, t0, t1, y, ldy);
}

}  // namespace int8_act
}  // namespace pagedllm
#endif
