// The kernel on AVX2 + FMA (8 floats a vector), chosen at run time where AVX-512 is missing.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include <immintrin.h>

#include "attention.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace genq_cpu {
namespace avx2_isa {

struct Vec {
  static constexpr bool kDotBf16 = false;
  static constexpr int W = 8;
  using T = __m256;
  static T zero() { return _mm256_setzero_ps(); }
  static T set1(float x) { return _mm256_set1_ps(x); }
  static T loadf(const float* p) { return _mm256_loadu_ps(p); }
  static T loadh(const uint16_t* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T max(T a, T b) { return _mm256_max_ps(a, b); }
  static __m128 halves(T v, bool maximum) {
    const __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    return maximum ? _mm_max_ps(lo, hi) : _mm_add_ps(lo, hi);
  }
  static float reduce_add(T v) {
    __m128 x = halves(v, false);
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_shuffle_ps(x, x, 1)));
  }
  static float reduce_max(T v) {
    __m128 x = halves(v, true);
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_shuffle_ps(x, x, 1)));
  }
  static T exp(T x) {  // 2^n * 2^f, f in [-0.5, 0.5] by its Taylor series (degree 7)
    x = _mm256_min_ps(_mm256_max_ps(x, set1(-87.0f)), set1(88.0f));
    const T t = _mm256_mul_ps(x, set1(1.4426950408889634f));
    const T n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const T f = _mm256_sub_ps(t, n);
    T p = set1(1.525273380405984e-05f);
    p = fma(p, f, set1(1.5403530393381606e-04f));
    p = fma(p, f, set1(1.3333558146428443e-03f));
    p = fma(p, f, set1(9.618129107628477e-03f));
    p = fma(p, f, set1(5.550410866482158e-02f));
    p = fma(p, f, set1(2.402265069591007e-01f));
    p = fma(p, f, set1(6.931471805599453e-01f));
    p = fma(p, f, set1(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  }
};

#include "attention_impl.h"

}  // namespace avx2_isa

void attend_avx2(const AttentionArgs& a, const WorkItem& item) { avx2_isa::attend_dispatch(a, item); }

}  // namespace genq_cpu

#pragma GCC pop_options
