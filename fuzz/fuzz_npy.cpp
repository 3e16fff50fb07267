// libFuzzer target: the .npy reader (core/npy). Run by scripts/fuzz.sh.
#include <cstdio>
#include <cstdlib>

#include "inputs.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string problem = treecp::fuzz::npy_input_problem({reinterpret_cast<const char*>(data), size});
  if (!problem.empty()) {
    std::fprintf(stderr, ".npy reader: %s\n", problem.c_str());
    std::abort();
  }
  return 0;
}
