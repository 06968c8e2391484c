// One chunk of keys against a tile of query slots, for paged_attention.cpp: the scores as small
// matrix products with a fixed order of sums, the online softmax update, and the weighted V rows
// added as outer products. The sizes here fix every row's order of operations, so a row's
// result does not depend on the batch, the tile or the block size (docs/determinism.md).
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace pagedllm {
namespace attention {

using Vec = at::vec::Vectorized<float>;
// Keys are taken kKeyChunk positions at a time (one online-softmax update each), whatever the
// block size: the order of a row's sums depends on its positions alone.
constexpr int64_t kKeyChunk = 32;
// A chunk's rows are gathered kSegment at a time: a float cache's are read in place where the
// block size is a multiple of kSegment (a segment then never crosses a block).
constexpr int64_t kSegment = 16;
constexpr int64_t kSegments = kKeyChunk / kSegment;
constexpr int64_t kMaxHeadVecs = 16;  // head_dim up to 16 vectors (256 with AVX-512)

// Vec::size() elements of a float dtype, as floats.
template <typename T>
inline Vec load_vec(const T* src) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(src);
  } else {
    Vec out;
    at::vec::load_to_float<T>(src, out);
    return out;
  }
}

// A vector loaded once into a register: without this the compiler folds the load into every
// FMA that uses it, and a row shared by four slots is read four times (the loads, not the FMAs,
// then bound the loop).
inline Vec in_register(Vec x) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 r = x;
  asm("" : "+v"(r));
  return Vec(r);
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 r = x;
  asm("" : "+x"(r));
  return Vec(r);
#else
  return x;
#endif
}

inline float reduce_sum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v);
}

// Slots that share a pass over the chunk's keys or values: as many as keep the sums in
// registers (32 vector registers with AVX-512, 16 with AVX2).
constexpr int kScoreSlots = Vec::size() == 16 ? 4 : 2;

// The chunk's scores for kScoreSlots slots, one vector lane per key: slot s's score of key j is
// q_s . k_j summed over four quarters of head_dim, each quarter's products added in order of d
// and the quarters as ((0 + 1) + (2 + 3)). kt holds the chunk's keys transposed
// ([head_dim][kKeyChunk]) and qt the slots' queries interleaved ([head_dim][kScoreSlots]), so
// no horizontal sum is needed and every kt row loaded serves all the slots. The order depends
// on nothing but head_dim: not the slots beside s, the vector width or the batch.
inline void score_slots(const float* qt, int64_t head_dim, const float* kt, float* scores) {
  constexpr int kLanes = kKeyChunk / Vec::size();  // vectors per kt row
  constexpr int S = kScoreSlots;
  const int64_t quarter = head_dim / 4;
  Vec half[S][kLanes], sum[S][kLanes];
  for (int c = 0; c < 4; ++c) {
    Vec acc[S][kLanes];
    for (int s = 0; s < S; ++s)
      for (int t = 0; t < kLanes; ++t) acc[s][t] = Vec(0.f);
    for (int64_t d = c * quarter; d < (c + 1) * quarter; ++d) {
      Vec k[kLanes];
      for (int t = 0; t < kLanes; ++t)
        k[t] = in_register(Vec::loadu(kt + d * kKeyChunk + t * Vec::size()));
      for (int s = 0; s < S; ++s) {
        const Vec qs(qt[d * S + s]);
        for (int t = 0; t < kLanes; ++t) acc[s][t] = at::vec::fmadd(qs, k[t], acc[s][t]);
      }
    }
    for (int s = 0; s < S; ++s) {
      for (int t = 0; t < kLanes; ++t) {
        if (c == 0) half[s][t] = acc[s][t];
        else if (c == 1) half[s][t] = half[s][t] + acc[s][t];
        else if (c == 2) sum[s][t] = acc[s][t];
        else sum[s][t] = half[s][t] + (sum[s][t] + acc[s][t]);
      }
    }
  }
  for (int s = 0; s < S; ++s)
    for (int t = 0; t < kLanes; ++t) sum[s][t].store(scores + s * kKeyChunk + t * Vec::size());
}

// kSlots slots (each head_dim floats of acc): acc = acc * corr + sum over keys j in [lo, hi)
// of p_j V_j, in order of j; key j's V row at v[j / kSegment] + (j % kSegment) * ld. A slot's
// p_j is 0 for keys outside its own range, and fma(0, v, a) is a, so the slots sharing a pass
// do not change each other's sums.
// kVecs > 0 fixes head_dim / Vec::size() at compile time; 0 takes it from num_vecs.
template <int kSlots, int kVecs>
inline void weigh_values(const float* p, const float* corr, const float* const* v, int64_t ld,
                         int64_t lo, int64_t hi, int64_t num_vecs, int64_t head_dim, float* acc) {
  constexpr int kRegs = kVecs > 0 ? kVecs : kMaxHeadVecs;
  const int64_t n = kVecs > 0 ? kVecs : num_vecs;
  Vec a[kSlots][kRegs];
  for (int s = 0; s < kSlots; ++s)
    for (int64_t i = 0; i < n; ++i)
      a[s][i] = Vec::loadu(acc + s * head_dim + i * Vec::size()) * Vec(corr[s]);
  for (int64_t g = lo / kSegment; g * kSegment < hi; ++g) {
    const float* vg = v[g] - g * kSegment * ld;
    for (int64_t j = std::max(lo, g * kSegment); j < std::min(hi, (g + 1) * kSegment); ++j) {
      Vec ps[kSlots];
      for (int s = 0; s < kSlots; ++s) ps[s] = Vec(p[s * kKeyChunk + j]);
      const float* vj = vg + j * ld;
      for (int64_t i = 0; i < n; ++i) {
        const Vec x = in_register(Vec::loadu(vj + i * Vec::size()));
        for (int s = 0; s < kSlots; ++s) a[s][i] = at::vec::fmadd(ps[s], x, a[s][i]);
      }
    }
  }
  for (int s = 0; s < kSlots; ++s)
    for (int64_t i = 0; i < n; ++i) a[s][i].store(acc + s * head_dim + i * Vec::size());
}

template <int kVecs>
constexpr int value_slots() {
  constexpr int regs = Vec::size() == 16 ? 16 : 8;
  return kVecs <= 0 ? 1 : std::max(1, std::min(4, regs / kVecs));
}

// The tile's slots [0, slots) against one chunk: kt the chunk's K transposed, V rows at
// v + j * ld; slot s sees keys [lo[s], hi[s]) (none when hi <= lo). Updates each slot's
// online softmax (run_max, run_sum) and acc; scores / p: slots x kKeyChunk scratch.
template <int kVecs>
void attend_chunk(const float* qt, int64_t slots, const float* kt, const float* const* v,
                  int64_t ld,
                  const int64_t* lo, const int64_t* hi, int64_t num_vecs, int64_t head_dim,
                  float cap, float* p, float* corr, float* run_max, float* run_sum, float* acc) {
  int64_t s = 0;
  for (; s < slots; s += kScoreSlots)  // qt: a whole group for every kScoreSlots slots
    score_slots(qt + s * head_dim, head_dim, kt, p + s * kKeyChunk);

  const float neg_inf = -std::numeric_limits<float>::infinity();
  const Vec lane = Vec::arange(0.f, 1.f);
  int64_t any_lo = kKeyChunk, any_hi = 0;
  for (s = 0; s < slots; ++s) {
    float* ps = p + s * kKeyChunk;
    if (hi[s] <= lo[s]) {  // no key of this chunk: the state is left as it is
      std::fill(ps, ps + kKeyChunk, 0.f);
      corr[s] = 1.f;
      continue;
    }
    any_lo = std::min(any_lo, lo[s]);
    any_hi = std::max(any_hi, hi[s]);
    if (cap > 0.f) {
      for (int64_t j = lo[s]; j < hi[s]; ++j) ps[j] = cap * std::tanh(ps[j] / cap);
    }
    const Vec from(static_cast<float>(lo[s])), to(static_cast<float>(hi[s]));
    Vec x[kKeyChunk / Vec::size()], in[kKeyChunk / Vec::size()];
    Vec vmax(neg_inf);
    for (int64_t t = 0; t < kKeyChunk / Vec::size(); ++t) {
      const Vec idx = lane + Vec(static_cast<float>(t * Vec::size()));
      in[t] = (idx >= from) & (idx < to);
      x[t] = Vec::blendv(Vec(neg_inf), Vec::loadu(ps + t * Vec::size()), in[t]);
      vmax = at::vec::maximum(vmax, x[t]);
    }
    const float block_max =
        at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vmax);
    const float new_max = std::max(run_max[s], block_max);
    corr[s] = run_sum[s] > 0.f ? std::exp(run_max[s] - new_max) : 0.f;
    run_max[s] = new_max;
    Vec total(0.f);
    for (int64_t t = 0; t < kKeyChunk / Vec::size(); ++t) {
      const Vec w = Vec::blendv(Vec(0.f), (x[t] - Vec(new_max)).exp_u20(), in[t]);
      w.store(ps + t * Vec::size());
      total = total + w;
    }
    run_sum[s] = run_sum[s] * corr[s] + reduce_sum(total);
  }
  if (any_hi <= any_lo) return;

  constexpr int kV = value_slots<kVecs>();
  auto weigh = [&](auto count, int64_t first) {
    weigh_values<decltype(count)::value, kVecs>(p + first * kKeyChunk, corr + first, v, ld,
                                                any_lo, any_hi, num_vecs, head_dim,
                                                acc + first * head_dim);
  };
  for (s = 0; s + kV <= slots; s += kV) weigh(std::integral_constant<int, kV>{}, s);
  // The last slots (fewer than kV), in one pass too.
  switch (slots - s) {
    case 3: if constexpr (kV > 3) weigh(std::integral_constant<int, 3>{}, s); break;
    case 2: if constexpr (kV > 2) weigh(std::integral_constant<int, 2>{}, s); break;
    case 1: weigh(std::integral_constant<int, 1>{}, s); break;
    default: break;
  }
}

using AttendFn = void (*)(const float*, int64_t, const float*, const float* const*, int64_t,
                          const int64_t*, const int64_t*, int64_t, int64_t, float, float*,
                          float*, float*, float*, float*);

inline AttendFn attend_for(int64_t num_vecs) {
  switch (num_vecs) {
    case 2: return attend_chunk<2>;
    case 4: return attend_chunk<4>;
    case 8: return attend_chunk<8>;
    case 16: return attend_chunk<16>;
    default: return attend_chunk<0>;
  }
}

// A segment's K rows (key j at k + j * ld) transposed into kt's columns (kt: [head_dim][kKeyChunk]).
inline void transpose_keys(const float* k, int64_t ld, int64_t head_dim, float* kt) {
  constexpr int W = Vec::size();
  for (int64_t j = 0; j < kSegment; j += W)
    for (int64_t d = 0; d < head_dim; d += W)
      at::vec::transpose_mxn<float, W, W>(k + j * ld + d, ld, kt + d * kKeyChunk + j, kKeyChunk);
}

}  // namespace attention
}  // namespace pagedllm
