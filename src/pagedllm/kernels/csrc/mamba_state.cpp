// The recurrent layers' decode steps on CPU (Mamba-2's, and the Gated DeltaNet's below).
//
// The Mamba-2 decode step: each sequence's SSM state h [heads, head_dim, state] updated
// in place in its slot of the pool and read out in the same pass,
//     h = exp(dt * A) * h + (dt * x) (outer) B        y = h . C
// one pass over h (MiBs a sequence at 1B sizes: the step's cost is reading and writing it),
// where torch's ops make three. layers/mamba2.py's torch code is the reference (compiled with
// -ffp-contract=off: each product and sum rounded as torch rounds them; only y's sum over the
// state dimension adds in another order).

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <initializer_list>

namespace pagedllm {

// ssm [slots, heads, head_dim, state] float32, rows' slots [rows] int64; x [rows, heads,
// head_dim], dt [rows, heads] (after softplus), a [heads] (= -exp(A_log)), b / c [rows, heads,
// state] (each head's group's), all float32 and contiguous; y [rows, heads, head_dim] written.
void mamba_state_update(at::Tensor ssm, const at::Tensor& slots, const at::Tensor& x,
                        const at::Tensor& dt, const at::Tensor& a, const at::Tensor& b,
                        const at::Tensor& c, at::Tensor y) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&ssm, &x, &dt, &a, &b, &c, &y}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(),
                "mamba_state_update: float32, contiguous tensors");
  }
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 1,
              "mamba_state_update: slots int64 [rows]");
  TORCH_CHECK(ssm.dim() == 4, "mamba_state_update: ssm [slots, heads, head_dim, state]");
  const int64_t rows = slots.size(0), heads = ssm.size(1), dim = ssm.size(2), n = ssm.size(3);
  TORCH_CHECK(x.numel() == rows * heads * dim && y.numel() == x.numel() &&
                  dt.numel() == rows * heads && a.numel() == heads &&
                  b.numel() == rows * heads * n && c.numel() == b.numel(),
              "mamba_state_update: shapes do not match the state's");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(slot[r] >= 0 && slot[r] < ssm.size(0), "mamba_state_update: slot out of range");
  }
  using Vec = at::vec::Vectorized<float>;
  float* h_ptr = ssm.data_ptr<float>();
  const float *x_ptr = x.data_ptr<float>(), *dt_ptr = dt.data_ptr<float>();
  const float *a_ptr = a.data_ptr<float>(), *b_ptr = b.data_ptr<float>();
  const float* c_ptr = c.data_ptr<float>();
  float* y_ptr = y.data_ptr<float>();
  at::parallel_for(0, rows * heads, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r = t / heads, hd = t % heads;
      float* h = h_ptr + (slot[r] * heads + hd) * dim * n;
      const float step = dt_ptr[t];
      const Vec decay(std::exp(step * a_ptr[hd]));
      const float *bv = b_ptr + t * n, *cv = c_ptr + t * n, *xv = x_ptr + t * dim;
      for (int64_t p = 0; p < dim; ++p, h += n) {
        const Vec dtx(step * xv[p]);
        Vec acc(0.f);
        for (int64_t i = 0; i < n; i += Vec::size()) {
          const int64_t k = std::min<int64_t>(Vec::size(), n - i);
          const Vec hv = Vec::loadu(h + i, k) * decay + dtx * Vec::loadu(bv + i, k);
          hv.store(h + i, k);
          acc = acc + hv * Vec::loadu(cv + i, k);
        }
        y_ptr[t * dim + p] =
            at::vec::vec_reduce_all<float>([](Vec& u, Vec& v) { return u + v; }, acc);
      }
    }
  });
}

// The Gated DeltaNet decode step: each sequence's state S [value heads, key dim, value dim] in
// its slot, for one token (q, k L2-normalised, q scaled; g its log decay, beta its write):
//     S = exp(g) S        delta = beta (v - S^T k)        S = S + k delta^T        o = S^T q
// reading S once from memory (column block by column block: S^T k over the old state times
// exp(g), then the block rewritten from L1 and o gathered from it), where torch's ops make five. layers/gated_deltanet.py's
// delta_rule_step is the reference (the decay is applied after the sum here: within rounding).
//
// ssm [slots, heads, dk, dv], slots [rows] int64, q / k [rows, heads, dk], v [rows, heads, dv],
// g / beta [rows, heads], all float32 and contiguous; o [rows, heads, dv] written.
void delta_rule_state_update(at::Tensor ssm, const at::Tensor& slots, const at::Tensor& q,
                             const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                             const at::Tensor& beta, at::Tensor o) {
  for (const at::Tensor* t :
       std::initializer_list<const at::Tensor*>{&ssm, &q, &k, &v, &g, &beta, &o}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(),
                "delta_rule_state_update: float32, contiguous tensors");
  }
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 1,
              "delta_rule_state_update: slots int64 [rows]");
  TORCH_CHECK(ssm.dim() == 4, "delta_rule_state_update: ssm [slots, heads, dk, dv]");
  const int64_t rows = slots.size(0), heads = ssm.size(1), dk = ssm.size(2), dv = ssm.size(3);
  TORCH_CHECK(q.numel() == rows * heads * dk && k.numel() == q.numel() &&
                  v.numel() == rows * heads * dv && o.numel() == v.numel() &&
                  g.numel() == rows * heads && beta.numel() == g.numel(),
              "delta_rule_state_update: shapes do not match the state's");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(slot[r] >= 0 && slot[r] < ssm.size(0),
                "delta_rule_state_update: slot out of range");
  }
  using Vec = at::vec::Vectorized<float>;
  float* s_ptr = ssm.data_ptr<float>();
  const float *q_ptr = q.data_ptr<float>(), *k_ptr = k.data_ptr<float>();
  const float *v_ptr = v.data_ptr<float>(), *g_ptr = g.data_ptr<float>();
  const float* beta_ptr = beta.data_ptr<float>();
  float* o_ptr = o.data_ptr<float>();
  at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r = t / heads, hd = t % heads;
      float* s = s_ptr + (slot[r] * heads + hd) * dk * dv;
      const float *qv = q_ptr + t * dk, *kv = k_ptr + t * dk, *vv = v_ptr + t * dv;
      float* out = o_ptr + t * dv;
      const float decay = std::exp(g_ptr[t]);
      // Column block by column block: S^T k for these columns needs only them, so the update
      // that follows finds them in L1 (one read and one write of S from memory).
      for (int64_t j = 0; j < dv; j += Vec::size()) {
        const int64_t n = std::min<int64_t>(Vec::size(), dv - j);
        Vec acc(0.f);
        for (int64_t i = 0; i < dk; ++i) {  // delta = beta (v - decay S^T k), the old S
          acc = acc + Vec(kv[i]) * Vec::loadu(s + i * dv + j, n);
        }
        const Vec d = Vec(beta_ptr[t]) * (Vec::loadu(vv + j, n) - Vec(decay) * acc);
        Vec o_acc(0.f);
        for (int64_t i = 0; i < dk; ++i) {  // S = decay S + k delta^T; o = S^T q
          float* row = s + i * dv + j;
          const Vec sv = Vec(decay) * Vec::loadu(row, n) + Vec(kv[i]) * d;
          sv.store(row, n);
          o_acc = o_acc + Vec(qv[i]) * sv;
        }
        o_acc.store(out + j, n);
      }
    }
  });
}

}  // namespace pagedllm

void register_mamba_state(pybind11::module& m) {
  m.def("delta_rule_state_update", &pagedllm::delta_rule_state_update,
        "Gated DeltaNet decode step in place: (ssm [slots, heads, dk, dv], slots [rows], q, k, v, "
        "g, beta, o [rows, heads, dv] out)");
  m.def("mamba_state_update", &pagedllm::mamba_state_update,
        "Mamba-2 decode step in place: (ssm [slots, heads, head_dim, state], slots [rows], x, dt, "
        "a, b, c, y [rows, heads, head_dim] out)");
}
