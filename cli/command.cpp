#include "command.hpp"

#include <algorithm>
#include <filesystem>
#include <iostream>

#include "core/error.hpp"
#include "core/file.hpp"

namespace treecp::cli {

Args::Args(std::string command, std::vector<std::string> argv) : command_(std::move(command)), argv_(std::move(argv)) {}

Args& Args::value(const std::string& name) {
  value_names_.insert(name);
  return *this;
}
Args& Args::flag(const std::string& name) {
  flag_names_.insert(name);
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
    if (value_names_.count(name)) {
      require(!values_.count(name), command_, ": option ", name, " given twice");
      if (has_inline) {
        values_[name] = inline_value;
      } else {
        require(i + 1 < argv_.size(), command_, ": option ", name, " needs a value");
        values_[name] = argv_[++i];
      }
    } else if (flag_names_.count(name) && !has_inline) {
      flags_set_.insert(name);
    } else {
      fail(command_, ": unknown argument '", a, "' (see 'treecp help')");
    }
  }
}

bool Args::has(const std::string& name) const { return values_.count(name) > 0; }

std::string Args::get(const std::string& name) const {
  auto it = values_.find(name);
  require(it != values_.end(), command_, ": missing required option ", name);
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
  require(used == v.size() && !v.empty(), command_, ": option ", name, " expects an integer, got '", v, "'");
  return out;
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
  require(used == v.size() && !v.empty(), command_, ": option ", name, " expects a number, got '", v, "'");
  return out;
}

std::vector<Command>& registry() {
  static std::vector<Command> commands;
  return commands;
}

Register::Register(std::string name, std::string summary, CommandFn run) {
  registry().push_back({std::move(name), std::move(summary), std::move(run)});
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
