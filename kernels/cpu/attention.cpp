// genq_cpu::paged_attention: checks its tensors, splits the step into work items (a sequence's
// queries, in tiles, for one KV head), and runs them on torch's threads with the kernel
// version this CPU supports (chosen once, at run time: AVX-512, AVX2, or plain C++).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>
#include <vector>

#include "attention.h"

namespace genq_cpu {
namespace {

constexpr int64_t kRowsPerItem = 64;  // as attention_impl.h: query rows per work item

enum Isa : int64_t { kAuto = 0, kScalar = 1, kAvx2 = 2, kAvx512 = 3, kAvx512Bf16 = 4 };

int64_t best_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    return __builtin_cpu_supports("avx512bf16") ? kAvx512Bf16 : kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
  return kScalar;
}

using Kernel = void (*)(const AttentionArgs&, const WorkItem&);

Kernel kernel_for(int64_t isa) {
  static const int64_t best = best_isa();
  if (isa == kAuto) isa = best;
  TORCH_CHECK(isa >= kScalar && isa <= kAvx512Bf16,
              "genq_cpu: isa must be 0 (auto), 1 (scalar), 2 (avx2), 3 (avx512) or 4 (avx512bf16)");
  TORCH_CHECK(isa <= best, "genq_cpu: this CPU cannot run isa ", isa, " (best: ", best, ")");
  switch (isa) {
    case kAvx512Bf16: return attend_avx512bf16;
    case kAvx512: return attend_avx512;
    case kAvx2: return attend_avx2;
    default: return attend_scalar;
  }
}

std::vector<WorkItem> work_items(const int32_t* query_start, int64_t num_seqs, int64_t num_kv_heads, int64_t group) {
  const int64_t tile = std::max<int64_t>(1, kRowsPerItem / group);
  std::vector<WorkItem> items;
  items.reserve(num_seqs * num_kv_heads);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int32_t q_len = query_start[s + 1] - query_start[s];
    for (int32_t q = 0; q < q_len; q += tile) {
      const int32_t end = static_cast<int32_t>(std::min<int64_t>(q_len, q + tile));
      for (int64_t h = 0; h < num_kv_heads; ++h) items.push_back({static_cast<int32_t>(s), static_cast<int32_t>(h), q, end});
    }
  }
  return items;
}

void check_inputs(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& query_start, const at::Tensor& seq_lens) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "genq_cpu.paged_attention: q must be bfloat16 or float32");
  TORCH_CHECK(out.scalar_type() == dtype && k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype,
              "genq_cpu.paged_attention: out, k_cache and v_cache must have q's dtype");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && q.sizes() == out.sizes(), "genq_cpu.paged_attention: q and out must be [T, heads, head_dim] alike");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "genq_cpu.paged_attention: q and out need a contiguous last dim");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "genq_cpu.paged_attention: caches must be contiguous [blocks, kv_heads, block_size, head_dim]");
  TORCH_CHECK(k_cache.size(3) == q.size(2), "genq_cpu.paged_attention: the cache's head_dim differs from q's");
  const int64_t d = q.size(2);
  TORCH_CHECK(d == 16 || d == 32 || d == 64 || d == 96 || d == 128 || d == 256,
              "genq_cpu.paged_attention: head_dim must be 16, 32, 64, 96, 128 or 256, got ", d);
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "genq_cpu.paged_attention: heads must be a multiple of kv heads");
  for (const auto* t : {&block_tables, &query_start, &seq_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "genq_cpu.paged_attention: tables and lengths must be contiguous int32");
  }
  TORCH_CHECK(block_tables.dim() == 2 && query_start.numel() == seq_lens.numel() + 1 && block_tables.size(0) == seq_lens.numel(),
              "genq_cpu.paged_attention: block_tables [B, width], query_start [B + 1], seq_lens [B]");
}

// What the kernel reads through: each sequence's rows and context, its table entries and its
// rows' visible ends, so that no metadata makes it read outside q or the caches.
void check_metadata(const AttentionArgs& a, int64_t num_tokens, int64_t num_blocks) {
  TORCH_CHECK(a.query_start[0] == 0 && a.query_start[a.num_seqs] == num_tokens,
              "genq_cpu.paged_attention: query_start must run from 0 to q's ", num_tokens, " rows");
  for (int64_t s = 0; s < a.num_seqs; ++s) {
    const int64_t q_len = a.query_start[s + 1] - a.query_start[s], ctx = a.seq_lens[s];
    const int64_t blocks = (ctx + a.block_size - 1) / a.block_size;
    TORCH_CHECK(q_len >= 0 && ctx >= q_len && blocks <= a.table_stride, "genq_cpu.paged_attention: sequence ", s,
                " has ", q_len, " queries and a context of ", ctx, " (its table holds ", a.table_stride, " blocks)");
    const int32_t* table = a.block_tables + s * a.table_stride;
    for (int64_t b = 0; b < blocks; ++b) {
      TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, "genq_cpu.paged_attention: sequence ", s, " names block ",
                  table[b], " of ", num_blocks);
    }
    for (int64_t t = a.query_start[s]; a.until != nullptr && t < a.query_start[s + 1]; ++t) {
      TORCH_CHECK(a.until[t] >= 0 && a.until[t] < ctx, "genq_cpu.paged_attention: attend_until of row ", t,
                  " is past its context of ", ctx);
    }
  }
}

void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& query_start, const at::Tensor& seq_lens,
                     const std::optional<at::Tensor>& attend_until, const std::optional<at::Tensor>& sinks,
                     double scale, int64_t window, int64_t chunk, double softcap, int64_t isa) {
  check_inputs(out, q, k_cache, v_cache, block_tables, query_start, seq_lens);
  if (attend_until) TORCH_CHECK(attend_until->scalar_type() == at::kInt && attend_until->is_contiguous() && attend_until->numel() == q.size(0),
                                "genq_cpu.paged_attention: attend_until must be int32 [T]");
  if (sinks) TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->numel() == q.size(1),
                         "genq_cpu.paged_attention: sinks must be float32 [num_heads]");
  const Kernel kernel = kernel_for(isa);
  AttentionArgs a{};
  a.out = out.data_ptr();
  a.q = q.data_ptr();
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.block_tables = block_tables.data_ptr<int32_t>();
  a.query_start = query_start.data_ptr<int32_t>();
  a.seq_lens = seq_lens.data_ptr<int32_t>();
  a.until = attend_until ? attend_until->data_ptr<int32_t>() : nullptr;
  a.sinks = sinks ? sinks->data_ptr<float>() : nullptr;
  a.num_seqs = seq_lens.numel();
  a.num_heads = q.size(1);
  a.num_kv_heads = k_cache.size(1);
  a.head_dim = q.size(2);
  a.block_size = k_cache.size(2);
  a.table_stride = block_tables.size(1);
  a.q_stride_token = q.stride(0);
  a.q_stride_head = q.stride(1);
  a.out_stride_token = out.stride(0);
  a.out_stride_head = out.stride(1);
  a.cache_stride_block = k_cache.stride(0);
  a.cache_stride_head = k_cache.stride(1);
  a.scale = static_cast<float>(scale);
  a.softcap = static_cast<float>(softcap);
  a.window = window;
  a.chunk = chunk;
  a.bf16 = q.scalar_type() == at::kBFloat16;
  check_metadata(a, q.size(0), k_cache.size(0));
  const std::vector<WorkItem> items = work_items(a.query_start, a.num_seqs, a.num_kv_heads, a.num_heads / a.num_kv_heads);
  const int64_t n = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  // Each thread takes the next item as it finishes one: items differ in cost (context
  // lengths, prefill tiles), and the last ones (a step's prefills, the longest) go first.
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n), 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < n; i = next++) kernel(a, items[n - 1 - i]);
  });
}

// This step's K and V into their cache slots: cache[slot / block_size, h, slot % block_size] =
// x[t, h] for each token t and KV head h, slot = slot_mapping[t]. One call for both caches and
// no copy of k or v (they are views into the qkv projection's output); the bytes move as they
// are, so any dtype the caches share with k and v.
void write_kv_(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
               const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.stride(2) == 1 && v.stride(2) == 1,
              "genq_cpu.write_kv_: k and v must be [T, kv_heads, head_dim] alike, last dim contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
              k_cache.size(1) == k.size(1) && k_cache.size(3) == k.size(2),
              "genq_cpu.write_kv_: caches must be contiguous [blocks, kv_heads, block_size, head_dim] of k's heads and head_dim");
  const auto dtype = k.scalar_type();
  TORCH_CHECK(v.scalar_type() == dtype && k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype,
              "genq_cpu.write_kv_: k, v and both caches must share one dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.dim() == 1 &&
              slot_mapping.numel() == k.size(0), "genq_cpu.write_kv_: slot_mapping must be int64 [T]");
  const int64_t tokens = k.size(0), heads = k.size(1), bytes = k.size(2) * k.element_size(), bs = k_cache.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < k_cache.size(0) * bs, "genq_cpu.write_kv_: token ", t, " names slot ",
                slots[t], " of ", k_cache.size(0) * bs);
  }
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t es = k.element_size();
  const auto copy = [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = slots[t] / bs, offset = slots[t] % bs;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t row = ((block * heads + h) * bs + offset) * bytes;
        std::memcpy(kc + row, kp + (t * k.stride(0) + h * k.stride(1)) * es, bytes);
        std::memcpy(vc + row, vp + (t * v.stride(0) + h * v.stride(1)) * es, bytes);
      }
    }
  };
  // a step's decodes are a few hundred rows: a thread team would cost more than the copy
  if (tokens * heads * bytes < (1 << 20)) copy(0, tokens);
  else at::parallel_for(0, tokens, 64, copy);
}

}  // namespace

TORCH_LIBRARY(genq_cpu, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor query_start, Tensor seq_lens, Tensor? attend_until, Tensor? sinks, float scale, int window, "
        "int chunk, float softcap, int isa) -> ()");
  m.def("write_kv_(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(genq_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("write_kv_", &write_kv_);
}

}  // namespace genq_cpu
