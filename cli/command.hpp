// The `treecp` command line: subcommands register themselves; each gets its arguments parsed by Args.
// Messages never repeat the command's name: main() prefixes every error with "treecp <command>: ".
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
  explicit Args(std::vector<std::string> argv);

  Args& value(const std::string& name);  // --name VALUE
  Args& flag(const std::string& name);   // --name
  // `other` is another spelling of the declared value option `name` (e.g. --cp for --ranks).
  Args& alias(const std::string& other, const std::string& name);
  void parse();

  bool has(const std::string& name) const;
  std::string get(const std::string& name) const;  // throws when missing
  std::string get_or(const std::string& name, const std::string& fallback) const;
  int64_t get_int(const std::string& name) const;
  int64_t get_int_or(const std::string& name, int64_t fallback) const;
  // The integer option (or `fallback`), required in [lo, hi]; the message names the option and the range.
  int64_t get_int_in(const std::string& name, int64_t fallback, int64_t lo, int64_t hi) const;
  double get_double_or(const std::string& name, double fallback) const;
  // The option (or `fallback`), required to be one of `choices`.
  std::string get_choice(const std::string& name, const std::string& fallback,
                         const std::vector<std::string>& choices) const;
  bool get_flag(const std::string& name) const { return flags_set_.count(name) > 0; }

 private:
  std::vector<std::string> argv_;
  std::set<std::string> value_names_, flag_names_;
  std::map<std::string, std::string> aliases_;  // other spelling -> option
  std::map<std::string, std::string> values_;
  std::map<std::string, std::string> spelled_;  // option -> how the command line spelled it
  std::set<std::string> flags_set_;
};

using CommandFn = std::function<int(const std::vector<std::string>& argv)>;

struct Command {
  std::string name;   // "tree generate", "attention", ...
  std::string usage;  // every option, as `treecp help` and README.md list them
  std::string summary;
  CommandFn run;
};

// Registered at static-initialisation time by each cli/cmd_*.cpp.
std::vector<Command>& registry();
struct Register {
  Register(std::string name, std::string usage, std::string summary, CommandFn run);
};

// "1 rank", "4 ranks".
std::string count_of(int64_t n, const std::string& singular, const std::string& plural = "");

// Refuses, before any compute, an output file that cannot be written: a directory, a path under a
// file, a missing or unwritable directory. "-" (stdout) is always fine.
void check_output_file(const std::string& path);
// Writes `text` to `path` atomically (a temporary file renamed into place), or to stdout for "-".
void write_output(const std::string& path, const std::string& text);

}  // namespace treecp::cli
