// core/: the ground every layer stands on: errors, JSON, .npy and output files, trace spans, random values.
//
// NumPy .npy files: little-endian float32 ('<f4') or float64 ('<f8'), C order, format 1.0/2.0/3.0; and
// int64 ('<i8') for token ids, through their own functions. Anything else (big-endian, Fortran order,
// other dtypes, other header keys, truncated data) is refused in one printable line naming the file.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace treecp {

enum class DType { F32, F64 };

struct NpyArray {
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  std::vector<double> data;  // values widened to double; `dtype` records the file's precision

  int64_t numel() const;
  std::string shape_string() const;  // "[4, 2, 8]"
};

NpyArray load_npy(const std::string& path);
// The same from a file's bytes; `name` (the path) starts every message. The header must hold exactly
// 'descr', 'fortran_order' and 'shape'; every dimension is at most 2^31-1 and the element count
// is checked for overflow and against the data before anything is allocated.
NpyArray npy_from_bytes(std::string_view bytes, const std::string& name);

// An int64 array (token ids), read and written exactly; the same header rules.
struct NpyInt64Array {
  std::vector<int64_t> shape;
  std::vector<int64_t> data;
};
NpyInt64Array load_npy_int64(const std::string& path);
NpyInt64Array npy_int64_from_bytes(std::string_view bytes, const std::string& name);
// Serialises to the bytes of a .npy file (written by the caller, so that nothing is written on error).
std::string npy_bytes(const std::vector<int64_t>& shape, const double* data, DType dtype);
std::string npy_bytes(const std::vector<int64_t>& shape, const float* data);
std::string npy_bytes(const std::vector<int64_t>& shape, const int64_t* data);  // '<i8'

// Requires arr.shape == expected; the message names the array (e.g. "q") and both shapes.
void require_shape(const NpyArray& arr, const std::string& name, const std::vector<int64_t>& expected);
// NaN or infinity in an input would propagate silently into every output that reads it: requires
// finite values (and -inf where allow_neg_inf); the message names the array and the element.
void require_finite(const NpyArray& arr, const std::string& name, bool allow_neg_inf = false);
// "float32" / "float64".
const char* dtype_name(DType t);
std::string shape_string(const std::vector<int64_t>& shape);

}  // namespace treecp
