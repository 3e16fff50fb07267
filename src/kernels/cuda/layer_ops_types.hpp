// The argument block of the CUDA short convolution (plain struct, no CUDA header, so the host emulation of the
// kernels in tests/test_gdn_cuda_emulated.cpp sees the same type). The calls: layer_ops.hpp.
#pragma once

#include <cstdint>

#include "kernels/cuda/dtype.hpp"
#include "kernels/shapes.hpp"

namespace treecp::cuda {

// kernels/cpu/conv1d.hpp's Conv1dParams on the device: x [rows][C] (the outputs' rows, then halo rows), prev [rows]
// (a row's logical predecessor or -1, checked on the host by the caller), weight [C][width], bias [C] or null; x,
// weight, bias and the output y 16-bit of type `dtype` (bf16 or fp16).
struct Conv1dDeviceParams {
  const uint16_t* x = nullptr;
  const int64_t* prev = nullptr;
  const uint16_t* weight = nullptr;
  const uint16_t* bias = nullptr;
  int64_t out_rows = 0;
  ConvShape shape;
  DType dtype = DType::kBf16;
};

}  // namespace treecp::cuda
