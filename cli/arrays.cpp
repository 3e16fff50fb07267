#include <cmath>
#include "arrays.hpp"

#include "core/error.hpp"

namespace treecp::cli {

void require_rank3(const NpyArray& a, const std::string& name, int64_t rows, const std::string& expected) {
  require(a.shape.size() == 3 && a.shape[0] == rows, name, ": expected shape ", expected, " with S = ", rows,
          ", got ", a.shape_string());
}

void require_same_dtype(const NpyArray& a, const std::string& name, const NpyArray& ref, const std::string& ref_name) {
  require(a.dtype == ref.dtype, name, " is ", dtype_name(a.dtype), " but ", ref_name, " is ", dtype_name(ref.dtype),
          ": mixing dtypes is refused (give every array the same dtype)");
}

void require_finite_at_most(const NpyArray& a, const std::string& name, double max, const std::string& why) {
  require_finite(a, name);
  for (size_t i = 0; i < a.data.size(); ++i) {
    require(a.data[i] <= max, name, ": element ", i, " is ", a.data[i], " (expected values <= ", max, ": ", why, ")");
  }
}

void require_magnitude_at_most(const NpyArray& a, const std::string& name, double max_abs, const std::string& why) {
  for (size_t i = 0; i < a.data.size(); ++i)
    require(std::abs(a.data[i]) <= max_abs, name, ": element ", i, " is ", a.data[i], " (expected |values| <= ", max_abs,
            ": ", why, ")");
}

int require_dim(const NpyArray& a, const std::string& name, size_t axis, const std::string& what, int64_t lo,
                int64_t hi) {
  const int64_t d = a.shape.at(axis);
  require(d >= lo && d <= hi, name, ": ", what, " = ", d, " (dimension ", axis, " of ", a.shape_string(),
          ") must be in [", lo, ", ", hi, "]");
  return static_cast<int>(d);
}

}  // namespace treecp::cli
