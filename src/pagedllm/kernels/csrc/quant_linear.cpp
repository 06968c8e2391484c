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
// AVX512-BF16 take the bf16 dot-product path instead (quant_int4_bf16.cpp), which is batch
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
#include "quant_blocks.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace pagedllm {
namespace {

using namespace quant;


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

}  // namespace

namespace quant {

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

}  // namespace quant

namespace {

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
  if constexpr (kInt4 && std::is_same_v<T, at::BFloat16>) {
    if (int4_takes_bf16(K)) return int4_linear_bf16(yp, x, qp, sp, mp, row_bytes, M, K, N, G);
  }
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
