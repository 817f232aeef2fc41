// The kernel on AVX-512 with AVX-512-BF16: bf16 caches take dot products of bf16 pairs
// (vdpbf16ps), no widening of keys or values to float32; float32 caches run as on AVX-512.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include <immintrin.h>

#include "attention.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")

namespace genq_cpu {
namespace avx512bf16_isa {

#include "vec_avx512.h"

struct Vec : Vec512 {
  static constexpr bool kDotBf16 = true;
  // rows at which scores transpose each 16 keys (a prompt's tile) rather than reduce each dot
  // product across lanes (a decode's few query heads: the transpose would cost what it saves)
  static constexpr int64_t kManyRows = 8;

  // lane i of the result: the sum of v[i]'s lanes
  static __m512 hsum16(const __m512* v) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; ++i) t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
      u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    }
    const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(3, 1, 3, 1)));
  }

  // out[j] lane t = in[t] lane j, for 16 x 16 32-bit words: pairs of rows interleaved, then
  // quads, then the 128-bit lanes moved across (4 x 4)
  static void transpose16(const __m512i* in, __m512i* out) {
    __m512i t[16], v[4][4];
    for (int p = 0; p < 8; ++p) {
      t[2 * p] = _mm512_unpacklo_epi32(in[2 * p], in[2 * p + 1]);
      t[2 * p + 1] = _mm512_unpackhi_epi32(in[2 * p], in[2 * p + 1]);
    }
    for (int g = 0; g < 4; ++g) {  // v[g][c], 128-bit lane L: rows 4g..4g+3 of column 4L + c
      v[g][0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
      v[g][1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
      v[g][2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
      v[g][3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    for (int c = 0; c < 4; ++c) {
      const __m512i x0 = _mm512_shuffle_i32x4(v[0][c], v[1][c], 0x44), x1 = _mm512_shuffle_i32x4(v[0][c], v[1][c], 0xEE);
      const __m512i x2 = _mm512_shuffle_i32x4(v[2][c], v[3][c], 0x44), x3 = _mm512_shuffle_i32x4(v[2][c], v[3][c], 0xEE);
      out[c] = _mm512_shuffle_i32x4(x0, x2, 0x88);
      out[4 + c] = _mm512_shuffle_i32x4(x0, x2, 0xDD);
      out[8 + c] = _mm512_shuffle_i32x4(x1, x3, 0x88);
      out[12 + c] = _mm512_shuffle_i32x4(x1, x3, 0xDD);
    }
  }

  // R rows' scores over 16 keys from the keys transposed (kt[i] lane t: key t's bf16 pair i):
  // each pair of the query broadcast, no reduction across lanes
  template <int NW, int R>
  static void score_rows_t(const uint32_t* qw, const __m512i* kt, float* out, int64_t stride, __m512 scaled) {
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int i = 0; i < NW; i += 2) {
      for (int r = 0; r < R; ++r) {
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)kt[i], (__m512bh)_mm512_set1_epi32(static_cast<int>(qw[r * NW + i])));
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)kt[i + 1], (__m512bh)_mm512_set1_epi32(static_cast<int>(qw[r * NW + i + 1])));
      }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * stride, _mm512_mul_ps(_mm512_add_ps(acc[r][0], acc[r][1]), scaled));
  }

  // Many rows (prompt tiles): each 16 keys transposed once, so that a row's scores need no
  // reduction across lanes (hsum16: about as many instructions as its dot products)
  template <int D>
  static void scores_bf16_many(const uint16_t* q, const uint16_t* k, int64_t n, int64_t rows, float* scores,
                               int64_t stride, float scale) {
    constexpr int NW = D / 2;  // a row's bf16 pairs
    __m512i kt[NW];
    const __m512 scaled = _mm512_set1_ps(scale);
    const uint32_t* qw = reinterpret_cast<const uint32_t*>(q);
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
      const int64_t m = std::min<int64_t>(16, n - t0);  // (keys past n are not read: zeros)
      for (int c = 0; c < NW / 16; ++c) {
        __m512i in[16];
        for (int t = 0; t < 16; ++t) in[t] = t < m ? _mm512_loadu_si512(k + (t0 + t) * D + c * 32) : _mm512_setzero_si512();
        transpose16(in, &kt[c * 16]);
      }
      int64_t r = 0;
      for (; r + 4 <= rows; r += 4) score_rows_t<NW, 4>(qw + r * NW, kt, scores + r * stride + t0, stride, scaled);
      for (; r < rows; ++r) score_rows_t<NW, 1>(qw + r * NW, kt, scores + r * stride + t0, stride, scaled);
    }
  }

  // scores[r * stride + t] = scale * q_r . k_t for keys t < n, 16 at a time (past n up to the
  // next 16: garbage, overwritten)
  template <int D>
  static void scores_bf16(const uint16_t* q, const uint16_t* k, int64_t n, int64_t rows, float* scores, int64_t stride,
                          float scale) {
    if (rows >= kManyRows) return scores_bf16_many<D>(q, k, n, rows, scores, stride, scale);
    constexpr int NK = D / 32;
    const __m512 scaled = _mm512_set1_ps(scale);
    for (int64_t r = 0; r < rows; ++r) {
      __m512i qr[NK];
      for (int v = 0; v < NK; ++v) qr[v] = _mm512_loadu_si512(q + r * D + v * 32);
      for (int64_t t0 = 0; t0 < n; t0 += 16) {
        __m512 part[16];
        for (int t = 0; t < 16; ++t) {
          __m512 sum = _mm512_setzero_ps();
          if (t0 + t < n) {
            const uint16_t* key = k + (t0 + t) * D;
            for (int v = 0; v < NK; ++v) sum = _mm512_dpbf16_ps(sum, (__m512bh)qr[v], (__m512bh)_mm512_loadu_si512(key + v * 32));
          }
          part[t] = sum;
        }
        _mm512_storeu_ps(scores + r * stride + t0, _mm512_mul_ps(hsum16(part), scaled));
      }
    }
  }

  // acc[r] += sum_t p[r][t] * v_t, keys in pairs: each 32-bit lane a (v_t, v_t+1) pair of one
  // of head_dim's positions, so the accumulator's lanes come in unpack order (acc_lane). The
  // probabilities go to bf16 a row at a time (vcvtneps2bf16, round to nearest even), a row the
  // block hides taking zeros; the rows then run in groups whose accumulators stay in registers
  // over the whole block (R rows x D / 16 vectors: at most 16 of the 32).
  template <int D>
  static void values_bf16(const uint16_t* v, int64_t n, int64_t rows, const float* scores, int64_t pad, int64_t stride,
                          float* acc, const char* seen) {
    static thread_local std::vector<uint16_t> probs;
    if (static_cast<int64_t>(probs.size()) < rows * pad) probs.resize(rows * pad);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t t = 0; t < pad; t += 16) {
        const __m256i p = seen[r] ? (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(scores + r * stride + t)) : _mm256_setzero_si256();
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs.data() + r * pad + t), p);
      }
    }
    constexpr int R = D >= 256 ? 1 : 256 / D;  // rows a group keeps in registers
    const uint32_t* pairs = reinterpret_cast<const uint32_t*>(probs.data());
    const int64_t words = pad / 2;  // a row's pairs
    int64_t r = 0;
    for (; r + R <= rows; r += R) value_rows<D, R>(v, n, pairs + r * words, words, acc + r * D);
    switch (rows - r) {  // the last, smaller group
#define GENQ_VALUE_ROWS(K) \
  case K: if constexpr (K < R) value_rows<D, K>(v, n, pairs + r * words, words, acc + r * D); break;
      GENQ_VALUE_ROWS(1) GENQ_VALUE_ROWS(2) GENQ_VALUE_ROWS(3) GENQ_VALUE_ROWS(4)
      GENQ_VALUE_ROWS(5) GENQ_VALUE_ROWS(6) GENQ_VALUE_ROWS(7)
#undef GENQ_VALUE_ROWS
      default: break;
    }
  }

  // R rows' accumulators += their probabilities (bf16 pairs, `stride` words a row) x the block's
  // first n values
  template <int D, int R>
  static void value_rows(const uint16_t* v, int64_t n, const uint32_t* pairs, int64_t stride, float* acc) {
    constexpr int NV = D / 32, NA = D / 16;
    __m512 sum[R][NA];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NA; ++j) sum[r][j] = _mm512_loadu_ps(acc + r * D + j * 16);
    for (int64_t t = 0; t < n; t += 2) {
      __m512bh p[R];
      for (int r = 0; r < R; ++r) p[r] = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[r * stride + t / 2]));
      const bool odd = t + 1 == n;  // the block's last key has no partner: its pair takes zeros
      for (int j = 0; j < NV; ++j) {
        const __m512i a = _mm512_loadu_si512(v + t * D + j * 32);
        const __m512i b = odd ? _mm512_setzero_si512() : _mm512_loadu_si512(v + (t + 1) * D + j * 32);
        const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b), hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
        for (int r = 0; r < R; ++r) {
          sum[r][2 * j] = _mm512_dpbf16_ps(sum[r][2 * j], p[r], lo);
          sum[r][2 * j + 1] = _mm512_dpbf16_ps(sum[r][2 * j + 1], p[r], hi);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NA; ++j) _mm512_storeu_ps(acc + r * D + j * 16, sum[r][j]);
  }

  // where head_dim's position d sits in the accumulator values_bf16 writes
  static int acc_lane(int d) {
    const int v = d / 32, c = (d % 32) / 8, h = (d % 8) / 4, j = d % 4;
    return v * 32 + h * 16 + c * 4 + j;
  }
};

#include "attention_impl.h"

}  // namespace avx512bf16_isa

void attend_avx512bf16(const AttentionArgs& a, const WorkItem& item) { avx512bf16_isa::attend_dispatch(a, item); }

}  // namespace genq_cpu

#pragma GCC pop_options
