// Paged attention on the CPU: what the dispatcher (attention.cpp) hands each instruction-set
// version of the kernel (attention_avx512bf16.cpp, attention_avx512.cpp, attention_avx2.cpp,
// attention_scalar.cpp).
#pragma once

#include <cstdint>

namespace genq_cpu {

struct AttentionArgs {
  void* out;                    // [T, num_heads, head_dim], q's dtype
  const void* q;                // [T, num_heads, head_dim] (last dim contiguous)
  const void* k_cache;          // [num_blocks, num_kv_heads, block_size, head_dim]
  const void* v_cache;
  const int32_t* block_tables;  // [num_seqs, table_stride]
  const int32_t* query_start;   // [num_seqs + 1]: the flat batch's rows of each sequence
  const int32_t* seq_lens;      // [num_seqs]: context including this step's tokens
  const int32_t* until;         // [T] or null: each row's last visible position
  const float* sinks;           // [num_heads] or null
  int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size, table_stride;
  int64_t q_stride_token, q_stride_head, out_stride_token, out_stride_head;
  int64_t cache_stride_block, cache_stride_head;
  float scale, softcap;  // softcap 0: none
  int64_t window, chunk;  // 0: none
  bool bf16;              // else float32 (q, out and caches alike)
};

// One work item: a sequence's queries [q_begin, q_end) for one KV head (all its query heads).
struct WorkItem {
  int32_t seq, kv_head, q_begin, q_end;
};

void attend_scalar(const AttentionArgs& a, const WorkItem& item);
void attend_avx2(const AttentionArgs& a, const WorkItem& item);
void attend_avx512(const AttentionArgs& a, const WorkItem& item);
void attend_avx512bf16(const AttentionArgs& a, const WorkItem& item);

}  // namespace genq_cpu
