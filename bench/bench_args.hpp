// The command line of a CPU benchmark program: `--name value` options and `--flag`s in any order. A missing or
// malformed value or an unknown option prints one line naming it and the program exits with status 2 (benchmarks
// are programs; the library itself never exits).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

namespace treecp::bench {

class BenchArgs {
 public:
  BenchArgs(const char* program, int argc, char** argv) : program_(program), argc_(argc), argv_(argv) {}

  // Moves to the next option; false past the last.
  bool next() {
    if (++i_ >= argc_) return false;
    name_ = argv_[i_];
    return true;
  }
  const std::string& name() const { return name_; }

  // The current option's value (the next argument).
  std::string value() {
    if (i_ + 1 >= argc_) fail("needs a value");
    return argv_[++i_];
  }
  long long int_value() {
    const std::string v = value();
    char* end = nullptr;
    const long long x = std::strtoll(v.c_str(), &end, 10);
    if (v.empty() || *end != '\0') fail(("takes an integer, got " + v).c_str());
    return x;
  }
  int int32_value() { return static_cast<int>(int_value()); }

  [[noreturn]] void unknown() { fail("is not an option"); }

 private:
  [[noreturn]] void fail(const char* what) {
    std::fprintf(stderr, "%s: %s %s\n", program_, name_.c_str(), what);
    std::exit(2);
  }
  const char* program_;
  int argc_;
  char** argv_;
  int i_ = 0;
  std::string name_;
};

}  // namespace treecp::bench
