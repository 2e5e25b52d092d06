// engine/runtime.h: the OPENBLAS_CORETYPE rule. CPUID only and no LibTorch,
// so that a program without LibTorch can print it (tests/openblas_core_main.cpp,
// which the test suite runs once to set the variable for every test).
#include "engine/runtime.h"

namespace dmi::engine {

const char* openblas_coretype_for_cpu() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
    return "SkylakeX";
  if (__builtin_cpu_supports("avx2")) return "Haswell";
  return nullptr;
}

}  // namespace dmi::engine
