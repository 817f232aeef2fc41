// AVX-512's vector type for attention_impl.h (16 floats a vector), included inside the
// namespace and under the #pragma GCC target of the files that use it.

struct Vec512 {
  static constexpr bool kDotBf16 = false;
  static constexpr int W = 16;
  using T = __m512;
  static T zero() { return _mm512_setzero_ps(); }
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T loadf(const float* p) { return _mm512_loadu_ps(p); }
  static T loadh(const uint16_t* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T max(T a, T b) { return _mm512_max_ps(a, b); }
  static float reduce_add(T v) { return _mm512_reduce_add_ps(v); }
  static float reduce_max(T v) { return _mm512_reduce_max_ps(v); }
  static T exp(T x) {  // 2^n * 2^f, f in [-0.5, 0.5] by its Taylor series (degree 7)
    x = _mm512_max_ps(x, set1(-87.0f));
    const T t = _mm512_mul_ps(x, set1(1.4426950408889634f));
    const T n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const T f = _mm512_sub_ps(t, n);
    T p = set1(1.525273380405984e-05f);
    p = fma(p, f, set1(1.5403530393381606e-04f));
    p = fma(p, f, set1(1.3333558146428443e-03f));
    p = fma(p, f, set1(9.618129107628477e-03f));
    p = fma(p, f, set1(5.550410866482158e-02f));
    p = fma(p, f, set1(2.402265069591007e-01f));
    p = fma(p, f, set1(6.931471805599453e-01f));
    p = fma(p, f, set1(1.0f));
    return _mm512_scalef_ps(p, n);
  }
};
