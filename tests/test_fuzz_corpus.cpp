// The fuzz corpus (tests/fuzz_corpus/, the seeds of scripts/fuzz.sh) as regression tests: the issue's
// failing inputs and their relatives. Files named ok_* must parse; every other one must be refused in
// one printable line; nothing may crash, and what parses must round-trip (fuzz/inputs.hpp).
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "../fuzz/inputs.hpp"
#include "common/cli.hpp"

namespace treecp {
namespace {

namespace fs = std::filesystem;

template <class Parse>
void check_corpus(const std::string& kind, std::string (*problem)(std::string_view), Parse parse) {
  const fs::path dir = fs::path(TREECP_TESTS_DIR) / "fuzz_corpus" / kind;
  int files = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string(), bytes = testing::read_text(entry.path().string());
    EXPECT_EQ(problem(bytes), "") << name;
    bool refused = false;
    try {
      parse(bytes);
    } catch (const Error&) {
      refused = true;
    }
    EXPECT_EQ(refused, name.rfind("ok_", 0) != 0) << name << (refused ? " was refused" : " was accepted");
    ++files;
  }
  EXPECT_GE(files, 20) << dir;
}

TEST(FuzzCorpus, RowsParseOrAreRefusedInOneLine) {
  check_corpus("row", fuzz::row_input_problem, [](const std::string& b) { row_from_json(b); });
}

TEST(FuzzCorpus, ArraysParseOrAreRefusedInOneLine) {
  check_corpus("npy", fuzz::npy_input_problem, [](const std::string& b) { npy_from_bytes(b, "corpus.npy"); });
}

}  // namespace
}  // namespace treecp
