#include "command.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iostream>

#include "core/error.hpp"
#include "core/file.hpp"

namespace treecp::cli {

Args::Args(std::vector<std::string> argv) : argv_(std::move(argv)) {}

Args& Args::value(const std::string& name) {
  value_names_.insert(name);
  return *this;
}
Args& Args::flag(const std::string& name) {
  flag_names_.insert(name);
  return *this;
}
Args& Args::alias(const std::string& other, const std::string& name) {
  aliases_[other] = name;
  return *this;
}

void Args::parse() {
  for (size_t i = 0; i < argv_.size(); ++i) {
    const std::string& a = argv_[i];
    std::string name = a, inline_value;
    bool has_inline = false;
    if (auto eq = a.find('='); a.rfind("--", 0) == 0 && eq != std::string::npos) {
      name = a.substr(0, eq);
      inline_value = a.substr(eq + 1);
      has_inline = true;
    }
    const std::string spelled = name;
    if (auto it = aliases_.find(name); it != aliases_.end()) name = it->second;
    if (value_names_.count(name)) {
      if (values_.count(name)) {
        fail("option ", spelled, spelled == spelled_[name] ? " given twice" : " given twice (as " + spelled_[name] + ")");
      }
      spelled_[name] = spelled;
      if (has_inline) {
        values_[name] = inline_value;
      } else {
        require(i + 1 < argv_.size(), "option ", spelled, " needs a value");
        values_[name] = argv_[++i];
      }
    } else if (flag_names_.count(name) && !has_inline) {
      flags_set_.insert(name);
    } else {
      fail("unknown argument '", printable(a), "' (see 'treecp help')");
    }
  }
}

bool Args::has(const std::string& name) const { return values_.count(name) > 0; }

std::string Args::get(const std::string& name) const {
  auto it = values_.find(name);
  require(it != values_.end(), "missing required option ", name);
  return it->second;
}

std::string Args::get_or(const std::string& name, const std::string& fallback) const {
  auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second;
}

int64_t Args::get_int(const std::string& name) const {
  const std::string v = get(name);
  size_t used = 0;
  int64_t out = 0;
  try {
    out = std::stoll(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  require(used == v.size() && !v.empty(), "option ", name, " expects an integer, got '", printable(v), "'");
  return out;
}

int64_t Args::get_int_in(const std::string& name, int64_t fallback, int64_t lo, int64_t hi) const {
  const int64_t v = get_int_or(name, fallback);
  require(v >= lo && v <= hi, "option ", name, " must be in [", lo, ", ", hi, "], got ", v);
  return v;
}

std::string Args::get_choice(const std::string& name, const std::string& fallback,
                             const std::vector<std::string>& choices) const {
  const std::string v = get_or(name, fallback);
  std::string list;
  for (const std::string& c : choices) {
    if (c == v) return v;
    list += (list.empty() ? "" : ", ") + c;
  }
  fail("option ", name, " must be one of ", list, "; got '", printable(v), "'");
}

int64_t Args::get_int_or(const std::string& name, int64_t fallback) const {
  return has(name) ? get_int(name) : fallback;
}

double Args::get_double_or(const std::string& name, double fallback) const {
  if (!has(name)) return fallback;
  const std::string v = get(name);
  size_t used = 0;
  double out = 0;
  try {
    out = std::stod(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  require(used == v.size() && !v.empty(), "option ", name, " expects a number, got '", printable(v), "'");
  return out;
}

std::vector<Command>& registry() {
  static std::vector<Command> commands;
  return commands;
}

Register::Register(std::string name, std::string usage, std::string summary, CommandFn run) {
  registry().push_back({std::move(name), std::move(usage), std::move(summary), std::move(run)});
}

std::string count_of(int64_t n, const std::string& singular, const std::string& plural) {
  return std::to_string(n) + " " + (n == 1 ? singular : plural.empty() ? singular + "s" : plural);
}

void check_output_file(const std::string& path) {
  if (path == "-") return;
  namespace fs = std::filesystem;
  std::error_code ec;
  require(!fs::is_directory(path, ec), "--out '", printable(path), "' is a directory (expected a file)");
  const fs::path parent = fs::path(path).parent_path().empty() ? fs::path(".") : fs::path(path).parent_path();
  require(fs::is_directory(parent, ec), "--out '", printable(path), "': '", printable(parent.string()),
          "' is not a directory");
  require(access(parent.c_str(), W_OK | X_OK) == 0, "--out '", printable(path), "': cannot write in '",
          printable(parent.string()), "' (", std::strerror(errno), ")");
}

void write_output(const std::string& path, const std::string& text) {
  if (path == "-") {
    std::cout << text;
    std::cout.flush();
    return;
  }
  write_file_atomic(path, text);
}

}  // namespace treecp::cli
