// genq_cpu's fused small ops on bfloat16 activations, each one pass over memory where torch
// takes several: the residual add with the RMSNorm after it, SiLU(gate) * up, and the rotary
// rotation of q and k heads in place. Each rounds where torch's bf16 arithmetic rounds (the
// sum before the norm, the normalised value before the weight, SiLU before the product, each
// rotary product before their sum), so outputs equal the torch path's but for the norm's sum
// of squares, added in another order. AVX-512 where the CPU has it (chosen at run time), plain
// C++ otherwise.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace genq_cpu {
namespace {

inline float bf16_to_float(uint16_t h) { uint32_t u = static_cast<uint32_t>(h) << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline uint16_t float_to_bf16(float f) {
  uint32_t u; std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

// attention's AVX-512 vector type: its bf16 load and its exp (compiled for AVX-512 alone)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
#include "vec_avx512.h"
#pragma GCC pop_options

AVX512 inline __m512 load_bf16(const uint16_t* p) { return Vec512::loadh(p); }

AVX512 inline __m512i bf16_bits(__m512 f) {  // round to nearest even, as torch's .to(bfloat16); NaN stays NaN
  const __m512i u = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
}
AVX512 inline __m512 round_bf16(__m512 f) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(f), 16)); }
AVX512 inline void store_bf16(uint16_t* p, __m512 f) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(f)));
}
// One row: residual <- bf16(x + residual); x <- bf16(bf16(h / rms(h)) * w), h the new residual.
AVX512 void add_rms_norm_row_avx512(uint16_t* x, uint16_t* res, const uint16_t* w, int64_t H, float eps, float* h) {
  __m512 ss = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= H; i += 16) {
    const __m512 s = round_bf16(_mm512_add_ps(load_bf16(x + i), load_bf16(res + i)));
    store_bf16(res + i, s);
    _mm512_storeu_ps(h + i, s);
    ss = _mm512_fmadd_ps(s, s, ss);
  }
  float sum = _mm512_reduce_add_ps(ss);
  for (; i < H; ++i) {
    const float s = round_bf16(bf16_to_float(x[i]) + bf16_to_float(res[i]));
    res[i] = float_to_bf16(s);
    h[i] = s;
    sum += s * s;
  }
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(H) + eps);
  const __m512 vinv = _mm512_set1_ps(inv);
  for (i = 0; i + 16 <= H; i += 16)
    store_bf16(x + i, _mm512_mul_ps(round_bf16(_mm512_mul_ps(_mm512_loadu_ps(h + i), vinv)), load_bf16(w + i)));
  for (; i < H; ++i) x[i] = float_to_bf16(round_bf16(h[i] * inv) * bf16_to_float(w[i]));
}

void add_rms_norm_row_scalar(uint16_t* x, uint16_t* res, const uint16_t* w, int64_t H, float eps, float* h) {
  float sum = 0.0f;
  for (int64_t i = 0; i < H; ++i) {
    const float s = round_bf16(bf16_to_float(x[i]) + bf16_to_float(res[i]));
    res[i] = float_to_bf16(s);
    h[i] = s;
    sum += s * s;
  }
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(H) + eps);
  for (int64_t i = 0; i < H; ++i) x[i] = float_to_bf16(round_bf16(h[i] * inv) * bf16_to_float(w[i]));
}

// out <- bf16(bf16(silu(g)) * u) for one row of [g | u]
AVX512 void silu_mul_row_avx512(const uint16_t* g, const uint16_t* u, uint16_t* o, int64_t I) {
  int64_t i = 0;
  const __m512 one = _mm512_set1_ps(1.0f);
  for (; i + 16 <= I; i += 16) {
    const __m512 gv = load_bf16(g + i);
    const __m512 s = round_bf16(_mm512_div_ps(gv, _mm512_add_ps(one, Vec512::exp(_mm512_sub_ps(_mm512_setzero_ps(), gv)))));
    store_bf16(o + i, _mm512_mul_ps(s, load_bf16(u + i)));
  }
  for (; i < I; ++i) {
    const float gv = bf16_to_float(g[i]);
    o[i] = float_to_bf16(round_bf16(gv / (1.0f + std::exp(-gv))) * bf16_to_float(u[i]));
  }
}

void silu_mul_row_scalar(const uint16_t* g, const uint16_t* u, uint16_t* o, int64_t I) {
  for (int64_t i = 0; i < I; ++i) {
    const float gv = bf16_to_float(g[i]);
    o[i] = float_to_bf16(round_bf16(gv / (1.0f + std::exp(-gv))) * bf16_to_float(u[i]));
  }
}


// One token's heads rotated in place: x <- bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)),
// rotate_half(x) = [-x2, x1], each product rounded as transformers' bf16 arithmetic rounds it.
AVX512 void rope_token_avx512(uint16_t* x, const uint16_t* cos, const uint16_t* sin, int64_t heads, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    uint16_t* p = x + h * D;
    int64_t i = 0;
    for (; i + 16 <= half; i += 16) {
      const __m512 x1 = load_bf16(p + i), x2 = load_bf16(p + half + i);
      const __m512 c1 = load_bf16(cos + i), c2 = load_bf16(cos + half + i);
      const __m512 s1 = load_bf16(sin + i), s2 = load_bf16(sin + half + i);
      const __m512 neg = _mm512_sub_ps(_mm512_setzero_ps(), x2);
      store_bf16(p + i, _mm512_add_ps(round_bf16(_mm512_mul_ps(x1, c1)), round_bf16(_mm512_mul_ps(neg, s1))));
      store_bf16(p + half + i, _mm512_add_ps(round_bf16(_mm512_mul_ps(x2, c2)), round_bf16(_mm512_mul_ps(x1, s2))));
    }
    for (; i < half; ++i) {
      const float x1 = bf16_to_float(p[i]), x2 = bf16_to_float(p[half + i]);
      p[i] = float_to_bf16(round_bf16(x1 * bf16_to_float(cos[i])) + round_bf16(-x2 * bf16_to_float(sin[i])));
      p[half + i] = float_to_bf16(round_bf16(x2 * bf16_to_float(cos[half + i])) + round_bf16(x1 * bf16_to_float(sin[half + i])));
    }
  }
}

void rope_token_scalar(uint16_t* x, const uint16_t* cos, const uint16_t* sin, int64_t heads, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    uint16_t* p = x + h * D;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = bf16_to_float(p[i]), x2 = bf16_to_float(p[half + i]);
      p[i] = float_to_bf16(round_bf16(x1 * bf16_to_float(cos[i])) + round_bf16(-x2 * bf16_to_float(sin[i])));
      p[half + i] = float_to_bf16(round_bf16(x2 * bf16_to_float(cos[half + i])) + round_bf16(x1 * bf16_to_float(sin[half + i])));
    }
  }
}

bool has_avx512() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }();
  return yes;
}


// isa: 0 picks AVX-512 where the CPU has it; 1 (scalar) forces the plain C++ loops, 3 or 4 AVX-512
// (as attention's numbering, for tests).
bool use_avx512(int64_t isa) {
  TORCH_CHECK(isa >= 0 && isa <= 4, "genq_cpu: isa must be 0 (auto) to 4, got ", isa);
  TORCH_CHECK(isa < 3 || has_avx512(), "genq_cpu: this CPU has no AVX-512");
  return isa == 0 ? has_avx512() : isa >= 3;
}

void check_bf16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16, "genq_cpu: ", name,
              " must be a bfloat16 CPU tensor, got ", t.scalar_type(), " on ", t.device());
}

void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps, int64_t isa) {
  check_bf16(x, "x");
  check_bf16(residual, "residual");
  check_bf16(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && residual.sizes() == x.sizes() && residual.is_contiguous(),
              "genq_cpu.add_rms_norm_: x and residual must be contiguous [T, hidden] of one shape");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H && weight.is_contiguous(), "genq_cpu.add_rms_norm_: weight must be [hidden]");
  auto* xp = reinterpret_cast<uint16_t*>(x.data_ptr());
  auto* rp = reinterpret_cast<uint16_t*>(residual.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  const bool wide = use_avx512(isa);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> h(H);
    for (int64_t t = begin; t < end; ++t) {
      if (wide) add_rms_norm_row_avx512(xp + t * H, rp + t * H, wp, H, e, h.data());
      else add_rms_norm_row_scalar(xp + t * H, rp + t * H, wp, H, e, h.data());
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up, int64_t isa) {
  check_bf16(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.is_contiguous(),
              "genq_cpu.silu_and_mul: gate_up must be a contiguous [T, 2 * intermediate]");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  at::Tensor out = at::empty({T, I}, gate_up.options());
  const auto* g = reinterpret_cast<const uint16_t*>(gate_up.data_ptr());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  const bool wide = use_avx512(isa);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (wide) silu_mul_row_avx512(g + t * 2 * I, g + t * 2 * I + I, o + t * I, I);
      else silu_mul_row_scalar(g + t * 2 * I, g + t * 2 * I + I, o + t * I, I);
    }
  });
  return out;
}

void rope_(at::Tensor& qk, const at::Tensor& cos, const at::Tensor& sin, int64_t isa) {
  check_bf16(qk, "qk");
  check_bf16(cos, "cos");
  check_bf16(sin, "sin");
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1 && qk.stride(1) == qk.size(2) && qk.size(2) % 2 == 0,
              "genq_cpu.rope_: qk must be [T, heads, head_dim], each token's heads contiguous, head_dim even");
  const int64_t T = qk.size(0), heads = qk.size(1), D = qk.size(2), stride = qk.stride(0);
  TORCH_CHECK(cos.numel() == T * D && sin.numel() == T * D && cos.is_contiguous() && sin.is_contiguous(),
              "genq_cpu.rope_: cos and sin must be contiguous, a head_dim row per token");
  auto* x = reinterpret_cast<uint16_t*>(qk.data_ptr());
  const auto* c = reinterpret_cast<const uint16_t*>(cos.data_ptr());
  const auto* s = reinterpret_cast<const uint16_t*>(sin.data_ptr());
  const bool wide = use_avx512(isa);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (wide) rope_token_avx512(x + t * stride, c + t * D, s + t * D, heads, D);
      else rope_token_scalar(x + t * stride, c + t * D, s + t * D, heads, D);
    }
  });
}

}  // namespace
}  // namespace genq_cpu

TORCH_LIBRARY_FRAGMENT(genq_cpu, m) {
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps, int isa=0) -> ()");
  m.def("silu_and_mul(Tensor gate_up, int isa=0) -> Tensor");
  m.def("rope_(Tensor(a!) qk, Tensor cos, Tensor sin, int isa=0) -> ()");
}

TORCH_LIBRARY_IMPL(genq_cpu, CPU, m) {
  m.impl("add_rms_norm_", &genq_cpu::add_rms_norm_);
  m.impl("silu_and_mul", &genq_cpu::silu_and_mul);
  m.impl("rope_", &genq_cpu::rope_);
}
