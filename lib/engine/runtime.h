// Process-wide runtime set-up: who owns the CPU threads.
//
// On 2 cores torch's OpenMP pool and OpenBLAS's pthread pool busy-wait against
// each other. dmi gives the intra-op threads to torch (elementwise ops, oneDNN
// bf16 matmul) and lets OpenBLAS use the same count for fp32 GEMM; both pools
// are told to sleep instead of spinning once idle, so whichever runs next gets
// the cores. OpenBLAS reads its settings when the library loads, before
// main(), so prepare_process_env() re-executes the program once with them set.
#pragma once

#include <string>

namespace dmi::engine {

// Call first in main(). If the environment lacks dmi's OpenBLAS/OpenMP
// settings, sets them and re-executes /proc/self/exe with the same argv
// (returns only when nothing needed changing or re-exec failed).
void prepare_process_env(int argc, char** argv);

// Sets torch's intra-op threads and OpenBLAS's threads to n (n <= 0: the
// number of online CPUs). Returns the count used.
int configure_threads(int n);

// A one-line description of the thread set-up, for --json and benchmarks.
std::string runtime_summary();

}  // namespace dmi::engine
