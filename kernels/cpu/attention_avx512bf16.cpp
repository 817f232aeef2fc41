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

inline uint16_t to_bf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

struct Vec : Vec512 {
  static constexpr bool kDotBf16 = true;

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

  // scores[r][t] = scale * q_r . k_t for keys t < n, 16 at a time (past n: garbage, overwritten)
  template <int D>
  static void scores_bf16(const uint16_t* q, const uint16_t* k, int64_t n, int64_t rows, float* scores, int64_t pad,
                          float scale) {
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
        _mm512_storeu_ps(scores + r * pad + t0, _mm512_mul_ps(hsum16(part), scaled));
      }
    }
  }

  // acc[r] += sum_t p[r][t] * v_t, keys in pairs: each 32-bit lane a (v_t, v_t+1) pair of one
  // of head_dim's positions, so the accumulator's lanes come in unpack order (acc_lane)
  template <int D>
  static void values_bf16(const uint16_t* v, int64_t n, int64_t rows, const float* scores, int64_t pad, float* acc,
                          const char* seen) {
    constexpr int NV = D / 32;  // vectors of 32 bf16 in a row of V
    for (int64_t t = 0; t < n; t += 2) {
      __m512i pairs[2 * NV];
      for (int j = 0; j < NV; ++j) {
        const __m512i a = _mm512_loadu_si512(v + t * D + j * 32);
        const __m512i b = t + 1 < n ? _mm512_loadu_si512(v + (t + 1) * D + j * 32) : _mm512_setzero_si512();
        pairs[2 * j] = _mm512_unpacklo_epi16(a, b);
        pairs[2 * j + 1] = _mm512_unpackhi_epi16(a, b);
      }
      for (int64_t r = 0; r < rows; ++r) {
        if (!seen[r]) continue;
        const float p1 = t + 1 < n ? scores[r * pad + t + 1] : 0.0f;
        const uint32_t both = static_cast<uint32_t>(to_bf16(scores[r * pad + t])) | (static_cast<uint32_t>(to_bf16(p1)) << 16);
        const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(both));
        float* row = acc + r * D;
        for (int j = 0; j < 2 * NV; ++j) _mm512_storeu_ps(row + j * 16, _mm512_dpbf16_ps(_mm512_loadu_ps(row + j * 16), p, (__m512bh)pairs[j]));
      }
    }
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
