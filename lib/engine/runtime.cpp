#include "engine/runtime.h"

#include "common/error.h"
#include "kernels/linear.h"
#include "kernels/memory.h"
#include "kernels/ops.h"
#include "model/causal_lm.h"

#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <torch/version.h>
#include <cpuid.h>
#include <dlfcn.h>
#include <malloc.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cstdlib>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>
#include <vector>

namespace dmi::engine {

namespace {

// What this process can execute, as the kernels' dispatch sees it
// (kernels/linear.cpp: CPUID, and only the extensions whose registers the OS
// saves), rather than /proc/cpuinfo: under an emulator that file is the
// host's (qemu-x86_64, tests/e2e/older_cpus_test.py). Flags are named as
// /proc/cpuinfo names them.
bool cpu_has(const std::string& flag) {
  __builtin_cpu_init();
  // The names GCC and clang both know.
  if (flag == "avx") return __builtin_cpu_supports("avx");
  if (flag == "avx2") return __builtin_cpu_supports("avx2");
  if (flag == "fma") return __builtin_cpu_supports("fma");
  if (flag == "avx512f") return __builtin_cpu_supports("avx512f");
  if (flag == "avx512bw") return __builtin_cpu_supports("avx512bw");
  if (flag == "avx512vl") return __builtin_cpu_supports("avx512vl");
  if (flag == "avx512_vnni") return __builtin_cpu_supports("avx512vnni");
  if (flag == "avx512_bf16") return __builtin_cpu_supports("avx512bf16");
  // The others from CPUID bits, where the state they use is saved: AVX's
  // for F16C, AVX-512's for FP16, the AMX tile state (XCR0 bits 17 and 18).
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (flag == "f16c") return __builtin_cpu_supports("avx") && __get_cpuid(1, &a, &b, &c, &d) && (c >> 29 & 1u);
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (flag == "avx512_fp16") return __builtin_cpu_supports("avx512f") && (d >> 23 & 1u);
  if (flag == "amx_bf16" || flag == "amx_tile") {
    if (!(d >> (flag == "amx_bf16" ? 22 : 24) & 1u)) return false;
    unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
    if (!__get_cpuid(1, &a1, &b1, &c1, &d1) || !(c1 >> 27 & 1u)) return false;  // OSXSAVE
    unsigned lo = 0, hi = 0;
    __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (lo >> 17 & 3u) == 3u;
  }
  return false;
}

// The processor's brand string (CPUID 0x80000002-4), which Linux shows as
// "model name".
std::string cpu_model() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(0x80000000u, &a, &b, &c, &d) || a < 0x80000004u) return "";
  unsigned regs[13] = {};
  for (unsigned i = 0; i < 3; ++i)
    __get_cpuid(0x80000002u + i, &regs[4 * i], &regs[4 * i + 1], &regs[4 * i + 2], &regs[4 * i + 3]);
  std::string s(reinterpret_cast<const char*>(regs));
  const auto first = s.find_first_not_of(' '), last = s.find_last_not_of(' ');
  return first == std::string::npos ? "" : s.substr(first, last - first + 1);
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
  j["cpu_model"] = cpu_model();
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
  // bf16 attention's arithmetic (kernels/ops.h): "vdpbf16ps" or "portable".
  j["dmi_attention"] = kernels::attention_arithmetic();
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
  // Only a variable that was not set yet is a reason to restart: each
  // restart loads LibTorch's ~290 libraries again (~0.7 s on a 2-core VM).
  bool changed = false;
  auto set = [&](const char* name, const char* value) {
    if (!value || std::getenv(name)) return;  // a value the user set wins
    setenv(name, value, 0);
    changed = true;
  };
  set("OPENBLAS_CORETYPE", openblas_coretype_for_cpu());
  if (owner == MathOwner::openblas) set("OMP_WAIT_POLICY", "PASSIVE");
  if (!changed) return;
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
