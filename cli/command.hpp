// The `treecp` command line: subcommands register themselves; each gets its arguments parsed by Args.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace treecp::cli {

// Parses "--name value" and "--flag" arguments. Every option a command reads must be declared
// (value or flag) before parse(); anything else is refused with a clear error.
class Args {
 public:
  Args(std::string command, std::vector<std::string> argv);

  Args& value(const std::string& name);  // --name VALUE
  Args& flag(const std::string& name);   // --name
  void parse();

  bool has(const std::string& name) const;
  std::string get(const std::string& name) const;  // throws when missing
  std::string get_or(const std::string& name, const std::string& fallback) const;
  int64_t get_int(const std::string& name) const;
  int64_t get_int_or(const std::string& name, int64_t fallback) const;
  double get_double_or(const std::string& name, double fallback) const;
  bool get_flag(const std::string& name) const { return flags_set_.count(name) > 0; }

 private:
  std::string command_;
  std::vector<std::string> argv_;
  std::set<std::string> value_names_, flag_names_;
  std::map<std::string, std::string> values_;
  std::set<std::string> flags_set_;
};

using CommandFn = std::function<int(const std::vector<std::string>& argv)>;

struct Command {
  std::string name;     // "tree generate", "attention", ...
  std::string summary;  // one line for `treecp help`
  CommandFn run;
};

// Registered at static-initialisation time by each cli/cmd_*.cpp.
std::vector<Command>& registry();
struct Register {
  Register(std::string name, std::string summary, CommandFn run);
};

// Writes `text` to `path` atomically (a temporary file renamed into place), or to stdout for "-".
void write_output(const std::string& path, const std::string& text);

}  // namespace treecp::cli
