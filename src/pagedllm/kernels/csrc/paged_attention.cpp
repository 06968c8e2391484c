// Paged attention for CPU: reads K/V through the block table in place, one pass over each block,
// with an online softmax; no contiguous copy of the context is ever made.
//
// One work item is (request, KV head, tile of up to kQueryTile query rows, partition of the
// context). The tile's rows and the query heads sharing the KV head (GQA) are its "slots"; each K
// row is loaded (and converted to float) once for all slots, and so is each V row. A context that
// crosses a multiple of kPartition tokens is split there, each part its own item, and the parts'
// softmax states are merged in order afterwards: a single long request keeps every thread busy.
// Within a part, keys go kKeyChunk positions at a time, gathered from whichever blocks hold
// them. Every split and chunk is fixed by a row's own positions, never by the batch, the tile,
// the block size or the prompt's chunking, so a row's result is bit for bit the same in all of
// them (docs/determinism.md).
// Decode (one row per request), chunked prefill and prefill with cached context are the same
// loop: row r of a request with q_len rows and seq_len context tokens sits at position
// seq_len - q_len + r and sees keys up to it (and, with a sliding window, above position - window).
//
// The cache may hold another dtype than the query, or codes with a scale per row
// (kv_format.h): rows are widened to float as they are loaded, so the loop is the same.
//
// Vectorised with ATen's at::vec (AVX-512, AVX2 or plain C++, chosen when it is built).

#include <torch/extension.h>

#include "kv_format.h"
#include "ops.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstring>
#include <cmath>
#include <limits>
#include <vector>

namespace pagedllm {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kQueryTile = 16;
constexpr int64_t kPartition = 512;  // tokens of context per work item at most
// Keys are taken kKeyChunk positions at a time (one online-softmax update each), whatever the
// block size: the order of a row's sums depends on its positions alone.
constexpr int64_t kKeyChunk = 16;
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

inline float reduce_sum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v);
}

#if defined(CPU_CAPABILITY_AVX2)
// Lane t of the result: the sum of a[t]'s eight lanes.
inline __m256 sum8(const __m256* a) {
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  // s0123 = [a0..a3 over lanes 0-3, a0..a3 over lanes 4-7]; likewise s4567 for a4..a7.
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                       _mm256_permute2f128_ps(s0123, s4567, 0x31));
}
#endif

// One (row, head) slot against keys [lo, hi) of a chunk of float rows (key j's K at
// k + j * ld, its V at v + j * ld): scores, online-softmax update of (run_max, run_sum), and the
// weighted sum of V into acc.
// kVecs > 0 fixes head_dim / Vec::size() at compile time so q and acc live in registers;
// 0 takes it from num_vecs.
template <int kVecs>
inline void attend_block(const float* q, const float* k, const float* v, int64_t ld, int64_t lo,
                         int64_t hi, int64_t num_vecs, float cap, float* scores, float& run_max,
                         float& run_sum, float* acc) {
  constexpr int kRegs = kVecs > 0 ? kVecs : 16;
  const int64_t n = kVecs > 0 ? kVecs : num_vecs;
  Vec qv[kRegs], av[kRegs];
  for (int64_t i = 0; i < n; ++i) qv[i] = Vec::loadu(q + i * Vec::size());
  float block_max = -std::numeric_limits<float>::infinity();
  int64_t j = lo;
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (kVecs > 0) {
    // Eight keys at a time: eight independent FMA chains, then one horizontal reduction for
    // all eight (a key's score does not depend on how many keys are around it).
    __m256 vmax = _mm256_set1_ps(block_max);
    for (; j + 8 <= hi; j += 8) {
      __m256 acc[8];
      for (int t = 0; t < 8; ++t) {
        const float* kj = k + (j + t) * ld;
        __m256 sum = _mm256_mul_ps(qv[0], _mm256_loadu_ps(kj));
        for (int i = 1; i < kVecs; ++i) sum = _mm256_fmadd_ps(qv[i], _mm256_loadu_ps(kj + 8 * i), sum);
        acc[t] = sum;
      }
      __m256 x = sum8(acc);
      if (cap > 0.f) {
        alignas(32) float tmp[8];
        _mm256_store_ps(tmp, x);
        for (float& y : tmp) y = cap * std::tanh(y / cap);
        x = _mm256_load_ps(tmp);
      }
      _mm256_storeu_ps(scores + j, x);
      vmax = _mm256_max_ps(vmax, x);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    for (float y : lanes) block_max = std::max(block_max, y);
  }
#endif
  for (; j < hi; ++j) {
    const float* kj = k + j * ld;
    Vec sum = qv[0] * Vec::loadu(kj);
    for (int64_t i = 1; i < n; ++i) sum = at::vec::fmadd(qv[i], Vec::loadu(kj + i * Vec::size()), sum);
    float x = reduce_sum(sum);
    if (cap > 0.f) x = cap * std::tanh(x / cap);
    scores[j] = x;
    block_max = std::max(block_max, x);
  }
  const float new_max = std::max(run_max, block_max);
  const float correction = run_sum > 0.f ? std::exp(run_max - new_max) : 0.f;
  run_max = new_max;
  // Weights exp(score - max), a vector at a time.
  Vec total(0.f);
  for (int64_t j = lo; j < hi; j += Vec::size()) {
    const int64_t count = std::min<int64_t>(Vec::size(), hi - j);
    Vec p = (Vec::loadu(scores + j, count) - Vec(new_max)).exp_u20();
    if (count < Vec::size()) p = Vec::set(Vec(0.f), p, count);
    p.store(scores + j, count);
    total = total + p;
  }
  run_sum = run_sum * correction + reduce_sum(total);
  for (int64_t i = 0; i < n; ++i) av[i] = Vec::loadu(acc + i * Vec::size()) * Vec(correction);
  for (int64_t j = lo; j < hi; ++j) {
    const Vec p(scores[j]);
    const float* vj = v + j * ld;
    for (int64_t i = 0; i < n; ++i) av[i] = at::vec::fmadd(p, Vec::loadu(vj + i * Vec::size()), av[i]);
  }
  for (int64_t i = 0; i < n; ++i) av[i].store(acc + i * Vec::size());
}

using AttendFn = void (*)(const float*, const float*, const float*, int64_t, int64_t, int64_t,
                          int64_t, float, float*, float&, float&, float*);

inline AttendFn attend_for(int64_t num_vecs) {
  switch (num_vecs) {
    case 2: return attend_block<2>;
    case 4: return attend_block<4>;
    case 8: return attend_block<8>;
    case 16: return attend_block<16>;
    default: return attend_block<0>;
  }
}

struct WorkItem {
  int64_t req, kv_head, row_begin, row_end;  // rows: flattened query indices
  int64_t part_begin, part_end;  // the context positions this item attends to (a partition)
  int64_t partial;  // -1: the whole context, written to out; else its offset in the partials
};

template <typename scalar_t, typename cache_t>
void paged_attention_kernel(
    at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    const at::Tensor& query_start_loc, double scale, int64_t sliding_window,
    double logits_soft_cap, int64_t skip_prefill_from) {
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t num_reqs = seq_lens.size(0);
  const int64_t table_width = block_tables.size(1);
  const int64_t num_vecs = head_dim / Vec::size();

  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const auto* k_ptr = static_cast<const cache_t*>(k_cache.data_ptr());
  const auto* v_ptr = static_cast<const cache_t*>(v_cache.data_ptr());
  scalar_t* o_ptr = out.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  // Strides in elements; the caches are [num_blocks, block_size, kv_heads, head_dim].
  const int64_t q_row = query.stride(0), q_head = query.stride(1);
  const int64_t o_row = out.stride(0), o_head = out.stride(1);
  const int64_t c_block = k_cache.stride(0), c_token = k_cache.stride(1);
  const int64_t c_head = k_cache.stride(2);
  const float cap = static_cast<float>(logits_soft_cap);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const AttendFn attend = attend_for(num_vecs);
  const int64_t row_bytes = k_cache.size(3) * static_cast<int64_t>(sizeof(cache_t));
  const bool in_place = std::is_same_v<cache_t, float> && block_size % kKeyChunk == 0 &&
                        v_cache.strides() == k_cache.strides();

  std::vector<WorkItem> items;
  std::vector<std::pair<int64_t, int64_t>> splits;  // (first item, parts) of each split tile
  // A partial: each of the tile's slots' acc [head_dim], then their run_max, then run_sum.
  int64_t partials_size = 0;
  for (int64_t i = 0; i < num_reqs; ++i) {
    const int64_t q_len = qsl[i + 1] - qsl[i];
    // Long prefill chunks are left to the caller (see cpu.py).
    if (skip_prefill_from > 0 && q_len >= skip_prefill_from) continue;
    const int64_t first_pos = lens[i] - q_len - qsl[i];  // + flattened row index
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      for (int64_t r = qsl[i]; r < qsl[i + 1]; r += kQueryTile) {
        const int64_t r_end = std::min<int64_t>(r + kQueryTile, qsl[i + 1]);
        // The keys the tile can see: [key_begin, key_end).
        const int64_t key_end = first_pos + r_end;
        const int64_t key_begin =
            sliding_window > 0 ? std::max<int64_t>(0, first_pos + r - sliding_window + 1) : 0;
        const int64_t p_first = key_begin / kPartition, p_last = (key_end - 1) / kPartition;
        if (p_first == p_last) {
          items.push_back({i, h, r, r_end, key_begin, key_end, -1});
          continue;
        }
        splits.push_back({static_cast<int64_t>(items.size()), p_last - p_first + 1});
        for (int64_t p = p_first; p <= p_last; ++p) {
          items.push_back({i, h, r, r_end, std::max(key_begin, p * kPartition),
                           std::min(key_end, (p + 1) * kPartition), partials_size});
          partials_size += (r_end - r) * group * (head_dim + 2);
        }
      }
    }
  }
  std::vector<float> partials(partials_size);

  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    const int64_t max_slots = kQueryTile * group;  // (row, head) pairs of a tile
    std::vector<float> q_buf(max_slots * head_dim), acc(max_slots * head_dim);
    std::vector<float> k_buf(kKeyChunk * head_dim), v_buf(kKeyChunk * head_dim);
    std::vector<float> run_max(max_slots), run_sum(max_slots), scores(kKeyChunk);

    for (int64_t w = begin; w < end; ++w) {
      const WorkItem& it = items[w];
      const int64_t q_len = qsl[it.req + 1] - qsl[it.req];
      const int64_t first_pos = lens[it.req] - q_len - qsl[it.req];  // + flattened row index
      const int64_t rows = it.row_end - it.row_begin, slots = rows * group;
      // The tile's queries, pre-scaled: q_buf[(r * group + g) * head_dim + d].
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t g = 0; g < group; ++g) {
          const scalar_t* src = q_ptr + (it.row_begin + r) * q_row + (it.kv_head * group + g) * q_head;
          float* dst = &q_buf[(r * group + g) * head_dim];
          for (int64_t i = 0; i < num_vecs; ++i) {
            (load_vec(src + i * Vec::size()) * Vec(scale)).store(dst + i * Vec::size());
          }
        }
      }
      std::fill(acc.begin(), acc.begin() + slots * head_dim, 0.f);
      std::fill(run_max.begin(), run_max.begin() + slots, neg_inf);
      std::fill(run_sum.begin(), run_sum.begin() + slots, 0.f);

      // Keys of this item's partition: [key_begin, key_end); each row's own limits below.
      const int64_t pos_begin = first_pos + it.row_begin;
      const int64_t key_begin = it.part_begin, key_end = it.part_end;
      const int32_t* table = tables + it.req * table_width;
      // Where the row of context position p lies in a cache (the head's offset aside).
      auto key_offset = [&](int64_t p) {
        return table[p / block_size] * c_block + (p % block_size) * c_token;
      };

      for (int64_t base = key_begin / kKeyChunk * kKeyChunk; base < key_end; base += kKeyChunk) {
        const int64_t j_begin = std::max<int64_t>(key_begin - base, 0);
        const int64_t j_end = std::min<int64_t>(key_end - base, kKeyChunk);
        if (base + kKeyChunk < key_end) {
          // The next chunk's rows are anywhere in the pool: ask for them now, so they arrive
          // while this chunk is worked on (the hardware prefetcher cannot guess them).
          const int64_t next_end = std::min<int64_t>(key_end, base + 2 * kKeyChunk);
          for (int64_t p = base + kKeyChunk; p < next_end; ++p) {
            const int64_t at = key_offset(p) + it.kv_head * c_head;
            const char* kr = reinterpret_cast<const char*>(k_ptr + at);
            const char* vr = reinterpret_cast<const char*>(v_ptr + at);
            for (int64_t b = 0; b < row_bytes; b += 64) {
              __builtin_prefetch(kr + b);
              __builtin_prefetch(vr + b);
            }
          }
        }
        // The chunk's K and V rows of this head as floats, once for all the tile's slots: a
        // float cache's rows are read where they lie (a chunk never crosses a block there),
        // others are widened into k_buf / v_buf.
        const float *k_rows = k_buf.data(), *v_rows = v_buf.data();
        int64_t ld = head_dim;
        if (in_place) {
          const int64_t at = key_offset(base) + it.kv_head * c_head;
          k_rows = reinterpret_cast<const float*>(k_ptr + at);
          v_rows = reinterpret_cast<const float*>(v_ptr + at);
          ld = c_token;
        } else {
          for (int64_t j = j_begin; j < j_end; ++j) {
            const int64_t at = key_offset(base + j) + it.kv_head * c_head;
            row_to_float(k_ptr + at, &k_buf[j * head_dim], num_vecs);
            row_to_float(v_ptr + at, &v_buf[j * head_dim], num_vecs);
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          // Row r (position pos) sees keys [lo, hi) of this chunk.
          const int64_t pos = pos_begin + r;
          const int64_t lo = sliding_window > 0
                                 ? std::max<int64_t>(j_begin, pos - sliding_window + 1 - base)
                                 : j_begin;
          const int64_t hi = std::min<int64_t>(j_end, pos + 1 - base);
          if (hi <= lo) continue;
          for (int64_t g = 0; g < group; ++g) {
            const int64_t s = r * group + g;
            attend(&q_buf[s * head_dim], k_rows, v_rows, ld, lo, hi, num_vecs, cap,
                   scores.data(), run_max[s], run_sum[s], &acc[s * head_dim]);
          }
        }
      }
      if (it.partial >= 0) {  // this part's state, merged with the other parts' below
        float* part = &partials[it.partial];
        std::copy(acc.begin(), acc.begin() + slots * head_dim, part);
        std::copy(run_max.begin(), run_max.begin() + slots, part + slots * head_dim);
        std::copy(run_sum.begin(), run_sum.begin() + slots, part + slots * (head_dim + 1));
        continue;
      }
      for (int64_t s = 0; s < slots; ++s) {
        const int64_t r = s / group, g = s % group;
        const float inv = 1.f / run_sum[s];
        scalar_t* dst = o_ptr + (it.row_begin + r) * o_row + (it.kv_head * group + g) * o_head;
        const float* a = &acc[s * head_dim];
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(a[d] * inv);
      }
    }
  });

  // Each split tile: its parts' states merged in partition order (a part a row cannot see has
  // run_sum 0 and adds nothing), then normalised into out.
  at::parallel_for(0, static_cast<int64_t>(splits.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(head_dim);
    for (int64_t t = begin; t < end; ++t) {
      const auto [first, parts] = splits[t];
      const WorkItem& it = items[first];
      const int64_t slots = (it.row_end - it.row_begin) * group;
      for (int64_t s = 0; s < slots; ++s) {
        float m = neg_inf;
        for (int64_t p = 0; p < parts; ++p) {
          const float* part = &partials[items[first + p].partial];
          if (part[slots * (head_dim + 1) + s] > 0.f) m = std::max(m, part[slots * head_dim + s]);
        }
        float sum = 0.f;
        std::fill(merged.begin(), merged.end(), 0.f);
        for (int64_t p = 0; p < parts; ++p) {
          const float* part = &partials[items[first + p].partial];
          const float part_sum = part[slots * (head_dim + 1) + s];
          if (!(part_sum > 0.f)) continue;
          const float w = std::exp(part[slots * head_dim + s] - m);
          sum += part_sum * w;
          const float* a = part + s * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) merged[d] += a[d] * w;
        }
        const int64_t r = s / group, g = s % group;
        const float inv = 1.f / sum;
        scalar_t* dst = o_ptr + (it.row_begin + r) * o_row + (it.kv_head * group + g) * o_head;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(merged[d] * inv);
      }
    }
  });
}

}  // namespace

void paged_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                     int64_t sliding_window, double logits_soft_cap, int64_t skip_prefill_from) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query/out: [T, heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "k/v caches: [num_blocks, block_size, kv_heads, row], one dtype");
  TORCH_CHECK(k_cache.strides() == v_cache.strides(), "k and v caches must share a layout");
  TORCH_CHECK(row_elements(query.size(2), k_cache.scalar_type()) == k_cache.size(3),
              "the cache's rows do not hold the query's head_dim (", query.size(2), ") in ",
              k_cache.scalar_type());
  TORCH_CHECK(query.size(2) % Vec::size() == 0 && query.size(2) <= kMaxHeadVecs * Vec::size(),
              "head_dim must be a multiple of ", Vec::size(), " and at most ",
              kMaxHeadVecs * Vec::size());
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1,
              "head_dim must be contiguous");
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), "query and out must have one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt,
              "block_tables, seq_lens, query_start_loc: int32");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous() &&
                  query_start_loc.is_contiguous(),
              "metadata tensors must be contiguous");
  TORCH_CHECK(query_start_loc.size(0) == seq_lens.size(0) + 1 &&
                  block_tables.size(0) == seq_lens.size(0),
              "one table and length per request");
  auto run = [&](auto query_tag, auto cache_tag) {
    paged_attention_kernel<decltype(query_tag), decltype(cache_tag)>(
        out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
        sliding_window, logits_soft_cap, skip_prefill_from);
  };
  auto with_cache = [&](auto query_tag) {
    switch (k_cache.scalar_type()) {
      case at::kFloat: run(query_tag, float{}); break;
      case at::kBFloat16: run(query_tag, at::BFloat16{}); break;
      case at::kHalf: run(query_tag, at::Half{}); break;
      case at::kChar: run(query_tag, int8_t{}); break;
      case at::kFloat8_e4m3fn: run(query_tag, c10::Float8_e4m3fn{}); break;
      case at::kFloat8_e5m2: run(query_tag, c10::Float8_e5m2{}); break;
      default: TORCH_CHECK(false, "paged_attention: no KV cache of ", k_cache.scalar_type());
    }
  };
  switch (query.scalar_type()) {
    case at::kFloat: with_cache(float{}); break;
    case at::kBFloat16: with_cache(at::BFloat16{}); break;
    case at::kHalf: with_cache(at::Half{}); break;
    default: TORCH_CHECK(false, "paged_attention: float32, bfloat16 or float16, not ", query.scalar_type());
  }
}

}  // namespace pagedllm

void register_norm_rotary(pybind11::module& m);  // norm_rotary.cpp
void register_quant_linear(pybind11::module& m);  // quant_linear.cpp
void register_dense_linear(pybind11::module& m);  // dense_linear.cpp
void register_decoder(pybind11::module& m);  // decoder.cpp
void register_kv_cache(pybind11::module& m);  // kv_cache.cpp
void register_lora(pybind11::module& m);  // lora.cpp
void register_int8_act(pybind11::module& m);  // int8_act_linear.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_norm_rotary(m);
  register_quant_linear(m);
  register_dense_linear(m);
  register_decoder(m);
  register_kv_cache(m);
  register_lora(m);
  register_int8_act(m);
  m.attr("vec_size") = static_cast<int64_t>(pagedllm::Vec::size());  // head_dim must be a multiple
  m.attr("max_head_dim") = static_cast<int64_t>(pagedllm::kMaxHeadVecs * pagedllm::Vec::size());
  // Without the GIL, as torch's own operators run: the server's HTTP thread can work meanwhile.
  m.def("paged_attention", &pagedllm::paged_attention, py::call_guard<py::gil_scoped_release>(),
        "paged attention over the block tables: (out, query, k_cache, v_cache, block_tables, "
        "seq_lens, query_start_loc, scale, sliding_window (0: none), logits_soft_cap (0: none), "
        "skip_prefill_from (0: none; else requests with at least this many query rows are left to "
        "the caller: their rows of out are not written))");
}
