// The .npy reader and writer: round trips in float32, float64 and int64, and every refused file by name.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "common/cli.hpp"
#include "core/error.hpp"
#include "core/npy.hpp"

namespace treecp {
namespace {

using testing::TempDir;
using testing::write_file;

// A version 1.0 file with the given header dict and raw data, as NumPy lays it out.
std::string npy_file(const std::string& dict, const std::string& data) {
  std::string header = dict;
  const size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header += '\n';
  std::string out = "\x93NUMPY";
  out += '\x01';
  out += '\x00';
  out += static_cast<char>(header.size() & 0xFF);
  out += static_cast<char>(header.size() >> 8);
  return out + header + data;
}

std::string error_of(const std::string& path) {
  try {
    load_npy(path);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Npy, RoundTripsFloat32AndFloat64) {
  TempDir dir("treecp_npy");
  const std::vector<double> values = {1.5, -2.25, 3.0e-300, 4.0, 5.5, -6.0};
  for (const std::vector<int64_t>& shape : {std::vector<int64_t>{6}, {2, 3}, {1, 2, 3}}) {
    write_file(dir / "d.npy", npy_bytes(shape, values.data(), DType::F64));
    const NpyArray d = load_npy(dir / "d.npy");
    EXPECT_EQ(d.dtype, DType::F64);
    EXPECT_EQ(d.shape, shape);
    EXPECT_EQ(d.data, values);
    const std::vector<float> f(values.begin(), values.end());
    write_file(dir / "f.npy", npy_bytes(shape, f.data()));
    const NpyArray a = load_npy(dir / "f.npy");
    EXPECT_EQ(a.dtype, DType::F32);
    EXPECT_EQ(a.shape, shape);
    for (size_t i = 0; i < f.size(); ++i) EXPECT_EQ(a.data[i], static_cast<double>(f[i]));
  }
  // A header written the way NumPy writes it, 1-d tuple with its trailing comma.
  const double two[2] = {7.0, 8.0};
  write_file(dir / "np.npy", npy_file("{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }",
                                      std::string(reinterpret_cast<const char*>(two), 16)));
  EXPECT_EQ(load_npy(dir / "np.npy").data, (std::vector<double>{7.0, 8.0}));
}

TEST(Npy, RefusesWhatItCannotReadByName) {
  TempDir dir("treecp_npy_bad");
  const std::string eight(8, '\0');
  write_file(dir / "be.npy", npy_file("{'descr': '>f8', 'fortran_order': False, 'shape': (1,), }", eight));
  EXPECT_NE(error_of(dir / "be.npy").find("'>f8' is not supported"), std::string::npos) << error_of(dir / "be.npy");
  write_file(dir / "int.npy", npy_file("{'descr': '<i4', 'fortran_order': False, 'shape': (2,), }", eight));
  EXPECT_NE(error_of(dir / "int.npy").find("'<i4' is not supported"), std::string::npos);
  write_file(dir / "fo.npy", npy_file("{'descr': '<f8', 'fortran_order': True, 'shape': (1,), }", eight));
  EXPECT_NE(error_of(dir / "fo.npy").find("Fortran-ordered"), std::string::npos);
  write_file(dir / "short.npy", npy_file("{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }", eight));
  EXPECT_NE(error_of(dir / "short.npy").find("does not match shape [2]"), std::string::npos);
  write_file(dir / "magic.npy", "not an array");
  EXPECT_NE(error_of(dir / "magic.npy").find("not a .npy file"), std::string::npos);
  EXPECT_NE(error_of(dir / "missing.npy").find("cannot read file"), std::string::npos);
  // every message names the file
  EXPECT_NE(error_of(dir / "fo.npy").find("fo.npy"), std::string::npos);
}

// One line of printable ASCII: what the CLI prints.
bool one_printable_line(const std::string& m) {
  for (char c : m) {
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7F) return false;
  }
  return !m.empty();
}

TEST(Npy, RefusesMalformedHeadersInOnePrintableLine) {
  TempDir dir("treecp_npy_header");
  const std::string f960(960 * 4, '\0');
  struct Case {
    std::string name, dict, data, expected;
  };
  const std::vector<Case> cases = {
      // 160 x 576460752303423494 x 4 bytes wraps int64 to 3,840 bytes: the data of 960 floats
      {"wrap", "{'descr': '<f4', 'fortran_order': False, 'shape': (160, 576460752303423494), }", f960,
       "dimension 576460752303423494, more than 2^31-1"},
      {"product", "{'descr': '<f4', 'fortran_order': False, 'shape': (2147483647, 2147483647, 2147483647, 8), }",
       f960, "does not match shape [2147483647, 2147483647, 2147483647, 8] (more than 2^63 bytes)"},
      {"digits", "{'descr': '<f4', 'fortran_order': False, 'shape': (12345678901234567890123,), }", f960,
       "dimension 12345678901234567890123, more than 2^31-1"},
      {"extra", "{'descr': '<f4', 'fortran_order': False, 'shape': (960,), 'extra': 1, }", f960,
       "has the key 'extra' (expected exactly 'descr', 'fortran_order' and 'shape')"},
      {"control", "{'descr': '<f\x01\n\n4', 'fortran_order': False, 'shape': (960,), }", f960,
       "dtype '<f\\x01\\x0A\\x0A4' is not supported"},
      {"twice", "{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (960,), }", f960,
       "has the key 'descr' twice"},
      {"noshape", "{'descr': '<f4', 'fortran_order': False, }", f960, "has no 'shape'"},
      {"scalar", "{'descr': '<f4', 'fortran_order': False, 'shape': (960), }", f960,
       "a one-dimensional shape is written (n,)"},
      {"negative", "{'descr': '<f4', 'fortran_order': False, 'shape': (-960,), }", f960,
       "shape must be a tuple of non-negative integers"},
      {"trailing", "{'descr': '<f4', 'fortran_order': False, 'shape': (960,), } x", f960, "text after the header"},
      {"order", "{'descr': '<f4', 'fortran_order': 0, 'shape': (960,), }", f960, "fortran_order must be True or False"},
  };
  for (const Case& c : cases) {
    write_file(dir / c.name, npy_file(c.dict, c.data));
    const std::string m = error_of(dir / c.name);
    EXPECT_NE(m.find(c.expected), std::string::npos) << c.name << ": " << m;
    EXPECT_NE(m.find(dir / c.name), std::string::npos) << m;
    EXPECT_TRUE(one_printable_line(m)) << c.name << ": " << m;
  }
  // An announced header longer than the file, and a header that does not end the way NumPy ends it.
  std::string truncated = npy_file("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }", "");
  truncated.resize(40);
  write_file(dir / "truncated", truncated);
  EXPECT_NE(error_of(dir / "truncated").find("truncated .npy header"), std::string::npos) << error_of(dir / "truncated");
  std::string no_newline = npy_file("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }", std::string(4, '\0'));
  no_newline[no_newline.rfind('\n')] = ' ';
  write_file(dir / "no_newline", no_newline);
  EXPECT_NE(error_of(dir / "no_newline").find("must end with a newline"), std::string::npos) << error_of(dir / "no_newline");
  // Double quotes, no spaces, a trailing comma inside the tuple: still NumPy's header.
  write_file(dir / "tight", npy_file("{\"descr\":\"<f4\",\"fortran_order\":False,\"shape\":(2,1,)}", std::string(8, '\0')));
  EXPECT_EQ(load_npy(dir / "tight").shape, (std::vector<int64_t>{2, 1}));
  write_file(dir / "empty", npy_file("{'descr': '<f8', 'fortran_order': False, 'shape': (0, 2147483647), }", ""));
  EXPECT_EQ(load_npy(dir / "empty").numel(), 0);
}

TEST(Npy, Int64IdsRoundTripExactly) {
  TempDir dir("treecp_npy_i64");
  const std::vector<int64_t> ids = {0, -1, 2147483646, 5, (int64_t{1} << 62) + 3, 7};
  write_file(dir / "ids.npy", npy_bytes({3, 2}, ids.data()));
  const NpyInt64Array a = load_npy_int64(dir / "ids.npy");
  EXPECT_EQ(a.shape, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(a.data, ids);
  // the float readers refuse it by dtype, the int64 reader refuses floats
  EXPECT_NE(error_of(dir / "ids.npy").find("'<i8' is not supported"), std::string::npos);
  const std::vector<float> f = {1.0f, 2.0f};
  write_file(dir / "f.npy", npy_bytes({2}, f.data()));
  try {
    load_npy_int64(dir / "f.npy");
    ADD_FAILURE() << "a float32 file was read as int64";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expected little-endian int64 '<i8'"), std::string::npos) << e.what();
  }
  write_file(dir / "short.npy", npy_file("{'descr': '<i8', 'fortran_order': False, 'shape': (3,), }", std::string(16, '\0')));
  EXPECT_THROW(load_npy_int64(dir / "short.npy"), Error);
}

TEST(Npy, ShapeCheckNamesTheArray) {
  NpyArray a;
  a.shape = {4, 2, 8};
  try {
    require_shape(a, "k", {4, 1, 8});
    ADD_FAILURE() << "a wrong shape was accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "k: expected shape [4, 1, 8], got [4, 2, 8]");
  }
}

}  // namespace
}  // namespace treecp
