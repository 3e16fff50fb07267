#include "comm/nccl_mpi.hpp"

#include <cuda_runtime.h>

#include <string>

#include "core/error.hpp"

namespace treecp {

namespace {
void check_mpi(int rc, const char* call) {
  if (rc != MPI_SUCCESS) fail(call, " failed (MPI error ", rc, ")");
}
}  // namespace

int local_rank(MPI_Comm comm) {
  MPI_Comm node;
  check_mpi(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node), "MPI_Comm_split_type");
  int r = 0;
  check_mpi(MPI_Comm_rank(node, &r), "MPI_Comm_rank");
  MPI_Comm_free(&node);
  return r;
}

std::unique_ptr<NcclCommunicator> make_nccl_communicator(MPI_Comm comm, const NcclOptions& options) {
  int rank = 0, size = 1, devices = 0;
  check_mpi(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(comm, &size), "MPI_Comm_size");
  const cudaError_t st = cudaGetDeviceCount(&devices);
  // Every rank learns whether every rank has a GPU before the id travels, so none waits in NCCL's init.
  int ok = st == cudaSuccess && devices > 0 ? 1 : 0, all_ok = 0;
  check_mpi(MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, comm), "MPI_Allreduce");
  if (!ok) fail("rank ", rank, ": no CUDA device (", st == cudaSuccess ? "none found" : cudaGetErrorString(st), ")");
  if (!all_ok) fail("rank ", rank, ": another rank has no CUDA device");
  NcclUniqueId id;
  if (rank == 0) id = make_nccl_unique_id();
  check_mpi(MPI_Bcast(id.bytes.data(), static_cast<int>(id.bytes.size()), MPI_BYTE, 0, comm), "MPI_Bcast");
  return std::make_unique<NcclCommunicator>(id, rank, size, local_rank(comm) % devices, options);
}

}  // namespace treecp
