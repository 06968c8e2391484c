// x @ weight.T for float32 or bfloat16 weights in linear_tiles.h's fixed order: a row's result is
// the same alone or in any batch, and the same as the codes kernels give from the codes the
// weight was dequantized from (quant_linear.cpp). x and y are float32 (bfloat16 activations are
// widened before and rounded after, by the caller). torch's F.linear (MKL, oneDNN) picks its blocking, and
// with it the order of the sums, by the number of rows.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>

#include "linear_tiles.h"
#include "ops.h"

namespace pagedllm {

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "dense_linear: x float32 [M, K], contiguous");
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() &&
                  (bf16 || weight.scalar_type() == at::kFloat) && weight.size(1) == x.size(1),
              "dense_linear: weight float32 or bfloat16 [N, K], contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  constexpr int64_t NT = tiles::kWeightRows;
  const int64_t pass = tiles::rows_per_pass(K);
  auto multiply = [&](const auto* wp) {
    for (int64_t m0 = 0; m0 < M; m0 += pass) {
      const int64_t rows_x = std::min(pass, M - m0);
      at::parallel_for(0, (N + NT - 1) / NT, 4, [&](int64_t begin, int64_t end) {
        for (int64_t n = begin * NT; n < std::min(N, end * NT); n += NT) {
          tiles::dense_rows_any(std::min(NT, N - n), xp + m0 * K, rows_x, K, wp + n * K, K,
                                yp + m0 * N + n, N);
        }
      });
    }
  };
  if (bf16)
    multiply(weight.data_ptr<at::BFloat16>());
  else
    multiply(weight.data_ptr<float>());
  if (bias) y.add_(*bias);
  return y;
}

}  // namespace pagedllm

void register_dense_linear(pybind11::module& m) {
  m.def("dense_linear", &pagedllm::dense_linear, py::call_guard<py::gil_scoped_release>(),
        "x float32 [M, K] @ weight float32 or bfloat16 [N, K].T (+ bias) -> float32, in a fixed "
        "order per output");
}
