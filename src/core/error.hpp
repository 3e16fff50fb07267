// core/: the ground every layer stands on: errors, JSON, .npy and output files, trace spans, random values.
//
// treecp::Error: the one exception type the library throws for bad input or failed calls.
// Its message names the argument or object at fault and what was expected; the library never exits.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace treecp {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

namespace detail {
template <class... Parts>
std::string concat(Parts&&... parts) {
  std::ostringstream out;
  (out << ... << std::forward<Parts>(parts));
  return out.str();
}
}  // namespace detail

// Throws treecp::Error with the parts streamed together: fail("segment ", i, ": length must be > 0").
template <class... Parts>
[[noreturn]] void fail(Parts&&... parts) {
  throw Error(detail::concat(std::forward<Parts>(parts)...));
}

// Checks a precondition on an argument; the message says what was expected.
template <class... Parts>
void require(bool condition, Parts&&... parts) {
  if (!condition) fail(std::forward<Parts>(parts)...);
}

}  // namespace treecp
