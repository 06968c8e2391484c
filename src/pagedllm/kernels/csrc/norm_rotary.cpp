// Fused elementwise layers for CPU: RMSNorm (optionally adding the residual first), rotary
// embedding in place, and SiLU(gate) * up. Each replaces 8-14 small torch ops per call (dispatch overhead dominates at
// decode sizes) and rounds where torch rounds, so the results are those of the torch code in
// layers/layernorm.py and layers/rotary.py (compiled with -ffp-contract=off: no fused
// multiply-adds where torch has none).

#include <torch/extension.h>

#include "ops.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>

namespace pagedllm {
namespace {

// Round a float to T and back, as storing an intermediate tensor of dtype T does.
template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

// Rows per thread task: at decode sizes one thread does all (waking the pool costs more).
constexpr int64_t kRowGrain = 32;

template <typename T>
void rms_norm_kernel(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                     at::Tensor* residual, double eps) {
  const int64_t rows = x.size(0), dim = x.size(1);
  const T* x_ptr = x.data_ptr<T>();
  const T* w_ptr = weight.data_ptr<T>();
  T* o_ptr = out.data_ptr<T>();
  T* r_ptr = residual ? residual->data_ptr<T>() : nullptr;
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* xi = x_ptr + i * dim;
      T* oi = o_ptr + i * dim;
      T* src = oi;  // the row normalised: x, or x + residual (written back to residual)
      if (r_ptr) {
        T* ri = r_ptr + i * dim;
        for (int64_t d = 0; d < dim; ++d) ri[d] = static_cast<T>(static_cast<float>(xi[d]) + static_cast<float>(ri[d]));
        src = ri;
      } else {
        src = const_cast<T*>(xi);
      }
      float sum = 0.f;
      for (int64_t d = 0; d < dim; ++d) {
        const float v = static_cast<float>(src[d]);
        sum += v * v;
      }
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(dim) + static_cast<float>(eps));
      for (int64_t d = 0; d < dim; ++d) {
        // torch: (x.float() * rsqrt(...)).to(dtype), then weight * that in dtype.
        const float normed = round_to<T>(static_cast<float>(src[d]) * inv);
        oi[d] = static_cast<T>(static_cast<float>(w_ptr[d]) * normed);
      }
    }
  });
}

}  // namespace

// out = RMSNorm(x) * weight; with `residual`, first residual = x + residual (in place) and the
// sum is normalised. x, residual, out: [rows, dim] contiguous; weight [dim].
void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight,
              std::optional<at::Tensor> residual, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.is_contiguous() && out.sizes() == x.sizes(),
              "rms_norm: x and out [rows, dim], contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "rms_norm: weight [dim]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type(),
              "rms_norm: one dtype");
  at::Tensor* r = nullptr;
  if (residual.has_value()) {
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes() &&
                    residual->scalar_type() == x.scalar_type(),
                "rms_norm: residual like x");
    r = &residual.value();
  }
  switch (x.scalar_type()) {
    case at::kFloat: rms_norm_kernel<float>(out, x, weight, r, eps); break;
    case at::kBFloat16: rms_norm_kernel<at::BFloat16>(out, x, weight, r, eps); break;
    case at::kHalf: rms_norm_kernel<at::Half>(out, x, weight, r, eps); break;
    default: TORCH_CHECK(false, "rms_norm: float32, bfloat16 or float16");
  }
}

namespace {

template <typename T>
void rotary_kernel(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_cache,
                   const at::Tensor& sin_cache, int64_t head_dim, int64_t rotary_dim) {
  const int64_t tokens = x.size(0), heads = x.size(1) / head_dim, half = rotary_dim / 2;
  const int64_t row = x.stride(0);
  T* x_ptr = x.data_ptr<T>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cos_ptr = cos_cache.data_ptr<float>();
  const float* sin_ptr = sin_cache.data_ptr<float>();
  at::parallel_for(0, tokens, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      // torch casts cos/sin to the activations' dtype first.
      const float* c = cos_ptr + pos[t] * half;
      const float* s = sin_ptr + pos[t] * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* xh = x_ptr + t * row + h * head_dim;
        for (int64_t d = 0; d < half; ++d) {
          const float cd = round_to<T>(c[d]), sd = round_to<T>(s[d]);
          const float x1 = static_cast<float>(xh[d]), x2 = static_cast<float>(xh[d + half]);
          // (x1 * cos - x2 * sin, x2 * cos + x1 * sin), each product and sum rounded to T.
          xh[d] = static_cast<T>(round_to<T>(x1 * cd) - round_to<T>(x2 * sd));
          xh[d + half] = static_cast<T>(round_to<T>(x2 * cd) + round_to<T>(x1 * sd));
        }
      }
    }
  });
}

}  // namespace

// Rotary embedding (HF's rotate_half layout) in place on x [tokens, heads * head_dim] (rows may
// be strided, e.g. q and k slices of a fused qkv output); the first rotary_dim dims of each head
// rotate. cos_cache/sin_cache: [max_positions, rotary_dim / 2] float32; positions [tokens] int64.
void rotary_embedding(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos_cache,
                      const at::Tensor& sin_cache, int64_t head_dim, int64_t rotary_dim) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % head_dim == 0,
              "rotary: x [tokens, heads * head_dim] with contiguous rows");
  TORCH_CHECK(rotary_dim % 2 == 0 && rotary_dim <= head_dim, "rotary: even rotary_dim <= head_dim");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.size(0) == x.size(0),
              "rotary: positions [tokens] int64");
  TORCH_CHECK(cos_cache.scalar_type() == at::kFloat && sin_cache.scalar_type() == at::kFloat &&
                  cos_cache.is_contiguous() && sin_cache.is_contiguous() &&
                  cos_cache.size(1) == rotary_dim / 2 && sin_cache.sizes() == cos_cache.sizes(),
              "rotary: float32 cos/sin caches [max_positions, rotary_dim / 2]");
  switch (x.scalar_type()) {
    case at::kFloat: rotary_kernel<float>(x, positions, cos_cache, sin_cache, head_dim, rotary_dim); break;
    case at::kBFloat16: rotary_kernel<at::BFloat16>(x, positions, cos_cache, sin_cache, head_dim, rotary_dim); break;
    case at::kHalf: rotary_kernel<at::Half>(x, positions, cos_cache, sin_cache, head_dim, rotary_dim); break;
    default: TORCH_CHECK(false, "rotary: float32, bfloat16 or float16");
  }
}

namespace {

template <typename T>
void silu_and_mul_kernel(at::Tensor& out, const at::Tensor& x) {
  using Vec = at::vec::Vectorized<float>;
  const int64_t rows = x.size(0), d = out.size(1);
  const T* x_ptr = x.data_ptr<T>();
  T* o_ptr = out.data_ptr<T>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    float g[Vec::size()], u[Vec::size()];
    for (int64_t i = begin; i < end; ++i) {
      const T* gate = x_ptr + i * 2 * d;
      const T* up = gate + d;
      T* o = o_ptr + i * d;
      for (int64_t j = 0; j < d; j += Vec::size()) {
        const int64_t n = std::min<int64_t>(Vec::size(), d - j);
        for (int64_t k = 0; k < n; ++k) {
          g[k] = static_cast<float>(gate[j + k]);
          u[k] = static_cast<float>(up[j + k]);
        }
        // torch: silu(gate) = gate / (1 + exp(-gate)) in float, rounded to T; then * up in T.
        const Vec gv = Vec::loadu(g, n);
        (gv / (Vec(1.f) + gv.neg().exp())).store(g, n);
        for (int64_t k = 0; k < n; ++k) o[j + k] = static_cast<T>(round_to<T>(g[k]) * u[k]);
      }
    }
  });
}

}  // namespace

// out [rows, d] = silu(x[:, :d]) * x[:, d:] for x [rows, 2 d] (a fused gate_up projection).
void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == x.size(0) && 2 * out.size(1) == x.size(1),
              "silu_and_mul: x [rows, 2 d] and out [rows, d], contiguous");
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "silu_and_mul: one dtype");
  switch (x.scalar_type()) {
    case at::kFloat: silu_and_mul_kernel<float>(out, x); break;
    case at::kBFloat16: silu_and_mul_kernel<at::BFloat16>(out, x); break;
    case at::kHalf: silu_and_mul_kernel<at::Half>(out, x); break;
    default: TORCH_CHECK(false, "silu_and_mul: float32, bfloat16 or float16");
  }
}

}  // namespace pagedllm

void register_norm_rotary(pybind11::module& m) {
  m.def("rms_norm", &pagedllm::rms_norm, "out = RMSNorm(x [+ residual, written back]) * weight",
        py::arg("out"), py::arg("x"), py::arg("weight"), py::arg("residual"), py::arg("eps"));
  m.def("rotary_embedding", &pagedllm::rotary_embedding,
        "rotary embedding in place on x [tokens, heads * head_dim] (rotate_half layout)");
  m.def("silu_and_mul", &pagedllm::silu_and_mul, "out [rows, d] = silu(x[:, :d]) * x[:, d:]");
}
