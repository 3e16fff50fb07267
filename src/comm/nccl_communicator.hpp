// comm/: a narrow communicator (all-to-all with per-peer counts, grouped send/receive, all-reduce,
// all-gather, barrier, agreement) and its MPI, NCCL and thread implementations.
//
// The NCCL backend of Communicator (GPU ranks, one process per GPU, device buffers).
//
// Stream order: exchanges run on a communication stream of their own. A started exchange waits (on the
// device) for everything enqueued so far on the compute stream it is bound to, and its wait() makes the
// compute stream wait for it; neither blocks the host. All-to-all-v is grouped ncclSend/ncclRecv with the
// zero-sized parts left out (both ends know every pair's count, so they leave out the same ones) and the
// self part a device copy. all_reduce_sum, all_gather and barrier accept device or host pointers; with
// host pointers (agreements, statistics) they stage through device memory and wait on the host.
//
// Failures: every NCCL and CUDA call is checked. The communicator is non-blocking, and every host wait
// (a host-pointer collective, synchronize(), initialisation) polls ncclCommGetAsyncError against a
// deadline; a watchdog thread does the same for exchanges in flight. A call that has not completed by the
// deadline, or an asynchronous NCCL error, aborts the communicator (ncclCommAbort, so that device work
// waiting on it ends) and the next call on any thread throws an Error naming the rank and the call:
// a failed or stalled peer ends the job with one line, never a hang.
//
// Bootstrap: from a unique id that rank 0 made (make_nccl_unique_id) and the caller shared (over MPI:
// comm/nccl_mpi.hpp; over a torch process group: the Python package).
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <memory>
#include <string>

#include "comm/communicator.hpp"

namespace treecp {

struct NcclUniqueId {
  std::array<char, 128> bytes{};  // NCCL_UNIQUE_ID_BYTES
};
NcclUniqueId make_nccl_unique_id();

struct NcclOptions {
  double timeout_s = 300.0;  // deadline of every wait and of every exchange in flight
};

class NcclCommunicator final : public Communicator {
 public:
  // Joins the communicator `id` as `rank` of `size` on CUDA device `device` (made current on this thread).
  NcclCommunicator(const NcclUniqueId& id, int rank, int size, int device, const NcclOptions& options = {});
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override;
  int size() const override;
  int device() const;
  // The stream the backend enqueues compute on (CudaBackend::stream()); exchanges order against it.
  void set_compute_stream(cudaStream_t stream);
  cudaStream_t comm_stream() const;

  void all_to_all_v(const void* send, const std::vector<int64_t>& send_counts, const std::vector<int64_t>& send_displs,
                    void* recv, const std::vector<int64_t>& recv_counts, const std::vector<int64_t>& recv_displs,
                    CommType type) override;
  std::unique_ptr<Pending> start_all_to_all_v(const void* send, const std::vector<int64_t>& send_counts,
                                              const std::vector<int64_t>& send_displs, void* recv,
                                              const std::vector<int64_t>& recv_counts,
                                              const std::vector<int64_t>& recv_displs, CommType type) override;
  void group_send_recv(const std::vector<P2POp>& ops, CommType type) override;  // device buffers
  void all_reduce_sum(void* data, int64_t count, CommType type) override;
  void all_gather(const void* send, void* recv, int64_t count, CommType type) override;
  void barrier() override;

  // Host wait for everything enqueued on the compute and communication streams, against the deadline.
  void synchronize();
  // Throws the error that aborted this communicator, if one did.
  void check() const;

  struct State;

 private:
  std::shared_ptr<State> s_;
};

}  // namespace treecp
