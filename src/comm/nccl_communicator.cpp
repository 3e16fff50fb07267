#include "comm/nccl_communicator.hpp"

#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <list>
#include <mutex>
#include <thread>

#include "core/error.hpp"

namespace treecp {

namespace {

using Clock = std::chrono::steady_clock;

void check_cuda_call(cudaError_t st, const char* what) {
  if (st != cudaSuccess) fail("NCCL communicator: ", what, ": ", cudaGetErrorString(st));
}

ncclDataType_t nccl_type(CommType t) {
  switch (t) {
    case CommType::F32: return ncclFloat32;
    case CommType::F64: return ncclFloat64;
    case CommType::I64: return ncclInt64;
    case CommType::U8: return ncclUint8;
    case CommType::BF16: return ncclBfloat16;
  }
  fail("NCCL communicator: unknown CommType");
}

bool is_device_pointer(const void* p) {
  if (p == nullptr) return false;
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

}  // namespace

NcclUniqueId make_nccl_unique_id() {
  static_assert(sizeof(ncclUniqueId) == sizeof(NcclUniqueId::bytes), "NCCL_UNIQUE_ID_BYTES changed");
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) fail("NCCL: ncclGetUniqueId failed: ", ncclGetErrorString(r));
  NcclUniqueId out;
  std::memcpy(out.bytes.data(), &id, sizeof(id));
  return out;
}

// One exchange or collective in flight, watched until its completion event fires.
struct Op {
  std::string name;
  cudaEvent_t done = nullptr;
  Clock::time_point started;
  ~Op() {
    if (done) cudaEventDestroy(done);  // released by the driver once the event has fired
  }
};

struct NcclCommunicator::State {
  ncclComm_t comm = nullptr;
  int rank = 0, size = 1, device = 0;
  NcclOptions opt;
  cudaStream_t comm_stream = nullptr;
  cudaStream_t compute = nullptr;
  uint64_t calls = 0;

  std::mutex m;  // guards everything below, and NCCL calls against the watchdog's abort
  std::list<std::shared_ptr<Op>> in_flight;
  std::string error;  // set once: the reason the communicator was aborted
  bool aborted = false, stop = false;
  std::condition_variable cv;
  std::thread watchdog;

  void* scratch = nullptr;  // device staging for host-pointer collectives
  size_t scratch_bytes = 0;

  std::string where(const std::string& call) const {
    return "NCCL rank " + std::to_string(rank) + " of " + std::to_string(size) + ": " + call;
  }

  // Under m: records the failure and aborts the communicator so that device work waiting on it ends.
  void abort_locked(const std::string& why) {
    if (error.empty()) error = why;
    if (!aborted && comm) {
      aborted = true;
      ncclCommAbort(comm);
      comm = nullptr;
    }
    cv.notify_all();
  }
  void throw_if_failed_locked() const {
    if (!error.empty()) throw Error(error);
  }

  // Under m: an NCCL call's result; ncclInProgress (non-blocking mode) is polled to its end against the
  // deadline.
  void settle_locked(std::unique_lock<std::mutex>& lock, ncclResult_t r, const std::string& call) {
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(opt.timeout_s));
    while (r == ncclInProgress) {
      if (Clock::now() > deadline) {
        abort_locked(where(call) + " did not return within " + std::to_string(opt.timeout_s) +
                     " s; communicator aborted");
        throw_if_failed_locked();
      }
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::microseconds(20));
      lock.lock();
      if (!comm) throw_if_failed_locked();
      ncclResult_t st = ncclSuccess;
      ncclCommGetAsyncError(comm, &st);
      r = st;
    }
    if (r != ncclSuccess) {
      abort_locked(where(call) + " failed: " + ncclGetErrorString(r) +
                   (r == ncclRemoteError || r == ncclSystemError ? " (a peer failed, exited or stopped)" : ""));
      throw_if_failed_locked();
    }
  }

  // Under m: the watchdog follows `op` from now on.
  void watch_locked(const std::string& call) {
    auto op = std::make_shared<Op>();
    op->name = call;
    op->started = Clock::now();
    check_cuda_call(cudaEventCreateWithFlags(&op->done, cudaEventDisableTiming), "event");
    check_cuda_call(cudaEventRecord(op->done, comm_stream), "record");
    in_flight.push_back(op);
    last = op;
    cv.notify_all();
  }
  std::shared_ptr<Op> last;  // the most recent op (its event is what a wait() orders on)

  void watch() {
    cudaSetDevice(device);
    std::unique_lock<std::mutex> lock(m);
    while (!stop) {
      cv.wait_for(lock, std::chrono::milliseconds(5));
      if (stop || aborted) continue;
      for (auto it = in_flight.begin(); it != in_flight.end();) {
        const cudaError_t q = cudaEventQuery((*it)->done);
        if (q == cudaSuccess) {
          it = in_flight.erase(it);
          continue;
        }
        if (q != cudaErrorNotReady) {
          abort_locked(where((*it)->name) + " failed on the device: " + cudaGetErrorString(q));
          break;
        }
        const double age = std::chrono::duration<double>(Clock::now() - (*it)->started).count();
        if (age > opt.timeout_s) {
          abort_locked(where((*it)->name) + " did not complete within " + std::to_string(opt.timeout_s) +
                       " s (a peer failed or stopped); communicator aborted");
          break;
        }
        ++it;
      }
      if (!aborted && comm && !in_flight.empty()) {
        ncclResult_t st = ncclSuccess;
        ncclCommGetAsyncError(comm, &st);
        if (st != ncclSuccess && st != ncclInProgress)
          abort_locked(where(in_flight.front()->name) + " failed: " + ncclGetErrorString(st) +
                       " (a peer failed, exited or stopped)");
      }
    }
  }

  // Host wait until `stream` has drained, against the deadline, watching for the watchdog's verdict.
  void host_wait(std::unique_lock<std::mutex>& lock, cudaStream_t stream, const std::string& call) {
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(opt.timeout_s));
    for (;;) {
      throw_if_failed_locked();
      const cudaError_t q = cudaStreamQuery(stream);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) {
        abort_locked(where(call) + " failed on the device: " + cudaGetErrorString(q));
        throw_if_failed_locked();
      }
      if (Clock::now() > deadline) {
        abort_locked(where(call) + " did not complete within " + std::to_string(opt.timeout_s) +
                     " s (a peer failed or stopped); communicator aborted");
        throw_if_failed_locked();
      }
      cv.wait_for(lock, std::chrono::microseconds(50));
    }
  }

  void* staging(size_t bytes) {
    if (bytes > scratch_bytes) {
      if (scratch) cudaFree(scratch);
      scratch = nullptr;
      check_cuda_call(cudaMalloc(&scratch, bytes), "staging allocation");
      scratch_bytes = bytes;
    }
    return scratch;
  }

  // The comm stream waits for the compute stream's work so far (the inputs of what is enqueued next).
  void order_after_compute() {
    cudaEvent_t e;
    check_cuda_call(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "event");
    check_cuda_call(cudaEventRecord(e, compute), "record on the compute stream");
    check_cuda_call(cudaStreamWaitEvent(comm_stream, e, 0), "wait on the comm stream");
    cudaEventDestroy(e);
  }
};

namespace {

class NcclPending final : public Communicator::Pending {
 public:
  NcclPending(std::shared_ptr<NcclCommunicator::State> s, std::shared_ptr<Op> op) : s_(std::move(s)), op_(std::move(op)) {}
  ~NcclPending() override {
    if (op_) {
      try {
        wait();  // an abandoned exchange still orders later compute after it: its buffers are the caller's
      } catch (...) {
      }
    }
  }
  void wait() override {
    if (!op_) return;
    std::lock_guard<std::mutex> lock(s_->m);
    s_->throw_if_failed_locked();
    check_cuda_call(cudaStreamWaitEvent(s_->compute, op_->done, 0), "wait on the compute stream");
    op_.reset();
  }

 private:
  std::shared_ptr<NcclCommunicator::State> s_;
  std::shared_ptr<Op> op_;
};

}  // namespace

NcclCommunicator::NcclCommunicator(const NcclUniqueId& id, int rank, int size, int device, const NcclOptions& options)
    : s_(std::make_shared<State>()) {
  require(size >= 1 && rank >= 0 && rank < size, "NcclCommunicator: rank ", rank, " of ", size, " is out of range");
  require(options.timeout_s > 0, "NcclCommunicator: timeout_s must be > 0, got ", options.timeout_s);
  s_->rank = rank;
  s_->size = size;
  s_->device = device;
  s_->opt = options;
  check_cuda_call(cudaSetDevice(device), "cudaSetDevice");
  check_cuda_call(cudaStreamCreateWithFlags(&s_->comm_stream, cudaStreamNonBlocking), "stream");
  ncclUniqueId nid;
  std::memcpy(&nid, id.bytes.data(), sizeof(nid));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every call returns; waits poll against the deadline
  {
    std::unique_lock<std::mutex> lock(s_->m);
    const ncclResult_t r = ncclCommInitRankConfig(&s_->comm, size, nid, rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      fail(s_->where("ncclCommInitRankConfig"), " failed: ", ncclGetErrorString(r));
    }
    try {
      s_->settle_locked(lock, r, "ncclCommInitRankConfig");
    } catch (...) {
      cudaStreamDestroy(s_->comm_stream);
      throw;
    }
  }
  State* st = s_.get();
  s_->watchdog = std::thread([st] { st->watch(); });
}

NcclCommunicator::~NcclCommunicator() {
  {
    std::lock_guard<std::mutex> lock(s_->m);
    s_->stop = true;
    s_->cv.notify_all();
  }
  if (s_->watchdog.joinable()) s_->watchdog.join();
  std::unique_lock<std::mutex> lock(s_->m);
  if (s_->comm) {
    // Finalise (flushes what is in flight) within the deadline, else abort: a destructor must not hang.
    try {
      s_->host_wait(lock, s_->comm_stream, "shutdown");
      s_->settle_locked(lock, ncclCommFinalize(s_->comm), "ncclCommFinalize");
      ncclCommDestroy(s_->comm);
    } catch (...) {
      if (s_->comm) ncclCommAbort(s_->comm);
    }
    s_->comm = nullptr;
  }
  s_->in_flight.clear();
  s_->last.reset();
  if (s_->scratch) cudaFree(s_->scratch);
  if (s_->comm_stream) cudaStreamDestroy(s_->comm_stream);
}

int NcclCommunicator::rank() const { return s_->rank; }
int NcclCommunicator::size() const { return s_->size; }
int NcclCommunicator::device() const { return s_->device; }
cudaStream_t NcclCommunicator::comm_stream() const { return s_->comm_stream; }
void NcclCommunicator::set_compute_stream(cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(s_->m);
  s_->compute = stream;
}

void NcclCommunicator::check() const {
  std::lock_guard<std::mutex> lock(s_->m);
  s_->throw_if_failed_locked();
}

std::unique_ptr<Communicator::Pending> NcclCommunicator::start_all_to_all_v(
    const void* send, const std::vector<int64_t>& send_counts, const std::vector<int64_t>& send_displs, void* recv,
    const std::vector<int64_t>& recv_counts, const std::vector<int64_t>& recv_displs, CommType type) {
  const size_t n = static_cast<size_t>(s_->size);
  require(send_counts.size() == n && send_displs.size() == n && recv_counts.size() == n && recv_displs.size() == n,
          "all_to_all_v: one count and displacement per rank expected (", n, " ranks)");
  const size_t me = static_cast<size_t>(s_->rank);
  require(send_counts[me] == recv_counts[me], "all_to_all_v: self send count ", send_counts[me],
          " != self receive count ", recv_counts[me]);
  for (size_t p = 0; p < n; ++p)
    require(send_counts[p] >= 0 && recv_counts[p] >= 0 && send_displs[p] >= 0 && recv_displs[p] >= 0,
            "all_to_all_v: counts and displacements must be >= 0 (peer ", p, ")");
  const size_t es = comm_type_size(type);
  const ncclDataType_t dt = nccl_type(type);
  std::unique_lock<std::mutex> lock(s_->m);
  s_->throw_if_failed_locked();
  const std::string call = "all_to_all_v #" + std::to_string(++s_->calls);
  s_->order_after_compute();
  if (send_counts[me] > 0)
    check_cuda_call(cudaMemcpyAsync(static_cast<char*>(recv) + recv_displs[me] * es,
                                    static_cast<const char*>(send) + send_displs[me] * es,
                                    static_cast<size_t>(send_counts[me]) * es, cudaMemcpyDeviceToDevice,
                                    s_->comm_stream),
                    "self copy");
  bool any = false;
  for (size_t p = 0; p < n; ++p) any = any || (p != me && (send_counts[p] > 0 || recv_counts[p] > 0));
  if (any) {
    ncclResult_t r = ncclGroupStart();
    for (size_t p = 0; p < n && r == ncclSuccess; ++p) {
      if (p == me) continue;
      if (send_counts[p] > 0)
        r = ncclSend(static_cast<const char*>(send) + send_displs[p] * es, static_cast<size_t>(send_counts[p]), dt,
                     static_cast<int>(p), s_->comm, s_->comm_stream);
      if (r == ncclSuccess && recv_counts[p] > 0)
        r = ncclRecv(static_cast<char*>(recv) + recv_displs[p] * es, static_cast<size_t>(recv_counts[p]), dt,
                     static_cast<int>(p), s_->comm, s_->comm_stream);
    }
    const ncclResult_t end = ncclGroupEnd();
    s_->settle_locked(lock, r != ncclSuccess ? r : end, call);
  }
  s_->watch_locked(call);
  return std::make_unique<NcclPending>(s_, s_->last);
}

void NcclCommunicator::all_to_all_v(const void* send, const std::vector<int64_t>& send_counts,
                                    const std::vector<int64_t>& send_displs, void* recv,
                                    const std::vector<int64_t>& recv_counts, const std::vector<int64_t>& recv_displs,
                                    CommType type) {
  start_all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs, type)->wait();
}

void NcclCommunicator::group_send_recv(const std::vector<P2POp>& ops, CommType type) {
  for (const P2POp& op : ops) {
    require(op.peer >= 0 && op.peer < s_->size, "group_send_recv: peer ", op.peer, " out of range for ", s_->size,
            " ranks");
    require(op.count >= 0, "group_send_recv: count must be >= 0, got ", op.count);
    require(op.count == 0 || is_device_pointer(op.buffer), "group_send_recv: the NCCL communicator takes device buffers");
  }
  const ncclDataType_t dt = nccl_type(type);
  std::unique_lock<std::mutex> lock(s_->m);
  s_->throw_if_failed_locked();
  const std::string call = "group_send_recv #" + std::to_string(++s_->calls);
  s_->order_after_compute();
  ncclResult_t r = ncclGroupStart();
  for (const P2POp& op : ops) {
    if (r != ncclSuccess || op.count == 0) continue;
    r = op.kind == P2POp::Kind::Send
            ? ncclSend(op.buffer, static_cast<size_t>(op.count), dt, op.peer, s_->comm, s_->comm_stream)
            : ncclRecv(op.buffer, static_cast<size_t>(op.count), dt, op.peer, s_->comm, s_->comm_stream);
  }
  const ncclResult_t end = ncclGroupEnd();
  s_->settle_locked(lock, r != ncclSuccess ? r : end, call);
  s_->watch_locked(call);
  check_cuda_call(cudaStreamWaitEvent(s_->compute, s_->last->done, 0), "wait on the compute stream");
}

void NcclCommunicator::all_reduce_sum(void* data, int64_t count, CommType type) {
  require(count >= 0, "all_reduce_sum: count must be >= 0, got ", count);
  const size_t bytes = static_cast<size_t>(count) * comm_type_size(type);
  const bool host = count > 0 && !is_device_pointer(data);
  std::unique_lock<std::mutex> lock(s_->m);
  s_->throw_if_failed_locked();
  const std::string call = "all_reduce_sum #" + std::to_string(++s_->calls);
  void* buf = data;
  if (host) {
    buf = s_->staging(bytes);
    check_cuda_call(cudaMemcpyAsync(buf, data, bytes, cudaMemcpyHostToDevice, s_->comm_stream), "staging copy");
  } else {
    s_->order_after_compute();
  }
  if (count > 0)
    s_->settle_locked(lock, ncclAllReduce(buf, buf, static_cast<size_t>(count), nccl_type(type), ncclSum, s_->comm,
                                          s_->comm_stream),
                      call);
  s_->watch_locked(call);
  if (host) {
    check_cuda_call(cudaMemcpyAsync(data, buf, bytes, cudaMemcpyDeviceToHost, s_->comm_stream), "staging copy");
    s_->host_wait(lock, s_->comm_stream, call);
  } else {
    check_cuda_call(cudaStreamWaitEvent(s_->compute, s_->last->done, 0), "wait on the compute stream");
  }
}

void NcclCommunicator::all_gather(const void* send, void* recv, int64_t count, CommType type) {
  require(count >= 0, "all_gather: count must be >= 0, got ", count);
  const size_t bytes = static_cast<size_t>(count) * comm_type_size(type);
  const bool host = count > 0 && !is_device_pointer(recv);
  std::unique_lock<std::mutex> lock(s_->m);
  s_->throw_if_failed_locked();
  const std::string call = "all_gather #" + std::to_string(++s_->calls);
  char* out = static_cast<char*>(recv);
  const char* in = static_cast<const char*>(send);
  if (host) {
    char* stage = static_cast<char*>(s_->staging(bytes * static_cast<size_t>(s_->size + 1)));
    check_cuda_call(cudaMemcpyAsync(stage, send, bytes, cudaMemcpyHostToDevice, s_->comm_stream), "staging copy");
    in = stage;
    out = stage + bytes;
  } else {
    s_->order_after_compute();
  }
  if (count > 0)
    s_->settle_locked(lock, ncclAllGather(in, out, static_cast<size_t>(count), nccl_type(type), s_->comm,
                                          s_->comm_stream),
                      call);
  s_->watch_locked(call);
  if (host) {
    check_cuda_call(cudaMemcpyAsync(recv, out, bytes * static_cast<size_t>(s_->size), cudaMemcpyDeviceToHost,
                                    s_->comm_stream),
                    "staging copy");
    s_->host_wait(lock, s_->comm_stream, call);
  } else {
    check_cuda_call(cudaStreamWaitEvent(s_->compute, s_->last->done, 0), "wait on the compute stream");
  }
}

void NcclCommunicator::barrier() {
  int64_t one = 1;
  all_reduce_sum(&one, 1, CommType::I64);  // a host-pointer collective: returns when every rank has come
}

void NcclCommunicator::synchronize() {
  std::unique_lock<std::mutex> lock(s_->m);
  s_->host_wait(lock, s_->compute, "synchronize (compute stream)");
  s_->host_wait(lock, s_->comm_stream, "synchronize (communication stream)");
}

}  // namespace treecp
