#include "comm/communicator.hpp"

#include <cstring>
#include <utility>

#include "core/error.hpp"

namespace treecp {

size_t comm_type_size(CommType t) {
  switch (t) {
    case CommType::F32: return 4;
    case CommType::F64: return 8;
    case CommType::I64: return 8;
    case CommType::U8: return 1;
    case CommType::BF16: return 2;
  }
  return 0;
}

void Communicator::set_timeout_s(double seconds) {
  require(seconds > 0 && seconds <= 1e7, "communicator timeout must be in (0, 1e7] seconds, got ", seconds);
  timeout_s_ = seconds;
}

Error Communicator::deadline_error(const std::string& call, const std::vector<int>& missing) const {
  std::string who;
  for (size_t i = 0; i < missing.size(); ++i) who += (i ? ", " : "") + std::to_string(missing[i]);
  if (missing.empty()) {
    return Error(detail::concat(call, ": every rank arrived but the call did not finish within the ", timeout_s_,
                                " s timeout"));
  }
  return Error(detail::concat(call, ": ", missing.size() == 1 ? "rank " : "ranks ", who, " did not arrive within the ",
                              timeout_s_, " s timeout"));
}

bool Communicator::all_ok(bool ok) {
  int64_t failures = ok ? 0 : 1;
  all_reduce_sum(&failures, 1, CommType::I64);
  return failures == 0;
}

namespace {

class SelfCommunicator final : public Communicator {
 public:
  explicit SelfCommunicator(SelfCommOptions options) : opt_(std::move(options)) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void all_to_all_v(const void* send, const std::vector<int64_t>& send_counts, const std::vector<int64_t>& send_displs,
                    void* recv, const std::vector<int64_t>& recv_counts, const std::vector<int64_t>& recv_displs,
                    CommType type) override {
    require(send_counts.size() == 1 && recv_counts.size() == 1 && send_displs.size() == 1 && recv_displs.size() == 1,
            "all_to_all_v: one count and displacement per rank expected");
    require(send_counts[0] == recv_counts[0], "all_to_all_v: send count ", send_counts[0],
            " != receive count ", recv_counts[0]);
    const size_t es = comm_type_size(type);
    if (send_counts[0] > 0) {
      move(static_cast<char*>(recv) + recv_displs[0] * es, static_cast<const char*>(send) + send_displs[0] * es,
           static_cast<size_t>(send_counts[0]) * es);
    }
  }
  void group_send_recv(const std::vector<P2POp>& ops, CommType type) override {
    // Only self-sends are possible: pair them in order.
    std::vector<const P2POp*> sends, recvs;
    for (const auto& op : ops) {
      require(op.peer == 0, "group_send_recv: peer ", op.peer, " out of range for 1 rank");
      (op.kind == P2POp::Kind::Send ? sends : recvs).push_back(&op);
    }
    require(sends.size() == recvs.size(), "group_send_recv: unmatched self send/receive");
    for (size_t i = 0; i < sends.size(); ++i) {
      require(sends[i]->count == recvs[i]->count, "group_send_recv: self send/receive counts differ");
      move(recvs[i]->buffer, sends[i]->buffer, static_cast<size_t>(sends[i]->count) * comm_type_size(type));
    }
  }
  void all_reduce_sum(void*, int64_t, CommType) override {}
  void all_gather(const void* send, void* recv, int64_t count, CommType type) override {
    if (count > 0 && send != recv) move(recv, send, static_cast<size_t>(count) * comm_type_size(type));
  }
  void barrier() override {}

 private:
  void move(void* dst, const void* src, size_t bytes) const {
    if (bytes == 0 || dst == src) return;
    if (opt_.copy)
      opt_.copy(dst, src, bytes);
    else
      std::memmove(dst, src, bytes);
  }

  SelfCommOptions opt_;
};

}  // namespace

std::unique_ptr<Communicator> make_self_communicator(SelfCommOptions options) {
  return std::make_unique<SelfCommunicator>(std::move(options));
}

}  // namespace treecp
