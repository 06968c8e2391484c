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
// A chunk against a tile is two small matrix products: its keys are transposed once, so each
// slot's scores come out a vector of keys at a time (no horizontal sums; each score's products
// added in a fixed order, see score_slots), and the weighted V rows are added as outer
// products; several slots share each row loaded.
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
#include "attention_chunk.h"
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

using namespace attention;

constexpr int64_t kQueryTile = 16;
constexpr int64_t kPartition = 512;  // tokens of context per work item at most

struct WorkItem {
  int64_t req, kv_head, row_begin, row_end;  // rows: flattened query indices
  int64_t part_begin, part_end;  // the context positions this item attends to (a partition)
  int64_t partial;  // -1: the whole context, written to out; else its offset in the partials
};

// An attention sink's share of the softmax's sum (gpt-oss): exp(sink - the running max), a
// logit no value goes with; 0 without sinks.
inline float sink_weight(const float* sinks, int64_t head, float run_max) {
  return sinks == nullptr ? 0.f : std::exp(sinks[head] - run_max);
}

template <typename scalar_t, typename cache_t>
void paged_attention_kernel(
    at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    const at::Tensor& query_start_loc, double scale, int64_t sliding_window,
    double logits_soft_cap, int64_t skip_prefill_from, const float* sinks) {
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
  const bool in_place = std::is_same_v<cache_t, float> && block_size % kSegment == 0 &&
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
    // (row, head) pairs of a tile, rounded up to whole groups of kScoreSlots
    const int64_t max_slots = (kQueryTile * group + kScoreSlots - 1) / kScoreSlots * kScoreSlots;
    std::vector<float> qt(max_slots * head_dim), acc(max_slots * head_dim);
    std::vector<float> row(head_dim);
    std::vector<float> k_buf(kKeyChunk * head_dim), v_buf(kKeyChunk * head_dim);
    std::vector<float> kt(head_dim * kKeyChunk), weights(max_slots * kKeyChunk), corr(max_slots);
    std::vector<float> run_max(max_slots), run_sum(max_slots);
    std::vector<int64_t> lo(max_slots), hi(max_slots);

    for (int64_t w = begin; w < end; ++w) {
      const WorkItem& it = items[w];
      const int64_t q_len = qsl[it.req + 1] - qsl[it.req];
      const int64_t first_pos = lens[it.req] - q_len - qsl[it.req];  // + flattened row index
      const int64_t rows = it.row_end - it.row_begin, slots = rows * group;
      // The tile's queries, pre-scaled, interleaved kScoreSlots at a time: slot s = r * group + g
      // at qt[(s / kScoreSlots * head_dim + d) * kScoreSlots + s % kScoreSlots] (a last group's
      // missing slots are zeros).
      std::fill(qt.begin(), qt.end(), 0.f);
      for (int64_t s = 0; s < slots; ++s) {
        const int64_t r = s / group, g = s % group;
        const scalar_t* src = q_ptr + (it.row_begin + r) * q_row + (it.kv_head * group + g) * q_head;
        for (int64_t i = 0; i < num_vecs; ++i) {
          (load_vec(src + i * Vec::size()) * Vec(scale)).store(&row[i * Vec::size()]);
        }
        float* dst = &qt[s / kScoreSlots * head_dim * kScoreSlots + s % kScoreSlots];
        for (int64_t d = 0; d < head_dim; ++d) dst[d * kScoreSlots] = row[d];
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
        // The chunk's K and V rows of this head as floats, once for all the tile's slots, a
        // segment at a time: a float cache's rows are read where they lie, others are widened
        // into k_buf / v_buf. The K rows are transposed into kt. A segment without a key of
        // the item is skipped (its blocks may not exist); its lanes are never used.
        const float* v_rows[kSegments];
        int64_t ld = in_place ? c_token : head_dim;
        for (int64_t g = 0; g < kSegments; ++g) {
          const int64_t g_begin = std::max(j_begin, g * kSegment);
          const int64_t g_end = std::min(j_end, (g + 1) * kSegment);
          v_rows[g] = &v_buf[g * kSegment * head_dim];
          if (g_end <= g_begin) continue;
          const float* k_rows = &k_buf[g * kSegment * head_dim];
          if (in_place) {
            const int64_t at = key_offset(base + g * kSegment) + it.kv_head * c_head;
            k_rows = reinterpret_cast<const float*>(k_ptr + at);
            v_rows[g] = reinterpret_cast<const float*>(v_ptr + at);
          } else {
            for (int64_t j = g_begin; j < g_end; ++j) {
              const int64_t at = key_offset(base + j) + it.kv_head * c_head;
              row_to_float(k_ptr + at, &k_buf[j * head_dim], num_vecs);
              row_to_float(v_ptr + at, &v_buf[j * head_dim], num_vecs);
            }
          }
          transpose_keys(k_rows, ld, head_dim, &kt[g * kSegment]);
        }
        // Row r (position pos) sees keys [lo, hi) of this chunk; so do its group's heads.
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t pos = pos_begin + r;
          const int64_t row_lo = sliding_window > 0
                                     ? std::max<int64_t>(j_begin, pos - sliding_window + 1 - base)
                                     : j_begin;
          const int64_t row_hi = std::min<int64_t>(j_end, pos + 1 - base);
          std::fill(&lo[r * group], &lo[r * group] + group, row_lo);
          std::fill(&hi[r * group], &hi[r * group] + group, row_hi);
        }
        attend(qt.data(), slots, kt.data(), v_rows, ld, lo.data(), hi.data(), num_vecs,
               head_dim, cap, weights.data(), corr.data(), run_max.data(), run_sum.data(), acc.data());
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
        const float inv = 1.f / (run_sum[s] + sink_weight(sinks, it.kv_head * group + g, run_max[s]));
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
        const float inv = 1.f / (sum + sink_weight(sinks, it.kv_head * group + g, m));
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
                     int64_t sliding_window, double logits_soft_cap, int64_t skip_prefill_from,
                     const at::Tensor& sinks) {
  const bool has_sinks = sinks.defined() && sinks.numel() > 0;
  TORCH_CHECK(!has_sinks || (sinks.scalar_type() == at::kFloat && sinks.is_contiguous() &&
                             sinks.numel() == query.size(1)),
              "sinks: float32 [heads], or empty for none");
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
        sliding_window, logits_soft_cap, skip_prefill_from,
        has_sinks ? sinks.data_ptr<float>() : nullptr);
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

void register_paged_attention(pybind11::module& m) {
  m.attr("vec_size") = static_cast<int64_t>(pagedllm::attention::Vec::size());  // head_dim must be a multiple
  m.attr("max_head_dim") = static_cast<int64_t>(pagedllm::attention::kMaxHeadVecs * pagedllm::attention::Vec::size());
  // Without the GIL, as torch's own operators run: the server's HTTP thread can work meanwhile.
  m.def("paged_attention", &pagedllm::paged_attention, py::call_guard<py::gil_scoped_release>(),
        "paged attention over the block tables: (out, query, k_cache, v_cache, block_tables, "
        "seq_lens, query_start_loc, scale, sliding_window (0: none), logits_soft_cap (0: none), "
        "skip_prefill_from (0: none; else requests with at least this many query rows are left to "
        "the caller: their rows of out are not written), sinks (float32 [heads]: each head's "
        "attention sink logit; empty: none))");
}
