// Quantized weights times 8-bit activations in integers (int8_act.h has the formats and the
// fixed order): the activations' quantization, the plain reference every variant must equal,
// and the variant chosen from the CPU's instruction sets (or named, for tests and benchmarks).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "int8_act.h"
#include "ops.h"

namespace pagedllm {
namespace int8_act {

// One row of K floats -> codes, block scales, block sums and half-block sums (int8_act.h).
// Plain loops: the compiler vectorises them, and they must equal the reference's arithmetic.
void quantize_row(const float* x, int64_t K, int8_t* q, float* d, int32_t* sum, int32_t* sum16) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.f;
    for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float scale = amax / 127.f;
    const float inv = scale != 0.f ? 1.f / scale : 0.f;
    int32_t s[2];
    for (int64_t h = 0; h < 2; ++h) {
      s[h] = 0;
      for (int64_t i = 16 * h; i < 16 * h + 16; ++i) {
        const float r = std::nearbyint(xb[i] * inv);  // to nearest, ties to even
        const int32_t v = static_cast<int32_t>(std::min(127.f, std::max(-127.f, r)));
        q[b * kBlock + i] = static_cast<int8_t>(v);
        s[h] += v;
      }
    }
    d[b] = scale;
    sum[b] = s[0] + s[1];
    sum16[2 * b] = s[0];
    sum16[2 * b + 1] = s[1];
  }
}

void tiles_reference(const Activations& x, int64_t M, const Weights& w, int64_t t0, int64_t t1, float* y,
                     int64_t ldy) {
  const int64_t blocks = w.blocks(), K = w.K, halves = w.halves;
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = w.codes + t * w.tile_bytes();
    for (int64_t m = 0; m < M; ++m) {
      const int8_t* xq = x.q + m * K;
      for (int64_t lane = 0; lane < kTile && t * kTile + lane < w.N; ++lane) {
        float acc = 0.f;
        for (int64_t b = 0; b < blocks; ++b) {
          const int8_t* xb = xq + b * kBlock;
          int32_t isum[2] = {0, 0};  // per half block of 16 columns
          if (w.bits == 4) {
            const uint8_t* codes = tile + b * 256;
            for (int j = 0; j < 4; ++j) {
              for (int i = 0; i < 4; ++i) {
                const uint8_t byte = codes[j * 64 + lane * 4 + i];
                isum[0] += (byte & 15) * xb[4 * j + i] + (byte >> 4) * xb[16 + 4 * j + i];
              }
            }
          } else if (w.bits == 6) {  // u = q + 32: low nibble in chunk j, high pair in chunk 4 + j / 2
            const uint8_t* codes = tile + b * 384;
            for (int j = 0; j < 4; ++j) {
              for (int i = 0; i < 4; ++i) {
                const uint8_t nib = codes[j * 64 + lane * 4 + i];
                const uint8_t pairs = codes[256 + j / 2 * 64 + lane * 4 + i] >> (4 * (j % 2));
                const int32_t lo = (nib & 15) | (pairs & 3) << 4, hi = (nib >> 4) | (pairs >> 2 & 3) << 4;
                isum[0] += (lo - 32) * xb[4 * j + i];
                isum[1] += (hi - 32) * xb[16 + 4 * j + i];
              }
            }
          } else {
            const uint8_t* codes = tile + b * 512;
            for (int j = 0; j < 8; ++j)
              for (int i = 0; i < 4; ++i)
                isum[halves == 2 ? j / 4 : 0] +=
                    (static_cast<int32_t>(codes[j * 64 + lane * 4 + i]) - 128) * xb[4 * j + i];
          }
          const float xd = x.d[m * blocks + b];
          for (int64_t h = 0; h < halves; ++h) {
            const int64_t at = ((t * blocks + b) * halves + h) * kTile + lane;
            acc = std::fma(static_cast<float>(isum[h]), half_bits_to_float(w.scales[at]) * xd, acc);
          }
          if (w.mins) {
            const int64_t at = (t * blocks + b) * kTile + lane;
            acc = std::fma(half_bits_to_float(w.mins[at]), xd * static_cast<float>(x.sum[m * blocks + b]), acc);
          }
        }
        y[m * ldy + t * kTile + lane] = acc;
      }
    }
  }
}

namespace {

struct Variant {
  const char* name;
  TileKernel kernel;
};

// Fastest first; each one only where this build (compiled for this CPU) has its instructions.
const std::vector<Variant>& variants() {
  static const std::vector<Variant> all = {
#ifdef PAGEDLLM_INT8_ACT_VNNI512
      {"avx512_vnni", tiles_avx512_vnni},
#endif
#ifdef PAGEDLLM_INT8_ACT_AVX_VNNI
      {"avx_vnni", tiles_avx_vnni},
#endif
#ifdef PAGEDLLM_INT8_ACT_AVX2
      {"avx2", tiles_avx2},
#endif
      {"reference", tiles_reference},
  };
  return all;
}

TileKernel kernel_named(const std::string& name) {
  if (name.empty()) return variants().front().kernel;
  for (const Variant& v : variants())
    if (name == v.name) return v.kernel;
  TORCH_CHECK(false, "int8_act_linear: no variant ", name, " in this build");
}

}  // namespace
}  // namespace int8_act

std::vector<std::string> int8_act_variants() {
  std::vector<std::string> names;
  for (const auto& v : int8_act::variants()) names.emplace_back(v.name);
  return names;
}

namespace {

// int8_act_quantize's four tensors, then d * float(sum) per block (Activations::dsum).
std::vector<at::Tensor> quantize_activations(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % int8_act::kBlock == 0, "x: [M, K], K a multiple of 32");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1), blocks = K / int8_act::kBlock;
  at::Tensor q = at::empty({M, K}, xf.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, blocks}, xf.options());
  at::Tensor sum = at::empty({M, blocks}, xf.options().dtype(at::kInt));
  at::Tensor sum16 = at::empty({M, 2 * blocks}, xf.options().dtype(at::kInt));
  at::Tensor dsum = at::empty({M, blocks}, xf.options());
  const float* xp = xf.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float *dp = d.data_ptr<float>(), *dsp = dsum.data_ptr<float>();
  int32_t *sp = sum.data_ptr<int32_t>(), *hp = sum16.data_ptr<int32_t>();
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      int8_act::quantize_row(xp + m * K, K, qp + m * K, dp + m * blocks, sp + m * blocks, hp + 2 * m * blocks);
      for (int64_t b = m * blocks; b < (m + 1) * blocks; ++b) dsp[b] = dp[b] * static_cast<float>(sp[b]);
    }
  });
  return {q, d, sum, sum16, dsum};
}

}  // namespace

std::vector<at::Tensor> int8_act_quantize(const at::Tensor& x) {
  std::vector<at::Tensor> xq = quantize_activations(x);
  xq.pop_back();
  return xq;
}

at::Tensor int8_act_int6_words(const at::Tensor& q) {
  using namespace int8_act;
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.size(1) % kBlock == 0,
              "q: int8 [N, K], K a multiple of 32");
  const at::Tensor qc = q.contiguous();
  const int64_t N = qc.size(0), K = qc.size(1), blocks = K / kBlock;
  at::Tensor words = at::empty({N, blocks, 6}, qc.options().dtype(at::kInt));
  const int8_t* qp = qc.data_ptr<int8_t>();
  uint8_t* out = reinterpret_cast<uint8_t*>(words.data_ptr<int32_t>());
  std::atomic<bool> outside{false};
  at::parallel_for(0, N * blocks, 1024, [&](int64_t begin, int64_t end) {
    bool bad = false;
    for (int64_t blk = begin; blk < end; ++blk) {
      uint8_t u[kBlock];
      for (int64_t i = 0; i < kBlock; ++i) {
        const int v = qp[blk * kBlock + i] + 32;
        bad |= v < 0 || v > 63;
        u[i] = static_cast<uint8_t>(v);
      }
      uint8_t* o = out + blk * 24;  // int8_act.h's int6 layout, one row's block
      for (int i = 0; i < 16; ++i) o[i] = (u[i] & 15) | (u[16 + i] & 15) << 4;
      for (int p = 0; p < 2; ++p)
        for (int i = 0; i < 4; ++i)
          o[16 + 4 * p + i] = (u[8 * p + i] >> 4) | (u[16 + 8 * p + i] >> 4) << 2 | (u[8 * p + 4 + i] >> 4) << 4 |
                              (u[16 + 8 * p + 4 + i] >> 4) << 6;
    }
    if (bad) outside = true;
  });
  TORCH_CHECK_VALUE(!outside, "int6 codes must lie in -32..31");
  return words;
}

at::Tensor int8_act_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                           const std::optional<at::Tensor>& mins, int64_t bits, int64_t n,
                           const std::string& variant) {
  using namespace int8_act;
  TORCH_CHECK(x.dim() == 2, "x: [M, K]");
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "bits: 4, 6 or 8");
  const int64_t M = x.size(0), K = x.size(1), blocks = K / kBlock, tiles = (n + kTile - 1) / kTile;
  // int8x and int6: a scale per half block (twice int8's scales), and mins unless all are 0
  const int64_t halves = bits == 6 || (bits == 8 && scales.numel() == 2 * tiles * blocks * kTile) ? 2 : 1;
  TORCH_CHECK(halves == 2 || (bits == 4) == mins.has_value(), "int4 codes take mins, int8 codes none");
  TORCH_CHECK(K % kBlock == 0, "K must be a multiple of 32, got ", K);
  TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == at::kByte &&
                  codes.numel() == tiles * blocks * kBlock * kTile * bits / 8,
              "codes: uint8, repacked for ", n, " rows of ", K, " columns");
  TORCH_CHECK(scales.is_contiguous() && scales.element_size() == 2 &&
                  scales.numel() == halves * tiles * blocks * kTile,
              "scales: float16 [tiles, blocks, 16] (int8x, int6: [tiles, blocks, 2, 16])");
  if (mins)
    TORCH_CHECK(mins->is_contiguous() && mins->element_size() == 2 && mins->numel() == tiles * blocks * kTile,
                "mins: float16 [tiles, blocks, 16]");
  const TileKernel kernel = kernel_named(variant);
  const std::vector<at::Tensor> xq = quantize_activations(x);
  const Activations a{xq[0].data_ptr<int8_t>(), xq[1].data_ptr<float>(), xq[2].data_ptr<int32_t>(),
                      xq[3].data_ptr<int32_t>(), K, xq[4].data_ptr<float>()};
  const Weights w{codes.data_ptr<uint8_t>(), static_cast<const uint16_t*>(scales.data_ptr()),
                  mins ? static_cast<const uint16_t*>(mins->data_ptr()) : nullptr,
                  static_cast<int>(bits), static_cast<int>(halves), K, n};
  at::Tensor y = at::empty({M, n}, x.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) { kernel(a, M, w, t0, t1, yp, n); });
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

}  // namespace pagedllm

void register_int8_act(pybind11::module& m) {
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("int8_act_linear", &pagedllm::int8_act_linear, no_gil, py::arg("x"), py::arg("codes"),
        py::arg("scales"), py::arg("mins"), py::arg("bits"), py::arg("n"), py::arg("variant") = "",
        "x [M, K] (8-bit per block of 32 on the way in) @ repacked int4 / int6 / int8 / int8x codes -> [M, n] in "
        "x's dtype, in integers (int8_act.h); variant: '' for the fastest, or one of "
        "int8_act_variants()");
  m.def("int8_act_quantize", &pagedllm::int8_act_quantize, no_gil,
        "x [M, K] -> (codes int8 [M, K], scales float32 [M, K / 32], sums int32 [M, K / 32], "
        "half-block sums int32 [M, K / 16])");
  m.def("int8_act_int6_words", &pagedllm::int8_act_int6_words, no_gil,
        "int8 codes [N, K] in -32..31 -> int32 [N, K / 32, 6]: each row's blocks in int8_act.h's int6 "
        "layout, a word (4 bytes) of each of a block's 6 chunks");
  m.def("int8_act_variants", &pagedllm::int8_act_variants,
        "the integer kernels this build has, fastest first; 'reference' always");
}
