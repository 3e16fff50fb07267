// core/: the ground every layer stands on: errors, JSON, .npy and output files, trace spans, random values.
//
// treecp::Error: the one exception type the library throws for bad input or failed calls.
// Its message names the argument or object at fault and what was expected; the library never exits.
#pragma once

#include <cstdio>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
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

// Text from an input, made fit for a one-line message: bytes outside printable ASCII become \xNN and
// anything past `max_chars` becomes "...".
inline std::string printable(std::string_view text, size_t max_chars = 64) {
  std::string out;
  for (size_t i = 0; i < text.size() && i < max_chars; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7F) {
      out += static_cast<char>(c);
    } else {
      char hex[5];
      std::snprintf(hex, sizeof hex, "\\x%02X", c);
      out += hex;
    }
  }
  if (text.size() > max_chars) out += "...";
  return out;
}

}  // namespace treecp
