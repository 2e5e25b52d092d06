#include "engine/runtime.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace dmi::engine {

namespace {

bool cpu_has(const char* flag) {
  FILE* f = std::fopen("/proc/cpuinfo", "r");
  if (!f) return false;
  char line[8192];
  bool found = false;
  while (!found && std::fgets(line, sizeof line, f)) {
    if (std::strncmp(line, "flags", 5) != 0) continue;
    std::string s = std::string(" ") + line;
    for (auto& c : s)
      if (c == '\t' || c == '\n') c = ' ';
    found = s.find(std::string(" ") + flag + " ") != std::string::npos;
    break;
  }
  std::fclose(f);
  return found;
}

}  // namespace

void prepare_process_env(int argc, char** argv, MathOwner owner) {
  if (std::getenv("DMI_ENV_READY")) return;
  setenv("DMI_ENV_READY", "1", 1);
  // Debian's OpenBLAS 0.3.21 does not recognise recent CPUs and falls back to
  // generic kernels; name the kernel family the CPU supports. A value the
  // user set wins.
  if (!std::getenv("OPENBLAS_CORETYPE")) {
    if (cpu_has("avx512f") && cpu_has("avx512bw") && cpu_has("avx512vl")) setenv("OPENBLAS_CORETYPE", "SkylakeX", 0);
    else if (cpu_has("avx2")) setenv("OPENBLAS_CORETYPE", "Haswell", 0);
  }
  if (owner == MathOwner::openblas) setenv("OMP_WAIT_POLICY", "PASSIVE", 0);
  std::vector<char*> args(argv, argv + argc);
  args.push_back(nullptr);
  ::execv("/proc/self/exe", args.data());
  // If exec fails we simply run with the current environment.
}

int configure_threads(int n) {
  if (n <= 0) n = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  at::set_num_threads(n);
  using SetThreads = void (*)(int);
  if (auto fn = reinterpret_cast<SetThreads>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) fn(n);
  return n;
}

}  // namespace dmi::engine
