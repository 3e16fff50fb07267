#include "arrays.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>

#include "command.hpp"
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

void write_files(const std::string& out_dir, const OutputFiles& files, const std::vector<std::string>& optional) {
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  require(!ec && std::filesystem::is_directory(out_dir), "--out: cannot create directory '", out_dir, "'",
          ec ? ": " + ec.message() : std::string());
  for (const auto& [name, bytes] : files) write_output((std::filesystem::path(out_dir) / name).string(), bytes);
  for (const std::string& name : optional) {
    const bool written = std::any_of(files.begin(), files.end(), [&](const auto& f) { return f.first == name; });
    if (!written) std::filesystem::remove(std::filesystem::path(out_dir) / name, ec);
  }
}

}  // namespace treecp::cli
