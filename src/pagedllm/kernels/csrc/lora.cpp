// Batched LoRA for a step's rows (layers/lora.py): y[t] += (x[t] @ a[s].T) @ bt[s] for each row t
// whose adapter slot s = row_slots[t] is >= 0, using the slot's first columns[s] ranks. torch's
// two small GEMMs and an add per slot cost ~75 us a projection at a decode step's rows (oneDNN's
// fixed cost per call), most of a step's LoRA time; here a projection takes a few microseconds.
//
// Each row is computed alone, in one order: the shrink as linear_tiles.h's dot products (v in
// float32, never rounded), the expand as multiply-adds over r = 0, 1, ... per output, added to y
// and rounded once. So a row's result does not depend on the batch (--deterministic holds), and
// the fused decoder (decoder.cpp) gives what the modules give.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <utility>
#include <vector>

#include "linear_tiles.h"
#include "ops.h"

namespace pagedllm {
namespace {

using tiles::V;
using tiles::Vec;

constexpr int64_t kOutChunk = 512;  // outputs per work item of the expand
constexpr int64_t kRowTile = 4;  // rows of one slot per work item of the expand
constexpr int64_t kShrinkRows = 8;  // rows of one slot per work item of the shrink

// y[0:V] += acc, rounded once to y's type (vectorized: a bfloat16 rounded to nearest even).
inline void add_to(float* y, const Vec& acc) { (Vec::loadu(y) + acc).store(y); }
inline void add_to(c10::BFloat16* y, const Vec& acc) {
  const Vec sum = tiles::load_weights(y) + acc;
  at::vec::convert_from_float<c10::BFloat16>(sum, Vec(0.f)).store(y, V);
}
// y[0:2V] += (acc0, acc1): for bfloat16 one full store of both halves.
inline void add_to(float* y, const Vec& acc0, const Vec& acc1) {
  add_to(y, acc0);
  add_to(y + V, acc1);
}
inline void add_to(c10::BFloat16* y, const Vec& acc0, const Vec& acc1) {
  const Vec sum0 = tiles::load_weights(y) + acc0, sum1 = tiles::load_weights(y + V) + acc1;
  at::vec::convert_from_float<c10::BFloat16>(sum0, sum1).store(y);
}

// MT rows of one slot, outputs n0..n1: y[i, n] += sum_r v[i][r] * b[r, n] (b: the slot's B by
// rank, row stride N), r in order. MT a constant, so the accumulators stay in registers.
template <int MT, typename T>
inline void expand_tile(const T* b, int64_t N, int64_t c, const float* const* v, T* const* y,
                        int64_t n0, int64_t n1) {
  static_assert(MT <= kRowTile, "a tile's rows");
  int64_t n = n0;
  for (; n + 2 * V <= n1; n += 2 * V) {
    Vec acc[MT][2];
    for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = Vec(0.f);
    for (int64_t r = 0; r < c; ++r) {
      const Vec w0 = tiles::load_weights(b + r * N + n);
      const Vec w1 = tiles::load_weights(b + r * N + n + V);
#pragma GCC unroll 4
      for (int i = 0; i < MT; ++i) {
        const Vec vr(v[i][r]);
        acc[i][0] = at::vec::fmadd(w0, vr, acc[i][0]);
        acc[i][1] = at::vec::fmadd(w1, vr, acc[i][1]);
      }
    }
    for (int i = 0; i < MT; ++i) add_to(y[i] + n, acc[i][0], acc[i][1]);
  }
  for (; n + V <= n1; n += V) {
    Vec acc[MT];
    for (int i = 0; i < MT; ++i) acc[i] = Vec(0.f);
    for (int64_t r = 0; r < c; ++r) {
      const Vec w = tiles::load_weights(b + r * N + n);
#pragma GCC unroll 4
      for (int i = 0; i < MT; ++i) acc[i] = at::vec::fmadd(w, Vec(v[i][r]), acc[i]);
    }
    for (int i = 0; i < MT; ++i) add_to(y[i] + n, acc[i]);
  }
  for (; n < n1; ++n) {
    for (int i = 0; i < MT; ++i) {
      float sum = 0.f;
      for (int64_t r = 0; r < c; ++r) sum += static_cast<float>(b[r * N + n]) * v[i][r];
      y[i][n] = static_cast<T>(static_cast<float>(y[i][n]) + sum);
    }
  }
}

template <typename T>
void add_lora_typed(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
                    const int64_t* slots, const int64_t* columns) {
  const int64_t T_ = x.size(0), K = x.size(1), N = y.size(1);
  const int64_t R = a.size(1);
  const T* xp = x.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const T* bp = bt.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const int64_t y_stride = y.stride(0);
  // Each slot's rows, gathered in order: g = start[s] + i is slot s's i-th row.
  const int64_t S = a.size(0);
  std::vector<std::vector<int64_t>> by_slot(S);
  for (int64_t t = 0; t < T_; ++t)
    if (slots[t] >= 0 && columns[slots[t]] > 0) by_slot[slots[t]].push_back(t);
  std::vector<int64_t> start(S + 1, 0), row_of;
  for (int64_t s = 0; s < S; ++s) {
    start[s + 1] = start[s] + int64_t(by_slot[s].size());
    row_of.insert(row_of.end(), by_slot[s].begin(), by_slot[s].end());
  }
  const int64_t M = start[S];
  if (M == 0) return;
  tiles::AlignedFloats x_buf(M * K), v_buf(M * R);
  float* xf = x_buf.data();
  float* v = v_buf.data();
  at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t k = 0; k < K; ++k) xf[g * K + k] = static_cast<float>(xp[row_of[g] * K + k]);
  });
  // Shrink: v[g, r] = x[g] . a[s, r] in float32, kShrinkRows rows of a slot at a time against
  // the tiles' weight rows (linear_tiles.h: each output in its one order, whatever the tile).
  std::vector<std::pair<int64_t, int64_t>> shrink_items;  // (slot, first row of the block)
  for (int64_t s = 0; s < S; ++s)
    for (int64_t i = 0; i < int64_t(by_slot[s].size()); i += kShrinkRows) shrink_items.emplace_back(s, i);
  at::parallel_for(0, int64_t(shrink_items.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const auto [s, first] = shrink_items[item];
      const int64_t m = std::min<int64_t>(kShrinkRows, int64_t(by_slot[s].size()) - first);
      const int64_t g = start[s] + first, c = columns[s];
      for (int64_t n = 0; n < c; n += tiles::kWeightRows)
        tiles::dense_rows_any(std::min<int64_t>(tiles::kWeightRows, c - n), xf + g * K, m, K,
                              ap + (s * R + n) * K, K, v + g * R + n, R);
    }
  });
  // Expand: y[t, n] += sum_r v[t, r] * bt[s, r, n], r in order, rounded once. Rows of one slot
  // go kRowTile at a time, so each vector of B read serves them all.
  std::vector<std::pair<int64_t, int64_t>> tiles_;  // (slot, first index into by_slot[slot])
  for (int64_t s = 0; s < S; ++s)
    for (int64_t i = 0; i < int64_t(by_slot[s].size()); i += kRowTile) tiles_.emplace_back(s, i);
  const int64_t chunks = (N + kOutChunk - 1) / kOutChunk;
  at::parallel_for(0, int64_t(tiles_.size()) * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const auto [s, first] = tiles_[item / chunks];
      const int64_t n0 = (item % chunks) * kOutChunk, n1 = std::min(N, n0 + kOutChunk);
      const std::vector<int64_t>& rows = by_slot[s];
      const int64_t m = std::min<int64_t>(kRowTile, int64_t(rows.size()) - first);
      const int64_t c = columns[s];
      const T* bs = bp + s * R * N;
      const float* vt[kRowTile];
      T* yt[kRowTile];
      for (int64_t i = 0; i < m; ++i) {
        vt[i] = v + (start[s] + first + i) * R;
        yt[i] = yp + rows[first + i] * y_stride;
      }
      switch (m) {
        case 4: expand_tile<4>(bs, N, c, vt, yt, n0, n1); break;
        case 3: expand_tile<3>(bs, N, c, vt, yt, n0, n1); break;
        case 2: expand_tile<2>(bs, N, c, vt, yt, n0, n1); break;
        default: expand_tile<1>(bs, N, c, vt, yt, n0, n1); break;
      }
    }
  });
}

}  // namespace

void add_lora(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
              const at::Tensor& row_slots, const at::Tensor& columns) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && y.dim() == 2 && y.stride(1) == 1 &&
                  y.size(0) == x.size(0) && y.scalar_type() == x.scalar_type(),
              "add_lora: x [T, K] contiguous, y [T, N] of x's dtype with contiguous rows");
  TORCH_CHECK(a.dim() == 3 && a.is_contiguous() && bt.dim() == 3 && bt.is_contiguous() &&
                  a.size(2) == x.size(1) && bt.size(2) == y.size(1) && a.size(1) == bt.size(1) &&
                  a.size(0) == bt.size(0) && a.scalar_type() == x.scalar_type() &&
                  bt.scalar_type() == x.scalar_type(),
              "add_lora: a [S, R, K] and bt [S, R, N] contiguous, in x's dtype");
  TORCH_CHECK(row_slots.dim() == 1 && row_slots.size(0) == x.size(0) &&
                  row_slots.scalar_type() == at::kLong && row_slots.is_contiguous() &&
                  columns.dim() == 1 && columns.size(0) == a.size(0) &&
                  columns.scalar_type() == at::kLong && columns.is_contiguous(),
              "add_lora: row_slots int64 [T], columns int64 [S]");
  const int64_t* slots = row_slots.data_ptr<int64_t>();
  const int64_t* cols = columns.data_ptr<int64_t>();
  for (int64_t t = 0; t < row_slots.size(0); ++t)
    TORCH_CHECK(slots[t] < a.size(0) && (slots[t] < 0 || cols[slots[t]] <= a.size(1)),
                "add_lora: a row's slot is out of range");
  if (x.scalar_type() == at::kFloat)
    add_lora_typed<float>(y, x, a, bt, slots, cols);
  else if (x.scalar_type() == at::kBFloat16)
    add_lora_typed<c10::BFloat16>(y, x, a, bt, slots, cols);
  else
    TORCH_CHECK(false, "add_lora: float32 or bfloat16");
}

}  // namespace pagedllm

void register_lora(pybind11::module& m) {
  m.def("add_lora", &pagedllm::add_lora, py::call_guard<py::gil_scoped_release>(),
        "(y [T, N], x [T, K], a [S, R, K], bt [S, R, N], row_slots [T], columns [S]): y[t] += "
        "x[t] a[s].T bt[s] over the slot's first columns[s] ranks, for rows whose slot s >= 0");
}
