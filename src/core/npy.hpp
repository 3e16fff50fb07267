// core/: the ground every layer stands on: errors, JSON, .npy files, counter-based random values.
//
// NumPy .npy files: little-endian float32 ('<f4') or float64 ('<f8'), C order, format 1.0/2.0/3.0.
// Anything else (big-endian, Fortran order, other dtypes, truncated data) is refused by name.
#pragma once

#include <cstdint>
#include <string>
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
// Serialises to the bytes of a .npy file (written by the caller, so that nothing is written on error).
std::string npy_bytes(const std::vector<int64_t>& shape, const double* data, DType dtype);
std::string npy_bytes(const std::vector<int64_t>& shape, const float* data);
// Requires arr.shape == expected; the message names the array (e.g. "q") and both shapes.
void require_shape(const NpyArray& arr, const std::string& name, const std::vector<int64_t>& expected);
std::string shape_string(const std::vector<int64_t>& shape);

}  // namespace treecp
