#include "core/npy.hpp"

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/error.hpp"
#include "core/json.hpp"

namespace treecp {

static_assert(std::endian::native == std::endian::little, "treecp assumes a little-endian host");

int64_t NpyArray::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

std::string NpyArray::shape_string() const { return treecp::shape_string(shape); }

namespace {

// Finds the value text of 'key' in the header dict, e.g. "'descr': '<f4'" -> "'<f4'".
std::string header_field(const std::string& header, const std::string& key, const std::string& path) {
  const std::string needle = "'" + key + "'";
  const size_t k = header.find(needle);
  require(k != std::string::npos, path, ": .npy header has no '", key, "'");
  size_t v = header.find(':', k + needle.size());
  require(v != std::string::npos, path, ": malformed .npy header");
  ++v;
  while (v < header.size() && header[v] == ' ') ++v;
  size_t e = v;
  if (header[v] == '(') {
    e = header.find(')', v);
    require(e != std::string::npos, path, ": malformed .npy shape");
    ++e;
  } else {
    while (e < header.size() && header[e] != ',' && header[e] != '}') ++e;
  }
  return header.substr(v, e - v);
}

}  // namespace

namespace {

// A .npy file split into its header fields and the offset of its data.
struct RawNpy {
  std::string bytes;
  std::string descr;  // e.g. "'<f4'"
  std::vector<int64_t> shape;
  size_t offset = 0;
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

RawNpy read_raw(const std::string& path) {
  RawNpy raw;
  raw.bytes = json::read_file(path);
  const std::string& bytes = raw.bytes;
  require(bytes.size() >= 10 && bytes.compare(0, 6, "\x93NUMPY") == 0, path, ": not a .npy file (bad magic)");
  const auto major = static_cast<unsigned char>(bytes[6]);
  size_t header_len = 0, offset = 0;
  if (major == 1) {
    header_len = static_cast<unsigned char>(bytes[8]) | (static_cast<size_t>(static_cast<unsigned char>(bytes[9])) << 8);
    offset = 10;
  } else if (major == 2 || major == 3) {
    require(bytes.size() >= 12, path, ": truncated .npy header");
    uint32_t len = 0;
    std::memcpy(&len, bytes.data() + 8, 4);
    header_len = len;
    offset = 12;
  } else {
    fail(path, ": unsupported .npy format version ", static_cast<int>(major));
  }
  require(bytes.size() >= offset + header_len, path, ": truncated .npy header");
  const std::string header = bytes.substr(offset, header_len);
  raw.offset = offset + header_len;
  raw.descr = header_field(header, "descr", path);
  const std::string order = header_field(header, "fortran_order", path);
  require(order == "False", path, ": Fortran-ordered arrays are not supported (expected C order)");
  const std::string shape = header_field(header, "shape", path);
  require(shape.size() >= 2 && shape.front() == '(' && shape.back() == ')', path, ": malformed .npy shape ", shape);
  size_t p = 1;
  while (p < shape.size() - 1) {
    while (p < shape.size() - 1 && (shape[p] == ' ' || shape[p] == ',')) ++p;
    if (p >= shape.size() - 1) break;
    size_t q = p;
    while (q < shape.size() - 1 && shape[q] >= '0' && shape[q] <= '9') ++q;
    require(q > p, path, ": malformed .npy shape ", shape);
    raw.shape.push_back(std::stoll(shape.substr(p, q - p)));
    p = q;
  }
  return raw;
}

void require_data_size(const RawNpy& raw, size_t elem, const std::string& path) {
  const int64_t n = raw.numel();
  require(raw.bytes.size() - raw.offset == static_cast<size_t>(n) * elem, path, ": data size ", raw.bytes.size() - raw.offset,
          " bytes does not match shape ", shape_string(raw.shape), " (", n * static_cast<int64_t>(elem), " bytes)");
}

}  // namespace

NpyArray load_npy(const std::string& path) {
  const RawNpy raw = read_raw(path);
  NpyArray arr;
  if (raw.descr == "'<f4'") {
    arr.dtype = DType::F32;
  } else if (raw.descr == "'<f8'") {
    arr.dtype = DType::F64;
  } else {
    fail(path, ": dtype ", raw.descr, " is not supported (expected little-endian float32 '<f4' or float64 '<f8')");
  }
  arr.shape = raw.shape;
  const int64_t n = arr.numel();
  require_data_size(raw, arr.dtype == DType::F32 ? 4 : 8, path);
  const char* data = raw.bytes.data() + raw.offset;
  arr.data.resize(static_cast<size_t>(n));
  if (arr.dtype == DType::F32) {
    std::vector<float> tmp(static_cast<size_t>(n));
    std::memcpy(tmp.data(), data, tmp.size() * 4);
    for (size_t i = 0; i < tmp.size(); ++i) arr.data[i] = tmp[i];
  } else {
    std::memcpy(arr.data.data(), data, arr.data.size() * 8);
  }
  return arr;
}

NpyInt64Array load_npy_int64(const std::string& path) {
  const RawNpy raw = read_raw(path);
  require(raw.descr == "'<i8'", path, ": dtype ", raw.descr, " is not supported here (expected little-endian int64 '<i8')");
  require_data_size(raw, 8, path);
  NpyInt64Array arr;
  arr.shape = raw.shape;
  arr.data.resize(static_cast<size_t>(raw.numel()));
  std::memcpy(arr.data.data(), raw.bytes.data() + raw.offset, arr.data.size() * 8);
  return arr;
}

namespace {
std::string npy_header(const std::vector<int64_t>& shape, const char* descr) {
  // Python's tuple syntax: (), (4,), (4, 2)
  std::string tuple = "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    tuple += std::to_string(shape[i]);
    if (shape.size() == 1) tuple += ",";
    else if (i + 1 < shape.size()) tuple += ", ";
  }
  tuple += ")";
  std::string dict = std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': " + tuple + ", }";
  // Pad with spaces so that the data starts on a 64-byte boundary; the header ends with '\n'.
  const size_t total = 10 + dict.size() + 1;
  dict.append((64 - total % 64) % 64, ' ');
  dict += '\n';
  std::string out = "\x93NUMPY";
  out += '\x01';
  out += '\x00';
  out += static_cast<char>(dict.size() & 0xFF);
  out += static_cast<char>((dict.size() >> 8) & 0xFF);
  return out + dict;
}
}  // namespace

std::string npy_bytes(const std::vector<int64_t>& shape, const double* data, DType dtype) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::string out = npy_header(shape, dtype == DType::F32 ? "<f4" : "<f8");
  if (dtype == DType::F32) {
    std::vector<float> tmp(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) tmp[static_cast<size_t>(i)] = static_cast<float>(data[i]);
    out.append(reinterpret_cast<const char*>(tmp.data()), tmp.size() * 4);
  } else {
    out.append(reinterpret_cast<const char*>(data), static_cast<size_t>(n) * 8);
  }
  return out;
}

std::string npy_bytes(const std::vector<int64_t>& shape, const int64_t* data) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::string out = npy_header(shape, "<i8");
  out.append(reinterpret_cast<const char*>(data), static_cast<size_t>(n) * 8);
  return out;
}

std::string npy_bytes(const std::vector<int64_t>& shape, const float* data) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::string out = npy_header(shape, "<f4");
  out.append(reinterpret_cast<const char*>(data), static_cast<size_t>(n) * 4);
  return out;
}

void require_shape(const NpyArray& arr, const std::string& name, const std::vector<int64_t>& expected) {
  require(arr.shape == expected, name, ": expected shape ", shape_string(expected), ", got ", arr.shape_string());
}

void require_finite(const NpyArray& a, const std::string& name, bool allow_neg_inf) {
  for (size_t i = 0; i < a.data.size(); ++i) {
    const double x = a.data[i];
    const bool ok = std::isfinite(x) || (allow_neg_inf && x == -std::numeric_limits<double>::infinity());
    require(ok, name, ": element ", i, " is ", x, " (expected finite values", allow_neg_inf ? " or -inf" : "", ")");
  }
}

const char* dtype_name(DType t) { return t == DType::F32 ? "float32" : "float64"; }

}  // namespace treecp
