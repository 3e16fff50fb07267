// libFuzzer target: the JSON row parser (core/json, tree/row). Run by scripts/fuzz.sh.
#include <cstdio>
#include <cstdlib>

#include "inputs.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string problem = treecp::fuzz::row_input_problem({reinterpret_cast<const char*>(data), size});
  if (!problem.empty()) {
    std::fprintf(stderr, "row parser: %s\n", problem.c_str());
    std::abort();
  }
  return 0;
}
