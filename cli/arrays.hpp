// Input checks and output files the array subcommands share (attention, sparse-mla, mamba2): shapes, one
// dtype, typed copies, .npy encoding, and writing a command's files into its --out directory (dtype names and
// the finite-value check are core/npy.hpp's).
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/npy.hpp"

namespace treecp::cli {

// Requires a 3-d array [rows, *, *]; `expected` names the dimensions for the message.
void require_rank3(const NpyArray& a, const std::string& name, int64_t rows, const std::string& expected);

// One precision for every array of a command: `a` must have the dtype of `ref` (named `ref_name`).
void require_same_dtype(const NpyArray& a, const std::string& name, const NpyArray& ref, const std::string& ref_name);

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
