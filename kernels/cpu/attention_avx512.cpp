// The kernel on AVX-512 (16 floats a vector), chosen at run time where the CPU has it.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include <immintrin.h>

#include "attention.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")

namespace genq_cpu {
namespace avx512_isa {

#include "vec_avx512.h"
using Vec = Vec512;


#include "attention_impl.h"

}  // namespace avx512_isa

void attend_avx512(const AttentionArgs& a, const WorkItem& item) { avx512_isa::attend_dispatch(a, item); }

}  // namespace genq_cpu

#pragma GCC pop_options
