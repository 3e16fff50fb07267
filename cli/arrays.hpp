// Input checks and output files the array subcommands share (attention, gdn, conv1d, sparse-mla, mamba2):
// shapes, one dtype, value ranges, typed copies, .npy encoding (dtype names and the finite-value check are
// core/npy.hpp's; a command's files reach --out through OutputDir).
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

// Finite values (core/npy.hpp's require_finite) that are also at most `max`; `why` gives the reason
// (GDN's gates are logs of decays, <= 0).
void require_finite_at_most(const NpyArray& a, const std::string& name, double max, const std::string& why);

// Values of magnitude at most `max_abs` (the 16-bit type the GPU rounds them to holds them); `why` gives it.
void require_magnitude_at_most(const NpyArray& a, const std::string& name, double max_abs, const std::string& why);

// Dimension `axis` of `a` as an int, required in [lo, hi]; `what` names it ("Hq", "D").
int require_dim(const NpyArray& a, const std::string& name, size_t axis, const std::string& what, int64_t lo,
                int64_t hi);

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

}  // namespace treecp::cli
