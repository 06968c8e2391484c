// A Llama-style decoder stack (Llama, Qwen2 and Qwen3 with its q/k norms, Granite with its
// residual multiplier, Phi-3) in one C++ call, for steps whose requests all go through the paged
// attention kernel (decode). At a single stream's sizes the kernels take a few microseconds each
// and the Python and torch glue between them (modules, views, allocations: about 100 us a
// layer) was a quarter of the step; here the same kernels run in the same order, with the same
// arguments as models/llama.py gives them, so the results are identical, and without the GIL.

#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "ops.h"

namespace pagedllm {
namespace {

// The row count a packed product runs at: unquantized.padded_rows's rule (exact up to 16, then
// 8 counts per doubling), so that oneDNN creates a primitive for a few shapes only.
int64_t padded_rows(int64_t rows) {
  int64_t bits = 0;
  while ((rows >> bits) != 0) ++bits;
  const int64_t step = int64_t{1} << std::max<int64_t>(0, bits - 4);
  return (rows + step - 1) / step * step;
}

// oneDNN's product with a weight prepacked by mkldnn._reorder_linear_weight
// (layers/quantization/unquantized.py), through the dispatcher as
// torch.ops.mkldnn._linear_pointwise, at padded_rows rows as there.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed_weight,
                         const std::optional<at::Tensor>& bias) {
  const int64_t rows = x.size(0), bucket = padded_rows(rows);
  if (bucket != rows) {
    const at::Tensor padded = at::constant_pad_nd(x, {0, 0, 0, bucket - rows});
    return packed_linear(padded, packed_weight, bias).narrow(0, 0, rows);
  }
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            std::string_view, c10::List<std::optional<at::Scalar>>,
                            std::optional<std::string_view>)>();
  return op.call(x, packed_weight, bias, "none", c10::List<std::optional<at::Scalar>>(), "");
}

// A projection's LoRA slots (layers/lora.py's tensors, shared: loads into a slot show here).
struct LoRA {
  at::Tensor a, bt, columns;
};

// One projection, as the Python layer it stands for computes it.
struct Linear {
  enum Kind { kDense, kPacked, kInt4, kInt8, kInt8Act };
  Kind kind;
  // dense/packed: {weight}; int4: {codes, scales, mins}; int8: {codes, scales};
  // int8_act: {repacked codes, scales[, mins]} of `rows` outputs (int8_act.h)
  std::vector<at::Tensor> weights;
  std::optional<at::Tensor> bias;
  // Codes and a float copy (layers/quantization/dual.py): above max_code_rows rows, the copy.
  std::shared_ptr<const Linear> many_rows;
  int64_t max_code_rows = 0;
  int64_t rows = 0;  // int8_act: output rows

  // Batch invariant (--deterministic): float32 products in the fixed-order kernels, a bfloat16 x
  // widened to float32 before and the result rounded after, as layers/quantization does; but
  // int4 codes take bfloat16 x as it is where int4_takes_bf16 (invariant in its own order).
  bool fixed_order = false;
  std::shared_ptr<const LoRA> lora;  // with --enable-lora: added for rows with an adapter slot

  at::Tensor operator()(const at::Tensor& x, const std::optional<at::Tensor>& lora_slots) const {
    at::Tensor y = base(x);
    if (lora && lora_slots) add_lora(y, x.contiguous(), lora->a, lora->bt, *lora_slots, lora->columns);
    return y;
  }

  at::Tensor base(const at::Tensor& x) const {
    const bool bf16_codes = kind == kInt4 && x.scalar_type() == at::kBFloat16 && int4_takes_bf16(x.size(1));
    if (fixed_order && x.scalar_type() != at::kFloat && !bf16_codes)
      return product(x.to(at::kFloat)).to(x.scalar_type());
    return product(x);
  }

  at::Tensor product(const at::Tensor& x) const {
    if (many_rows && x.size(0) > max_code_rows) return many_rows->base(x);
    switch (kind) {
      case kDense:
        if (fixed_order) return dense_linear(x, weights[0], bias);
        return at::linear(x, weights[0], bias);
      case kPacked: return packed_linear(x, weights[0], bias);
      case kInt4: return with_bias(int4_linear(x, weights[0], weights[1], weights[2]));
      case kInt8: return with_bias(int8_linear(x, weights[0], weights[1]));
      case kInt8Act: {
        const std::optional<at::Tensor> mins = weights.size() > 2 ? std::optional(weights[2]) : std::nullopt;
        // codes [tiles, blocks, chunks, 16, 4]: chunks = bits (4 int4, 6 int6, 8 int8 / int8x)
        return with_bias(int8_act_linear(x, weights[0], weights[1], mins, weights[0].size(2), rows, ""));
      }
    }
    TORCH_CHECK(false, "unknown linear kind");
  }

  at::Tensor with_bias(at::Tensor y) const { return bias ? y.add_(*bias) : y; }
};

struct Layer {
  at::Tensor input_norm, post_attention_norm;
  Linear qkv, o, gate_up, down;
  int64_t sliding_window;  // 0: none
  std::optional<at::Tensor> q_norm, k_norm;  // per head, before rotary (Qwen3)
};

class LlamaDecoder {
 public:
  LlamaDecoder(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t rotary_dim,
               double scale, double eps, at::Tensor cos_cache, at::Tensor sin_cache,
               at::Tensor final_norm, double residual_multiplier)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim),
        rotary_dim_(rotary_dim), scale_(scale), eps_(eps), cos_cache_(std::move(cos_cache)),
        sin_cache_(std::move(sin_cache)), final_norm_(std::move(final_norm)),
        residual_multiplier_(residual_multiplier) {}

  void add_layer(at::Tensor input_norm, at::Tensor post_attention_norm, Linear qkv, Linear o,
                 Linear gate_up, Linear down, int64_t sliding_window,
                 std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm) {
    layers_.push_back({std::move(input_norm), std::move(post_attention_norm), std::move(qkv),
                       std::move(o), std::move(gate_up), std::move(down), sliding_window,
                       std::move(q_norm), std::move(k_norm)});
  }

  // hidden [T, hidden]: the embeddings, which become the residual stream (updated in place, as
  // the Python path does); returns the final norm's output. kv_caches: one (K, V) per layer.
  at::Tensor forward(at::Tensor hidden, const at::Tensor& positions,
                     const std::vector<std::pair<at::Tensor, at::Tensor>>& kv_caches,
                     const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     const std::optional<at::Tensor>& lora_slots) const {
    TORCH_CHECK(!layers_.empty() && kv_caches.size() == layers_.size(), "one KV cache per layer");
    TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "hidden: [tokens, hidden], contiguous");
    const int64_t T = hidden.size(0), d = head_dim_;
    const int64_t q_size = num_heads_ * d, kv_size = num_kv_heads_ * d;
    at::Tensor residual = hidden;
    at::Tensor normed = at::empty_like(hidden);
    rms_norm(normed, hidden, layers_[0].input_norm, std::nullopt, eps_);
    at::Tensor h;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      if (i > 0) {
        normed = at::empty_like(h);
        rms_norm(normed, scaled(h), layer.input_norm, residual, eps_);
      }
      const at::Tensor qkv = layer.qkv(normed, lora_slots);
      at::Tensor q = qkv.narrow(1, 0, q_size);
      at::Tensor k = qkv.narrow(1, q_size, kv_size);
      const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size);
      if (layer.q_norm) {
        q = norm_heads(q, *layer.q_norm);
        k = norm_heads(k, *layer.k_norm);
      }
      rotary_embedding(q, positions, cos_cache_, sin_cache_, d, rotary_dim_);
      rotary_embedding(k, positions, cos_cache_, sin_cache_, d, rotary_dim_);
      const auto& [k_cache, v_cache] = kv_caches[i];
      reshape_and_cache(k.view({T, num_kv_heads_, d}), v.view({T, num_kv_heads_, d}), k_cache,
                        v_cache, slot_mapping);
      at::Tensor attn = at::empty({T, num_heads_, d}, hidden.options());
      paged_attention(attn, q.view({T, num_heads_, d}), k_cache, v_cache, block_tables, seq_lens,
                      query_start_loc, scale_, layer.sliding_window, 0.0, 0);
      const at::Tensor o = layer.o(attn.view({T, q_size}), lora_slots);
      normed = at::empty_like(o);
      rms_norm(normed, scaled(o), layer.post_attention_norm, residual, eps_);
      const at::Tensor gate_up = layer.gate_up(normed, lora_slots);
      at::Tensor act = at::empty({T, gate_up.size(1) / 2}, gate_up.options());
      silu_and_mul(act, gate_up);
      h = layer.down(act, lora_slots);
    }
    at::Tensor out = at::empty_like(h);
    rms_norm(out, scaled(h), final_norm_, residual, eps_);
    return out;
  }

 private:
  // A block's output as it joins the residual stream (Granite's residual_multiplier), as
  // LlamaDecoderLayer._scale.
  at::Tensor scaled(const at::Tensor& x) const {
    return residual_multiplier_ == 1.0 ? x : x * residual_multiplier_;
  }

  // x [T, heads * head_dim] normed per head, as RMSNorm on its [T, heads, head_dim] view: a
  // contiguous copy of the rows, then the kernel.
  at::Tensor norm_heads(const at::Tensor& x, const at::Tensor& weight) const {
    const at::Tensor rows = x.reshape({-1, head_dim_}).contiguous();
    at::Tensor out = at::empty_like(rows);
    rms_norm(out, rows, weight, std::nullopt, eps_);
    return out.view({x.size(0), x.size(1)});
  }

  int64_t num_heads_, num_kv_heads_, head_dim_, rotary_dim_;
  double scale_, eps_;
  at::Tensor cos_cache_, sin_cache_, final_norm_;
  double residual_multiplier_;
  std::vector<Layer> layers_;
};

}  // namespace
}  // namespace pagedllm

void register_decoder(pybind11::module& m) {
  using pagedllm::Linear;
  using pagedllm::LlamaDecoder;
  using Bias = std::optional<at::Tensor>;
  m.def("padded_rows", &pagedllm::padded_rows, "the row count a packed product runs at");
  py::class_<Linear>(m, "Linear", "one projection of the fused decoder, as its Python layer")
      .def_static("dense", [](at::Tensor w, Bias b) { return Linear{Linear::kDense, {w}, b}; })
      .def_static("packed", [](at::Tensor w, Bias b) { return Linear{Linear::kPacked, {w}, b}; })
      .def_static("int4", [](at::Tensor q, at::Tensor s, at::Tensor mn, Bias b) {
        return Linear{Linear::kInt4, {q, s, mn}, b};
      })
      .def_static("int8", [](at::Tensor q, at::Tensor s, Bias b) {
        return Linear{Linear::kInt8, {q, s}, b};
      })
      .def_static("int8_act", [](std::vector<at::Tensor> codes, int64_t rows, Bias b) {
        Linear linear{Linear::kInt8Act, std::move(codes), b};
        linear.rows = rows;
        return linear;
      })
      .def_static("fixed_order", [](Linear linear) {
        linear.fixed_order = true;
        return linear;
      })
      .def_static("with_lora", [](Linear linear, at::Tensor a, at::Tensor bt, at::Tensor columns) {
        linear.lora = std::make_shared<const pagedllm::LoRA>(pagedllm::LoRA{a, bt, columns});
        return linear;
      })
      .def_static("dual", [](Linear codes, Linear many_rows, int64_t max_code_rows) {
        codes.many_rows = std::make_shared<const Linear>(std::move(many_rows));
        codes.max_code_rows = max_code_rows;
        return codes;
      });
  py::class_<LlamaDecoder>(m, "LlamaDecoder", "a Llama-style decoder stack in one call")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, double, double, at::Tensor, at::Tensor,
                    at::Tensor, double>(),
           py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
           py::arg("rotary_dim"), py::arg("scale"), py::arg("eps"), py::arg("cos_cache"),
           py::arg("sin_cache"), py::arg("final_norm"), py::arg("residual_multiplier") = 1.0)
      .def("add_layer", &LlamaDecoder::add_layer)
      // Without the GIL, as torch's own operators run: the server's HTTP thread can work meanwhile.
      .def("forward", &LlamaDecoder::forward, py::call_guard<py::gil_scoped_release>());
}
