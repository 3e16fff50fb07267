// What the fuzz targets (fuzz/fuzz_*.cpp) and the corpus regression test (tests/test_fuzz_corpus.cpp)
// require of the input parsers, for any bytes: they return, or refuse with a treecp::Error of one
// printable line; what they return survives a round trip. Each function returns "" when that holds,
// else what went wrong.
#pragma once

#include <string>
#include <string_view>

#include "core/error.hpp"
#include "core/npy.hpp"
#include "tree/accounting.hpp"
#include "tree/row.hpp"

namespace treecp::fuzz {

// Rows whose statistics the checks compute (row_stats is linear in the slices; this keeps a fuzz run fast).
constexpr int64_t kCheckedSlices = 100000;
// The longest message a refusal may have: inputs are echoed through printable(), which bounds them.
constexpr size_t kMaxMessageChars = 600;

inline std::string message_problem(const std::string& m) {
  if (m.empty()) return "an empty error message";
  if (m.size() > kMaxMessageChars) return "an error message of " + std::to_string(m.size()) + " characters";
  for (char c : m) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u >= 0x7F) return "an error message with the byte " + std::to_string(u) + ": " + printable(m);
  }
  return "";
}

inline std::string row_input_problem(std::string_view bytes) {
  Row row;
  try {
    row = row_from_json(bytes);
  } catch (const Error& e) {
    return message_problem(e.what());
  }
  const Row again = row_from_json(row_to_json(row));
  if (again.num_segments() != row.num_segments() || again.tokens() != row.tokens()) return "a row that does not round-trip";
  if (row.slice_count() <= kCheckedSlices) {
    const RowStats st = row_stats(row);
    if (st.physical_tokens != row.tokens() || st.segments != row.num_segments()) return "inconsistent row statistics";
  }
  return "";
}

inline std::string npy_input_problem(std::string_view bytes) {
  NpyArray a;
  try {
    a = npy_from_bytes(bytes, "input.npy");
  } catch (const Error& e) {
    return message_problem(e.what());
  }
  if (static_cast<int64_t>(a.data.size()) != a.numel()) return "an array whose data does not match its shape";
  const NpyArray again = npy_from_bytes(npy_bytes(a.shape, a.data.data(), a.dtype), "again.npy");
  if (again.shape != a.shape || again.dtype != a.dtype) return "an array that does not round-trip";
  for (size_t i = 0; i < a.data.size(); ++i) {
    const bool both_nan = a.data[i] != a.data[i] && again.data[i] != again.data[i];
    if (!both_nan && again.data[i] != a.data[i]) return "an array whose values do not round-trip";
  }
  return "";
}

}  // namespace treecp::fuzz
