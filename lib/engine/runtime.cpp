#include "engine/runtime.h"

#include "common/error.h"
#include "kernels/linear.h"
#include "kernels/memory.h"
#include "model/causal_lm.h"

#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <torch/version.h>
#include <dlfcn.h>
#include <malloc.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <sstream>
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

std::string cpuinfo_field(const char* key) {
  FILE* f = std::fopen("/proc/cpuinfo", "r");
  if (!f) return "";
  char line[8192];
  std::string out;
  while (std::fgets(line, sizeof line, f)) {
    if (std::strncmp(line, key, std::strlen(key)) != 0) continue;
    const char* colon = std::strchr(line, ':');
    if (!colon) continue;
    out = colon + 1;
    while (!out.empty() && (out.front() == ' ' || out.front() == '\t')) out.erase(0, 1);
    while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
    break;
  }
  std::fclose(f);
  return out;
}

// oneDNN's dnnl_cpu_isa_t values (oneDNN 2.x, dnnl_types.h).
std::string onednn_isa() {
  using GetIsa = int (*)();
  auto fn = reinterpret_cast<GetIsa>(::dlsym(RTLD_DEFAULT, "dnnl_get_effective_cpu_isa"));
  if (!fn) return "unknown";
  switch (fn()) {
    case 0x0: return "all";
    case 0x1: return "sse41";
    case 0x3: return "avx";
    case 0x7: return "avx2";
    case 0x407: return "avx2_vnni";
    case 0xf: return "avx512_mic";
    case 0x1f: return "avx512_mic_4ops";
    case 0x27: return "avx512_core";
    case 0x67: return "avx512_core_vnni";
    case 0xe7: return "avx512_core_bf16";
    case 0x3e7: return "avx512_core_amx";
    default: return fmt::format("0x{:x}", fn());
  }
}

}  // namespace

std::string environment_json(int threads) {
  nlohmann::json j;
  j["dmi_version"] = DMI_VERSION;
  j["libtorch_version"] = fmt::format("{}.{}.{}", TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, TORCH_VERSION_PATCH);
  j["cpu_model"] = cpuinfo_field("model name");
  std::vector<std::string> flags;
  for (const char* f : {"avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                        "avx512_fp16", "amx_bf16", "amx_tile"})
    if (cpu_has(f)) flags.emplace_back(f);
  j["cpu_flags"] = flags;
  // ATen's vectorized kernels: "CPU capability usage: AVX2" in show_config().
  std::string aten = "unknown";
  std::istringstream config(at::show_config());
  for (std::string line; std::getline(config, line);)
    if (auto k = line.find("CPU capability usage:"); k != std::string::npos) aten = line.substr(k + 22);
  j["aten_cpu_capability"] = aten;
  // The linear layers' kernels (kernels/linear.h): bit patterns depend on them.
  j["dmi_kernels"] = kernels::isa_name(kernels::selected_isa());
  j["onednn_isa"] = onednn_isa();
  using CoreName = char* (*)();
  auto core = reinterpret_cast<CoreName>(::dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  j["openblas_core"] = core ? std::string(core()) : std::string("unknown");
  j["threads"] = threads;
  return j.dump();
}

MathOwner math_owner_for(const std::string& dtype, const std::string& model) {
  if (dtype != "float32") return MathOwner::openmp;
  if (!model.empty() && model::is_torchscript_archive(model)) return MathOwner::openblas;
  try {
    return kernels::selected_isa() == kernels::Isa::aten ? MathOwner::openblas : MathOwner::openmp;
  } catch (const Error&) {
    return MathOwner::openmp;  // a bad DMI_KERNELS is reported where the model loads, at the app boundary
  }
}

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
  // A forward pass frees and reallocates the same activation sizes every
  // layer. glibc returns blocks above its mmap threshold (128 KiB, raised
  // dynamically) to the kernel, so each layer page-faulted and zeroed its
  // buffers again: ~11 % of the samples of a perf profile of batch-8,
  // 256-token prefills (model load included) on a 2-core VM, where page
  // faults are expensive. Keep freed memory in the
  // heap instead (blocks above 32 MiB, glibc's largest threshold, are still
  // mapped per allocation: kernels::install_large_block_cache keeps those).
  static const bool allocator = [] {
    ::mallopt(M_MMAP_THRESHOLD, 32 << 20);
    ::mallopt(M_TRIM_THRESHOLD, 1 << 30);
    kernels::install_large_block_cache();
    return true;
  }();
  (void)allocator;
  if (n <= 0) n = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  at::set_num_threads(n);
  using SetThreads = void (*)(int);
  if (auto fn = reinterpret_cast<SetThreads>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) fn(n);
  return n;
}

}  // namespace dmi::engine
