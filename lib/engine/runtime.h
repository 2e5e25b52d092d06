// Process-wide runtime set-up: who owns the CPU threads.
//
// Two pools can run dmi's math: torch's OpenMP pool (dmi's kernels, ATen's
// elementwise ops, oneDNN's bfloat16 matmuls) and OpenBLAS's pthreads (ATen's
// float32 GEMM). On a 2-core machine they busy-wait against each other. dmi
// decides by who runs the projections:
//   * dmi's kernels (HF models, any dtype): OpenMP owns the cores and spins
//     between regions. float32 with sleeping OpenMP threads had ~8 % of a
//     decode profile in the kernel's scheduler (wake-ups), and TPOT was 12-20 %
//     longer at batch 1 and 8 (docs/benchmarks.md, 2026-12-02 Intel);
//   * ATen at float32 (TorchScript models, or DMI_KERNELS=aten): OpenMP
//     threads sleep when idle (OMP_WAIT_POLICY=PASSIVE) so that OpenBLAS's
//     GEMM threads get the cores (float32 prefill was 2x faster so);
//   * ATen at bfloat16: oneDNN runs on the OpenMP pool, which spins.
// OpenBLAS also gets OPENBLAS_CORETYPE for this CPU (Debian's 0.3.21 does not
// recognise it and would pick generic kernels). Both libraries read these
// variables when they load, before main(), so prepare_process_env()
// re-executes the program once with them set, if it set any. Variables the
// user set win, and DMI_ENV_READY (set by that restart, or by the user)
// prevents it. A restart loads LibTorch's ~290 libraries again (~0.7 s on a
// 2-core VM, ~1.6 s under ASan): scripts that start dmi-run many times can
// export OPENBLAS_CORETYPE themselves (the test suite does: tests/CMakeLists.txt).
#pragma once

#include <string>

namespace dmi::engine {

enum class MathOwner { openmp, openblas };
// model: the --model argument (empty: the embedded HF model); a TorchScript
// archive (model::is_torchscript_archive) runs on ATen, as does
// DMI_KERNELS=aten (kernels::selected_isa; a bad value is reported later,
// where the model loads).
MathOwner math_owner_for(const std::string& dtype, const std::string& model);

// Call in main() before any tensor work. Unless DMI_ENV_READY is set, sets
// the variables above that are not set yet and, if it set any, re-executes
// /proc/self/exe with the same argv (returns only when nothing needed
// changing or re-exec failed).
void prepare_process_env(int argc, char** argv, MathOwner owner);

// The OPENBLAS_CORETYPE this CPU gets (Debian's OpenBLAS 0.3.21 does not
// recognise recent CPUs and falls back to generic kernels), or nullptr where
// OpenBLAS's own choice stays. CPUID only, in a file without LibTorch
// (engine/openblas_core.cpp): tests/openblas_core_main.cpp prints it.
const char* openblas_coretype_for_cpu();

// Sets torch's intra-op threads and OpenBLAS's threads to n (n <= 0: the
// number of online CPUs), and (once) tells glibc to keep freed memory for
// reuse rather than unmap it: every layer reallocates the same activation
// sizes. Returns the count used.
int configure_threads(int n);

// What decides the numbers besides the model and the settings, as a JSON
// object (text): dmi and LibTorch versions, the CPU model and its vector
// flags, the kernels dispatched to (ATen's CPU capability, oneDNN's
// effective ISA, OpenBLAS's core), and `threads`. Recorded in captures;
// replay warns when it differs.
std::string environment_json(int threads);

}  // namespace dmi::engine
