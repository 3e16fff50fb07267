#pragma once
#include <stdexcept>
#include <string>
namespace nbt {
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& m) : std::runtime_error(m) {}
};
int lib_thrower(int x);
}  // namespace nbt
