// comm/: a narrow communicator (all-to-all with per-peer counts, grouped send/receive, all-reduce,
// all-gather, barrier, agreement) and its MPI, NCCL and thread implementations.
//
// Bootstrap of the NCCL communicator under mpirun: one process per GPU, rank 0's unique id broadcast over
// MPI, each rank on the GPU of its node-local rank (modulo the node's GPU count). Compiled with MPI and NCCL.
#pragma once

#include <mpi.h>

#include <memory>

#include "comm/nccl_communicator.hpp"

namespace treecp {

// Collective over `comm` (MPI must be initialised).
std::unique_ptr<NcclCommunicator> make_nccl_communicator(MPI_Comm comm, const NcclOptions& options = {});

// The node-local rank of this process in `comm` and the CUDA device it takes (local rank % device count).
int local_rank(MPI_Comm comm);

}  // namespace treecp
