// Integer products of quantized weights with 8-bit activations (int8_act_linear.cpp), shared by
// the instruction-set files (int8_act_avx512_vnni.cpp, int8_act_avx2.cpp: AVX2 and AVX-VNNI)
// and the reference.
//
// Activations: each row of x, per block of 32 columns, as Q8_0 does: d = max|x| / 127,
// q = round-to-nearest-even(x * (1 / d)) in -127..127, and the block's sum of q. A row's codes
// depend on that row alone, so a row quantizes the same in a batch of any size.
//
// Weights, repacked once at load (layers/quantization/int8_act.py) into tiles of kTile = 16
// output rows, the tile's rows interleaved 4 bytes at a time, so that one 32-bit lane of a
// 512-bit register holds one output row's four codes and a dot-product instruction (vpdpbusd,
// or vpmaddubsw + vpmaddwd) sums four products per output row:
//   int4 (w = q * scale + min, q in 0..15): codes [tiles][blocks][4 chunks][16 rows][4 bytes];
//        chunk j's byte i of a row holds code 4j + i in its low nibble and 16 + 4j + i in its
//        high nibble (a ggml Q4 block's 16 bytes cut into four).
//   int8 (w = q * scale, q in -127..127): codes [tiles][blocks][8 chunks][16 rows][4 bytes],
//        each byte q + 128 (unsigned, for vpdpbusd; the 128 * sum(x) it adds is taken back).
//   int8x (w = q * scale_h + min: int8's codes with a scale per half block of 16 columns and a
//        min per block; layers whose parts mix int8 codes with int6's).
//   int6 (w = q * scale_h + min, q in -32..31: int8x's numbers in 6 bits; GGUF's Q6_K, Q5_K and
//        Q5_1, and layers that mix them with int4's): codes [tiles][blocks][6 chunks][16 rows]
//        [4 bytes], each code stored as u = q + 32 in 0..63: chunks 0-3 hold the low 4 bits of
//        u in int4's layout; chunk 4 + p holds the high 2 bits of the codes of chunks 2p and 2p
//        + 1, byte i of a row packing, from bit 0, the pairs of codes 8p + i, 16 + 8p + i,
//        8p + 4 + i and 16 + 8p + 4 + i (the low and high nibbles of chunk 2p, then of 2p + 1).
//   scales: float16 [tiles][blocks][halves][16 rows] (halves: 2 for int8x and int6, else 1);
//   mins (int4; int8x and int6 unless every min is 0): float16 [tiles][blocks][16 rows].
//
// Every output takes one fixed sequence of float operations whatever the variant, the row count
// or the tile's place: per block in order, for each half h (one for int4 and int8) its exact
// int32 sum isum_h, then
//   acc = fma(float(isum_h), scale_h * d, acc)               then, with mins,
//   acc = fma(min, d * float(sum_q), acc)
// so every variant's result equals the reference's bit for bit, and a row's result does not
// depend on the other rows of the step.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace pagedllm {
namespace int8_act {

constexpr int64_t kBlock = 32;  // activation and weight block: one scale per 32 columns
constexpr int64_t kTile = 16;   // output rows interleaved in the weight layout

// Quantized activations: M rows of K columns (K a multiple of kBlock).
struct Activations {
  const int8_t* q;     // [M][K]
  const float* d;      // [M][K / 32]
  const int32_t* sum;  // [M][K / 32]
  const int32_t* sum16;  // [M][K / 16]: the sums of each half block (int8x's codes)
  int64_t K;
  const float* dsum = nullptr;  // [M][K / 32]: d * float(sum), what a block's min is multiplied by
};

// Repacked weights (see above).
struct Weights {
  const uint8_t* codes;
  const uint16_t* scales;  // float16 bits
  const uint16_t* mins;    // float16 bits, or null (int8; int8x and int6 whose mins are all 0)
  int bits;                // 4, 6 or 8
  int halves;              // scales per block: 2 for int8x and int6, else 1
  int64_t K, N;            // N: real output rows (the last tile may be partly padding)
  int64_t blocks() const { return K / kBlock; }
  int64_t tile_bytes() const { return blocks() * kBlock * kTile * bits / 8; }
};

// y[m * ldy + n] for m < M and the tiles [t0, t1) (only n < N written), float32.
using TileKernel = void (*)(const Activations& x, int64_t M, const Weights& w, int64_t t0, int64_t t1,
                            float* y, int64_t ldy);

void tiles_reference(const Activations& x, int64_t M, const Weights& w, int64_t t0, int64_t t1, float* y,
                     int64_t ldy);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PAGEDLLM_INT8_ACT_VNNI512 1
void tiles_avx512_vnni(const Activations& x, int64_t M, const Weights& w, int64_t t0, int64_t t1, float* y,
                       int64_t ldy);
#endif
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define PAGEDLLM_INT8_ACT_AVX2 1
void tiles_avx2(const Activations& x, int64_t M, const Weights& w, int64_t t0, int64_t t1, float* y,
                int64_t ldy);
#if defined(__AVXVNNI__)
#define PAGEDLLM_INT8_ACT_AVX_VNNI 1
void tiles_avx_vnni(const Activations& x, int64_t M, const Weights& w, int64_t t0, int64_t t1, float* y,
                    int64_t ldy);
#endif
#endif

// Which blocks of columns a call of a variant's tile kernel covers, and whether it starts the
// outputs' sums (acc = 0) or carries them on from y: splitting the columns keeps each output's
// sequence of operations (a float stored and loaded back is the same float).
struct Span {
  int64_t b0, b1;
  bool first;
};

// The order a variant walks its tiles [t0, t1) for M rows, calling
// rows_tiles<R, NT>(m, t, span) for R = kMaxRows rows (or 1, for the last few) against NT =
// kMaxTiles consecutive tiles (or 1, for the last). Few rows (decode) stream each tile's codes
// once, whole. Many rows (prefill) block the product like a GEMM, so that what is reread comes
// from cache: panels of kPanelTiles tiles, their columns kSpanBlocks blocks at a time (the
// panel's codes for those columns stay in L2), against kRowChunk rows of activations (their
// codes for those columns stay in L1). Blocked, rows_tiles.panel(p0, p1, span) is called before
// each panel's span of columns (a variant may unpack those codes once there for all the rows).
constexpr int64_t kSpanBlocks = 8, kPanelTiles = 32, kBlockedFromRows = 32;

// rows_tiles<R, NT>(m, t, span) for the R = rest rows left (0 < rest <= kR).
template <int kR, int NT, typename RowsTiles>
inline void rest_rows(int64_t rest, int64_t m, int64_t t, Span s, RowsTiles& rows_tiles) {
  if constexpr (kR > 0) {
    if (rest == kR) return rows_tiles.template operator()<kR, NT>(m, t, s);
    rest_rows<kR - 1, NT>(rest, m, t, s, rows_tiles);
  }
}

// kGroupRest: the rows after the last kMaxRows go in one call of their count (a variant that
// unpacks each code vector once for all its rows), rather than one call per row.
template <int kMaxRows, int kMaxTiles, bool kGroupRest = false, typename RowsTiles>
inline void walk_tiles(int64_t M, const Weights& w, int64_t t0, int64_t t1, RowsTiles&& rows_tiles) {
  constexpr int64_t kRowChunk = 64;
  const int64_t blocks = w.blocks();
  const bool blocked = M >= kBlockedFromRows;
  const int64_t span = blocked ? kSpanBlocks : blocks, panel = blocked ? kPanelTiles : t1 - t0;
  for (int64_t p0 = t0; p0 < t1; p0 += panel) {
    const int64_t p1 = std::min(t1, p0 + panel);
    for (int64_t b0 = 0; b0 < blocks; b0 += span) {
      const Span s{b0, std::min(blocks, b0 + span), b0 == 0};
      if (blocked) rows_tiles.panel(p0, p1, s);
      for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
        const int64_t end = std::min(M, m0 + kRowChunk);
        int64_t t = p0;
        for (; t + kMaxTiles <= p1; t += kMaxTiles) {
          int64_t m = m0;
          for (; m + kMaxRows <= end; m += kMaxRows)
            rows_tiles.template operator()<kMaxRows, kMaxTiles>(m, t, s);
          if constexpr (kGroupRest) {
            if (m < end) rest_rows<kMaxRows - 1, kMaxTiles>(end - m, m, t, s, rows_tiles);
          } else {
            for (; m < end; ++m) rows_tiles.template operator()<1, kMaxTiles>(m, t, s);
          }
        }
        for (; t < p1; ++t) {
          int64_t m = m0;
          for (; m + kMaxRows <= end; m += kMaxRows) rows_tiles.template operator()<kMaxRows, 1>(m, t, s);
          if constexpr (kGroupRest) {
            if (m < end) rest_rows<kMaxRows - 1, 1>(end - m, m, t, s, rows_tiles);
          } else {
            for (; m < end; ++m) rows_tiles.template operator()<1, 1>(m, t, s);
          }
        }
      }
    }
  }
}

// float16 bits -> float (exact), for the reference.
inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const int exp = (h >> 10) & 0x1F;
  const uint32_t mant = h & 0x3FF;
  float f;
  if (exp == 0) {
    f = std::ldexp(static_cast<float>(mant), -24);  // zero or subnormal
  } else if (exp == 31) {
    f = mant ? NAN : INFINITY;
  } else {
    f = std::ldexp(static_cast<float>(mant | 0x400), exp - 25);
  }
  return sign ? -f : f;
}

}  // namespace int8_act
}  // namespace pagedllm
