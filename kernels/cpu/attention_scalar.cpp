// The kernel in plain C++: the fallback where the CPU has neither AVX2 nor AVX-512, and the
// oracle the vector versions are tested against.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "attention.h"

namespace genq_cpu {
namespace scalar_isa {

struct Vec {
  static constexpr bool kDotBf16 = false;
  static constexpr int W = 1;
  using T = float;
  static T zero() { return 0.0f; }
  static T set1(float x) { return x; }
  static T loadf(const float* p) { return *p; }
  static T loadh(const uint16_t* p) {
    uint32_t u = static_cast<uint32_t>(*p) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
  static void store(float* p, T v) { *p = v; }
  static T fma(T a, T b, T c) { return a * b + c; }
  static T mul(T a, T b) { return a * b; }
  static T add(T a, T b) { return a + b; }
  static T sub(T a, T b) { return a - b; }
  static T max(T a, T b) { return std::max(a, b); }
  static float reduce_add(T v) { return v; }
  static float reduce_max(T v) { return v; }
  static T exp(T x) { return std::exp(x); }
};

#include "attention_impl.h"

}  // namespace scalar_isa

void attend_scalar(const AttentionArgs& a, const WorkItem& item) { scalar_isa::attend_dispatch(a, item); }

}  // namespace genq_cpu
