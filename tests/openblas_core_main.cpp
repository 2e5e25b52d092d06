// Prints the OPENBLAS_CORETYPE that dmi-run, dmi-patch and dmi-bench set on
// this CPU (engine/runtime.h), or nothing. The test suite runs it once, when
// ctest starts (tests/CMakeLists.txt), and exports the value, so that those
// programs do not restart themselves to set it in each test.
#include <cstdio>

#include "engine/runtime.h"

int main() {
  if (const char* core = dmi::engine::openblas_coretype_for_cpu()) std::puts(core);
  return 0;
}
