// The part of tests/common for tests that run the `treecp` executable (TREECP_CLI_PATH) as a separate
// process: a temporary directory, file helpers, and one way to run the command and read what it printed.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>

namespace treecp::testing {

// A fresh directory under the system temp dir, removed with everything in it at scope exit.
struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& prefix) {
    std::random_device rd;
    path = std::filesystem::temp_directory_path() / (prefix + "_" + std::to_string(rd()) + std::to_string(rd()));
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

inline std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

struct CliRun {
  int status = 0;
  std::string log;  // stdout and stderr together
};

// Runs `treecp <args>`, its output captured in `log_path`.
inline CliRun run_treecp(const std::string& args, const std::string& log_path) {
  const int status = std::system((std::string(TREECP_CLI_PATH) + " " + args + " > " + log_path + " 2>&1").c_str());
  return {status, read_text(log_path)};
}

}  // namespace treecp::testing
