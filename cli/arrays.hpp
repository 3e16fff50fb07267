// Input checks and output files the array subcommands share (attention, sparse-mla): dtype names, shapes,
// finite values, typed copies, .npy encoding, and writing a command's files into its --out directory.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/npy.hpp"

namespace treecp::cli {

const char* dtype_name(DType t);  // "float32", "float64"

// Requires a 3-d array [rows, *, *]; `expected` names the dimensions for the message.
void require_rank3(const NpyArray& a, const std::string& name, int64_t rows, const std::string& expected);

// One precision for every array of a command: `a` must have the dtype of `ref` (named `ref_name`).
void require_same_dtype(const NpyArray& a, const std::string& name, const NpyArray& ref, const std::string& ref_name);

// NaN or infinity in an input would propagate silently into every output that reads it.
void require_finite(const NpyArray& a, const std::string& name, bool allow_neg_inf = false);

template <class T>
std::vector<T> values(const NpyArray& a) {
  return std::vector<T>(a.data.begin(), a.data.end());
}

template <class T>
std::string npy_of(const std::vector<int64_t>& shape, const std::vector<T>& data) {
  if constexpr (std::is_same_v<T, float>) {
    return npy_bytes(shape, data.data());
  } else {
    return npy_bytes(shape, data.data(), DType::F64);
  }
}

using OutputFiles = std::vector<std::pair<std::string, std::string>>;  // (file name, bytes)

// Creates `out_dir`, writes every file into it (each atomically), and removes the `optional` names this
// run did not write: an earlier run's gradients left in DIR would otherwise be read as this run's.
void write_files(const std::string& out_dir, const OutputFiles& files, const std::vector<std::string>& optional);

}  // namespace treecp::cli
