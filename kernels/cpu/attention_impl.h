// The paged attention kernel, written once over a vector type V and included by each
// instruction-set file inside its own namespace, after its `#pragma GCC target`: every
// function here is compiled for that file's instructions and no other.
//
// A work item is one sequence's queries (or a tile of them) for one KV head: the rows are
// (query head of the group, query), so each K/V row read from a cache block serves all of
// them. Blocks are read in place through the block table; softmax is online in float32
// (running max m, sum l, accumulator acc per row), over tiles of kTileKeys keys: blocks smaller
// than that go several to a tile, so the softmax's reductions and the accumulator's rescale
// come once a tile, not once a block.
//
// V provides: W (lanes), T, zero(), set1(f), loadf(const float*), loadh(const uint16_t*)
// (bf16 widened), store(float*, T), fma(a, b, c) = a * b + c, mul, sub, reduce_add,
// reduce_max, exp (accurate to a few float ulps for x <= 0; -inf gives ~0); kDotBf16: where
// true, bf16 caches take V's own scores_bf16 / values_bf16 (AVX-512-BF16's dot products of
// bf16 pairs), whose accumulator keeps head_dim's lanes in the order acc_lane gives.

constexpr int64_t kRowsPerItem = 64;  // query rows a work item keeps (its tile of queries x group)
constexpr int64_t kTileKeys = 64;     // keys one softmax pass covers (a block or several)

inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch's .to(bfloat16)
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

template <class V, bool BF16>
inline typename V::T load_elems(const void* base, int64_t index) {
  if constexpr (BF16) {
    return V::loadh(static_cast<const uint16_t*>(base) + index);
  } else {
    return V::loadf(static_cast<const float*>(base) + index);
  }
}

struct Scratch {  // a thread's buffers, kept across work items
  std::vector<float> q, acc, scores, m, l;
  std::vector<uint16_t> q_bf16;  // the rows' queries as given (V's bf16 dot products take them)
  std::vector<int64_t> first, last;
  std::vector<char> seen;  // the rows a block's keys are visible to
  void fit(int64_t rows, int64_t head_dim, int64_t block_pad) {
    if (static_cast<int64_t>(m.size()) >= rows && static_cast<int64_t>(q.size()) >= rows * head_dim &&
        static_cast<int64_t>(scores.size()) >= rows * block_pad) return;
    q.resize(rows * head_dim);
    q_bf16.resize(rows * head_dim);
    acc.resize(rows * head_dim);
    scores.resize(rows * block_pad);
    m.resize(rows);
    l.resize(rows);
    first.resize(rows);
    last.resize(rows);
    seen.resize(rows);
  }
};

// Rows' scaled queries, their visible ranges, and a fresh softmax state.
template <class V, bool BF16, int D>
void start_rows(const AttentionArgs& a, const WorkItem& it, Scratch& s, int64_t group, int64_t nq) {
  const int64_t q0 = a.query_start[it.seq];
  const int64_t start = a.seq_lens[it.seq] - (a.query_start[it.seq + 1] - q0);
  const auto scale = V::set1(a.scale);
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t j = 0; j < nq; ++j) {
      const int64_t r = g * nq + j, token = q0 + it.q_begin + j, head = it.kv_head * group + g;
      const int64_t base = token * a.q_stride_token + head * a.q_stride_head;
      if constexpr (BF16 && V::kDotBf16 && D % 32 == 0) {  // scaled with the scores instead
        std::memcpy(&s.q_bf16[r * D], static_cast<const uint16_t*>(a.q) + base, D * sizeof(uint16_t));
      } else {
        for (int v = 0; v < D; v += V::W) V::store(&s.q[r * D + v], V::mul(load_elems<V, BF16>(a.q, base + v), scale));
      }
      const int64_t pos = start + it.q_begin + j;
      s.last[r] = a.until != nullptr ? a.until[token] : pos;
      int64_t first = 0;
      if (a.window > 0) first = std::max<int64_t>(pos - a.window + 1, 0);
      else if (a.chunk > 0) first = pos / a.chunk * a.chunk;
      s.first[r] = first;
      s.m[r] = -INFINITY;
      s.l[r] = 0.0f;
      std::fill(&s.acc[r * D], &s.acc[r * D] + D, 0.0f);
    }
  }
}

// scores[r * stride + t] = q_r . k_t for the block's first n keys, -inf past them up to pad.
template <class V, bool BF16, int D>
void block_scores(const void* k, int64_t k_base, int64_t n, int64_t rows, int64_t pad, int64_t stride, float* scores,
                  const Scratch& s, float scale) {
  using T = typename V::T;
  constexpr int NV = D / V::W;
  if constexpr (BF16 && V::kDotBf16 && D % 32 == 0) {
    V::template scores_bf16<D>(s.q_bf16.data(), static_cast<const uint16_t*>(k) + k_base, n, rows, scores, stride, scale);
  } else {
    for (int64_t t = 0; t < n; ++t) {
      T key[NV];
      for (int v = 0; v < NV; ++v) key[v] = load_elems<V, BF16>(k, k_base + t * D + v * V::W);
      for (int64_t r = 0; r < rows; ++r) {
        const float* q = &s.q[r * D];
        T sum = V::mul(V::loadf(q), key[0]);
        for (int v = 1; v < NV; ++v) sum = V::fma(V::loadf(q + v * V::W), key[v], sum);
        scores[r * stride + t] = V::reduce_add(sum);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) std::fill(&scores[r * stride + n], &scores[r * stride + pad], -INFINITY);
}

// Row r's scores over a tile of blocks (each `pad` wide, the first at key0, `n_last` keys in the
// last, all full before it) become its probabilities under the running max; rescales its sum
// and accumulator. Returns false where the row sees none of these keys (all its p are 0).
template <class V, int D>
bool tile_softmax(const AttentionArgs& a, Scratch& s, int64_t r, int64_t key0, int64_t blocks, int64_t n_last,
                  int64_t pad, int64_t stride) {
  using T = typename V::T;
  float* row = &s.scores[r * stride];
  const int64_t bs = a.block_size;
  for (int64_t j = 0; j < blocks; ++j) {
    float* sc = row + j * pad;
    const int64_t n = j + 1 < blocks ? bs : n_last, at = key0 + j * bs;
    if (a.softcap > 0.0f) {
      for (int64_t t = 0; t < n; ++t) sc[t] = a.softcap * std::tanh(sc[t] / a.softcap);
    }
    const int64_t lo = s.first[r] - at, hi = s.last[r] - at;  // visible: lo <= t <= hi
    for (int64_t t = 0; t < std::min(lo, n); ++t) sc[t] = -INFINITY;
    for (int64_t t = std::max<int64_t>(hi + 1, 0); t < n; ++t) sc[t] = -INFINITY;
  }
  const int64_t width = blocks * pad;
  T best = V::loadf(row);
  for (int64_t t = V::W; t < width; t += V::W) best = V::max(best, V::loadf(row + t));
  const float m_new = std::max(s.m[r], V::reduce_max(best));
  if (m_new == -INFINITY) return false;
  const float alpha = std::exp(s.m[r] - m_new);
  const T shift = V::set1(m_new);
  T sum = V::zero();
  for (int64_t t = 0; t < width; t += V::W) {
    const T p = V::exp(V::sub(V::loadf(row + t), shift));
    V::store(row + t, p);
    sum = V::add(sum, p);
  }
  s.l[r] = s.l[r] * alpha + V::reduce_add(sum);
  s.m[r] = m_new;
  if (alpha != 1.0f) {
    const T scale = V::set1(alpha);
    for (int v = 0; v < D; v += V::W) V::store(&s.acc[r * D + v], V::mul(V::loadf(&s.acc[r * D + v]), scale));
  }
  return true;
}

// acc[r] += sum_t p[r][t] * v_t over the block's first n values (p[r][t] at scores[r * stride + t];
// the block's probabilities are `pad` wide)
template <class V, bool BF16, int D>
void block_values(const void* vc, int64_t v_base, int64_t n, int64_t rows, int64_t pad, int64_t stride,
                  const float* scores, Scratch& s, const char* seen) {
  using T = typename V::T;
  constexpr int NV = D / V::W;
  if constexpr (BF16 && V::kDotBf16 && D % 32 == 0) {
    V::template values_bf16<D>(static_cast<const uint16_t*>(vc) + v_base, n, rows, scores, pad, stride, s.acc.data(), seen);
    return;
  }
  for (int64_t t = 0; t < n; ++t) {
    T value[NV];
    for (int v = 0; v < NV; ++v) value[v] = load_elems<V, BF16>(vc, v_base + t * D + v * V::W);
    for (int64_t r = 0; r < rows; ++r) {
      if (!seen[r]) continue;
      const T p = V::set1(scores[r * stride + t]);
      float* acc = &s.acc[r * D];
      for (int v = 0; v < NV; ++v) V::store(acc + v * V::W, V::fma(p, value[v], V::loadf(acc + v * V::W)));
    }
  }
}

template <class V, bool BF16, int D>
void finish_rows(const AttentionArgs& a, const WorkItem& it, Scratch& s, int64_t group, int64_t nq) {
  const int64_t q0 = a.query_start[it.seq];
  for (int64_t r = 0; r < group * nq; ++r) {
    const int64_t g = r / nq, j = r % nq, head = it.kv_head * group + g, token = q0 + it.q_begin + j;
    float m = s.m[r], l = s.l[r], keep = 1.0f;
    if (a.sinks != nullptr) {  // the sink's logit joins the softmax's denominator
      const float sink = a.sinks[head], m_new = std::max(m, sink);
      keep = std::exp(m - m_new);
      l = l * keep + std::exp(sink - m_new);
    }
    const float factor = l > 0.0f ? keep / l : 0.0f;
    const int64_t base = token * a.out_stride_token + head * a.out_stride_head;
    const float* acc = &s.acc[r * D];
    if constexpr (BF16 && V::kDotBf16 && D % 32 == 0) {  // the accumulator's lanes in V's order
      uint16_t* out = static_cast<uint16_t*>(a.out) + base;
      for (int d = 0; d < D; ++d) out[d] = float_to_bf16(acc[V::acc_lane(d)] * factor);
    } else if constexpr (BF16) {
      uint16_t* out = static_cast<uint16_t*>(a.out) + base;
      for (int d = 0; d < D; ++d) out[d] = float_to_bf16(acc[d] * factor);
    } else {
      float* out = static_cast<float*>(a.out) + base;
      for (int d = 0; d < D; ++d) out[d] = acc[d] * factor;
    }
  }
}

template <class V, bool BF16, int D>
void attend_item(const AttentionArgs& a, const WorkItem& it) {
  static thread_local Scratch s;
  const int64_t group = a.num_heads / a.num_kv_heads, nq = it.q_end - it.q_begin, rows = group * nq;
  const int64_t bs = a.block_size, pad = (bs + 15) / 16 * 16;
  const int64_t per_tile = std::max<int64_t>(1, kTileKeys / bs), stride = per_tile * pad;  // a row's scores
  s.fit(rows, D, stride);
  start_rows<V, BF16, D>(a, it, s, group, nq);
  int64_t lo = s.first[0], hi = s.last[0];
  for (int64_t r = 1; r < rows; ++r) {
    lo = std::min(lo, s.first[r]);
    hi = std::max(hi, s.last[r]);
  }
  hi = std::min<int64_t>(hi, a.seq_lens[it.seq] - 1);
  const int32_t* table = a.block_tables + it.seq * a.table_stride;
  const int64_t elem = BF16 ? 2 : 4, tile_bytes = bs * D * elem;  // a KV head's block: contiguous
  const auto base_of = [&](int64_t b) { return table[b] * a.cache_stride_block + it.kv_head * a.cache_stride_head; };
  for (int64_t b0 = lo / bs; b0 <= hi / bs; b0 += per_tile) {
    const int64_t blocks = std::min(per_tile, hi / bs + 1 - b0), n_last = std::min(bs, hi + 1 - (b0 + blocks - 1) * bs);
    for (int64_t j = 0; j < blocks; ++j) {
      const int64_t b = b0 + j;
      // The blocks are scattered over the pool, so the hardware prefetcher starts afresh at
      // each: the next block's K and V are fetched into L1 while this one is computed, and the
      // one after into L2. One core keeps few misses to L1 in flight (about 12 GB/s here with
      // the first alone); the L2's own queue lifts that to 14-16 (python benchmarks/cpu_attention.py).
      for (int64_t ahead = 1; ahead <= 2 && b + ahead <= hi / bs; ++ahead) {
        const char* k_next = static_cast<const char*>(a.k_cache) + base_of(b + ahead) * elem;
        const char* v_next = static_cast<const char*>(a.v_cache) + base_of(b + ahead) * elem;
        for (int64_t at = 0; at < tile_bytes; at += 64) {
          if (ahead == 1) {
            __builtin_prefetch(k_next + at, 0, 3);
            __builtin_prefetch(v_next + at, 0, 3);
          } else {
            __builtin_prefetch(k_next + at, 0, 1);
            __builtin_prefetch(v_next + at, 0, 1);
          }
        }
      }
      block_scores<V, BF16, D>(a.k_cache, base_of(b), j + 1 < blocks ? bs : n_last, rows, pad, stride,
                               &s.scores[j * pad], s, a.scale);
    }
    bool any = false;
    for (int64_t r = 0; r < rows; ++r) {
      any |= (s.seen[r] = tile_softmax<V, D>(a, s, r, b0 * bs, blocks, n_last, pad, stride));
    }
    if (!any) continue;
    for (int64_t j = 0; j < blocks; ++j) {
      block_values<V, BF16, D>(a.v_cache, base_of(b0 + j), j + 1 < blocks ? bs : n_last, rows, pad, stride,
                               &s.scores[j * pad], s, s.seen.data());
    }
  }
  finish_rows<V, BF16, D>(a, it, s, group, nq);
}

inline void attend_dispatch(const AttentionArgs& a, const WorkItem& it) {
  switch (a.head_dim * 2 + (a.bf16 ? 1 : 0)) {
#define GENQ_HEAD_DIM(D)                                      \
  case D * 2 + 1: return attend_item<Vec, true, D>(a, it); \
  case D * 2: return attend_item<Vec, false, D>(a, it);
    GENQ_HEAD_DIM(16)
    GENQ_HEAD_DIM(32)
    GENQ_HEAD_DIM(64)
    GENQ_HEAD_DIM(96)
    GENQ_HEAD_DIM(128)
    GENQ_HEAD_DIM(256)
#undef GENQ_HEAD_DIM
    default: return;  // the dispatcher admits only these head sizes
  }
}
