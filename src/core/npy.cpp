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
  for (int64_t d : shape) n *= d;  // load_npy refuses shapes whose product overflows
  return n;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

std::string NpyArray::shape_string() const { return treecp::shape_string(shape); }

namespace {

// The header dict of a .npy file, a Python literal such as
// {'descr': '<f4', 'fortran_order': False, 'shape': (4, 2), }: exactly these three keys, each once.
class NpyHeader {
 public:
  NpyHeader(std::string_view text, const std::string& name) : text_(text), name_(name) {}

  void parse(std::string& descr, bool& fortran_order, std::vector<int64_t>& shape) {
    bool has_descr = false, has_order = false, has_shape = false;
    space();
    expect('{');
    for (;;) {
      space();
      if (peek() == '}') break;
      const std::string key = quoted();
      space();
      expect(':');
      space();
      if (key == "descr") {
        once(has_descr, key);
        descr = quoted();
      } else if (key == "fortran_order") {
        once(has_order, key);
        fortran_order = boolean();
      } else if (key == "shape") {
        once(has_shape, key);
        shape = tuple();
      } else {
        fail(name_, ": .npy header has the key '", printable(key),
             "' (expected exactly 'descr', 'fortran_order' and 'shape')");
      }
      space();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      space();
      if (peek() != '}') bad("expected ',' or '}'");
    }
    ++pos_;
    space();
    if (pos_ != text_.size()) bad("text after the header's closing '}'");
    for (auto [has, key] : {std::pair{has_descr, "descr"}, {has_order, "fortran_order"}, {has_shape, "shape"}}) {
      require(has, name_, ": .npy header has no '", key, "'");
    }
  }

 private:
  [[noreturn]] void bad(const char* what) const {
    std::string_view shown = text_;
    while (!shown.empty() && (shown.back() == ' ' || shown.back() == '\n')) shown.remove_suffix(1);  // NumPy's padding
    fail(name_, ": malformed .npy header at byte ", pos_, ": ", what, " (header: ", printable(shown, 96), ")");
  }
  char peek() const { return pos_ < text_.size() ? text_[pos_] : '\0'; }
  void space() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\n')) ++pos_;
  }
  void expect(char c) {
    if (peek() != c) bad(c == '{' ? "expected '{'" : c == ':' ? "expected ':'" : "unexpected character");
    ++pos_;
  }
  void once(bool& seen, const std::string& key) {
    require(!seen, name_, ": .npy header has the key '", key, "' twice");
    seen = true;
  }
  std::string quoted() {
    const char q = peek();
    if (q != '\'' && q != '"') bad("expected a quoted string");
    const size_t end = text_.find(q, pos_ + 1);
    if (end == std::string_view::npos) bad("unterminated string");
    std::string out(text_.substr(pos_ + 1, end - pos_ - 1));
    pos_ = end + 1;
    return out;
  }
  bool boolean() {
    for (auto [word, value] : {std::pair{std::string_view("True"), true}, {std::string_view("False"), false}}) {
      if (text_.substr(pos_, word.size()) == word) {
        pos_ += word.size();
        return value;
      }
    }
    bad("fortran_order must be True or False");
  }
  // (), (4,), (4, 2) or (4, 2,): Python's tuple of non-negative integers.
  std::vector<int64_t> tuple() {
    expect_tuple('(');
    std::vector<int64_t> dims;
    bool comma = false;
    for (;;) {
      space();
      if (peek() == ')') break;
      if (!(peek() >= '0' && peek() <= '9')) bad("shape must be a tuple of non-negative integers");
      int64_t d = 0;
      const size_t first = pos_;
      while (peek() >= '0' && peek() <= '9') {
        // Every dimension is a token, head or channel count: int32 everywhere it is used.
        if (d > (kMaxDim - (peek() - '0')) / 10) {
          size_t end = pos_;
          while (end < text_.size() && text_[end] >= '0' && text_[end] <= '9') ++end;
          fail(name_, ": .npy shape has the dimension ", printable(text_.substr(first, end - first)),
               ", more than 2^31-1");
        }
        d = d * 10 + (peek() - '0');
        ++pos_;
      }
      dims.push_back(d);
      space();
      comma = peek() == ',';
      if (comma) {
        ++pos_;
      } else if (peek() != ')') {
        bad("shape must be a tuple of non-negative integers");
      }
    }
    if (dims.size() == 1 && !comma) bad("a one-dimensional shape is written (n,)");
    require(dims.size() <= kMaxDims, name_, ": .npy shape has ", dims.size(), " dimensions, more than NumPy's ", kMaxDims);
    ++pos_;
    return dims;
  }
  void expect_tuple(char c) {
    if (peek() != c) bad("shape must be a tuple of non-negative integers");
    ++pos_;
  }

  static constexpr int64_t kMaxDim = 2147483647;
  static constexpr size_t kMaxDims = 32;  // NPY_MAXDIMS: NumPy writes no more
  std::string_view text_;
  const std::string& name_;
  size_t pos_ = 0;
};

// A .npy file's header, checked: its dtype text, shape and where the data starts.
struct RawNpy {
  std::string descr;  // e.g. "<f4"
  std::vector<int64_t> shape;
  size_t offset = 0;
};

RawNpy parse_raw(std::string_view bytes, const std::string& name) {
  require(bytes.size() >= 10 && bytes.substr(0, 6) == "\x93NUMPY", name, ": not a .npy file (bad magic)");
  const auto major = static_cast<unsigned char>(bytes[6]);
  size_t header_len = 0, offset = 0;
  if (major == 1) {
    header_len = static_cast<unsigned char>(bytes[8]) | (static_cast<size_t>(static_cast<unsigned char>(bytes[9])) << 8);
    offset = 10;
  } else if (major == 2 || major == 3) {
    require(bytes.size() >= 12, name, ": truncated .npy header");
    uint32_t len = 0;
    std::memcpy(&len, bytes.data() + 8, 4);
    header_len = len;
    offset = 12;
  } else {
    fail(name, ": unsupported .npy format version ", static_cast<int>(major));
  }
  require(bytes.size() - offset >= header_len, name, ": truncated .npy header (", header_len, " bytes announced, ",
          bytes.size() - offset, " present)");
  std::string_view header = bytes.substr(offset, header_len);
  require(!header.empty() && header.back() == '\n', name, ": malformed .npy header (it must end with a newline)");
  RawNpy raw;
  bool fortran_order = false;
  NpyHeader(header, name).parse(raw.descr, fortran_order, raw.shape);
  require(!fortran_order, name, ": Fortran-ordered arrays are not supported (expected C order)");
  raw.offset = offset + header_len;
  return raw;
}

// The element count, checked against the data (elements of `elem` bytes) before anything is
// allocated: a product past 2^63 bytes (which int64 arithmetic would wrap to a small count) or any
// the data does not hold is refused.
int64_t checked_count(const RawNpy& raw, std::string_view bytes, int64_t elem, const std::string& name) {
  const auto data_bytes = static_cast<int64_t>(bytes.size() - raw.offset);
  int64_t n = 1;
  bool overflow = false;
  for (int64_t d : raw.shape) overflow = overflow || __builtin_mul_overflow(n, d, &n);
  overflow = overflow || __builtin_mul_overflow(n, elem, &n);
  require(!overflow && data_bytes == n, name, ": data size ", data_bytes, " bytes does not match shape ",
          shape_string(raw.shape), overflow ? " (more than 2^63 bytes)" : " (" + std::to_string(n) + " bytes)");
  return n / elem;
}

}  // namespace

NpyArray npy_from_bytes(std::string_view bytes, const std::string& name) {
  const RawNpy raw = parse_raw(bytes, name);
  NpyArray arr;
  if (raw.descr == "<f4") {
    arr.dtype = DType::F32;
  } else if (raw.descr == "<f8") {
    arr.dtype = DType::F64;
  } else {
    fail(name, ": dtype '", printable(raw.descr),
         "' is not supported (expected little-endian float32 '<f4' or float64 '<f8')");
  }
  arr.shape = raw.shape;
  const int64_t n = checked_count(raw, bytes, arr.dtype == DType::F32 ? 4 : 8, name);
  const char* data = bytes.data() + raw.offset;
  arr.data.resize(static_cast<size_t>(n));
  if (arr.dtype == DType::F32) {
    for (size_t i = 0; i < arr.data.size(); ++i) {
      float x;
      std::memcpy(&x, data + i * 4, 4);
      arr.data[i] = x;
    }
  } else if (!arr.data.empty()) {  // an empty vector's data() may be null, which memcpy may not get
    std::memcpy(arr.data.data(), data, arr.data.size() * 8);
  }
  return arr;
}

NpyInt64Array npy_int64_from_bytes(std::string_view bytes, const std::string& name) {
  const RawNpy raw = parse_raw(bytes, name);
  require(raw.descr == "<i8", name, ": dtype '", printable(raw.descr),
          "' is not supported here (expected little-endian int64 '<i8')");
  NpyInt64Array arr;
  arr.shape = raw.shape;
  arr.data.resize(static_cast<size_t>(checked_count(raw, bytes, 8, name)));
  if (!arr.data.empty()) std::memcpy(arr.data.data(), bytes.data() + raw.offset, arr.data.size() * 8);
  return arr;
}

NpyArray load_npy(const std::string& path) { return npy_from_bytes(json::read_file(path), path); }

NpyInt64Array load_npy_int64(const std::string& path) { return npy_int64_from_bytes(json::read_file(path), path); }

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
  } else if (n > 0) {
    out.append(reinterpret_cast<const char*>(data), static_cast<size_t>(n) * 8);
  }
  return out;
}

std::string npy_bytes(const std::vector<int64_t>& shape, const int64_t* data) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::string out = npy_header(shape, "<i8");
  if (n > 0) out.append(reinterpret_cast<const char*>(data), static_cast<size_t>(n) * 8);
  return out;
}

std::string npy_bytes(const std::vector<int64_t>& shape, const float* data) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::string out = npy_header(shape, "<f4");
  if (n > 0) out.append(reinterpret_cast<const char*>(data), static_cast<size_t>(n) * 4);
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
