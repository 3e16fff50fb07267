#include "comm/thread_communicator.hpp"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>

#include "core/error.hpp"

namespace treecp {
namespace {

using Clock = std::chrono::steady_clock;

// What one rank posted for one collective.
struct Post {
  std::string call;
  const void* send = nullptr;
  void* recv = nullptr;
  std::vector<int64_t> send_counts, send_displs, recv_counts, recv_displs;  // all-to-all
  std::vector<P2POp> ops;                                                   // group_send_recv
  int64_t count = 0;                                                        // reductions, gathers
  CommType type = CommType::U8;
};

// One collective (by sequence number): every rank's post, and the parts of an all-to-all still to deliver.
struct Collective {
  std::vector<bool> posted;
  std::vector<Post> posts;
  int arrived = 0;
  int left = 0;             // ranks that have not yet finished with it
  int exited = 0;           // ranks out of leave()'s wait (it is erased when all are and all is delivered)
  std::string error;        // set when the ranks disagree: every rank waiting on it throws it
  int undelivered = 0;      // all-to-all parts still to copy
  std::vector<int> pending_in, pending_out;  // per rank: undelivered parts into / out of it
  std::vector<bool> receiving;               // per rank: has called wait() (late mode delivers to it only then)
  bool queued = false;      // all-to-all parts handed to the delivery thread
};

class Hub {
 public:
  Hub(int n, const ThreadCommOptions& o) : n_(n), opt_(o), rng_(o.seed) {
    if (opt_.late) delivery_ = std::thread([this] { deliver(); });
  }
  ~Hub() {
    {
      std::lock_guard<std::mutex> lock(m_);
      stop_ = true;
    }
    cv_.notify_all();
    if (delivery_.joinable()) delivery_.join();
  }
  int size() const { return n_; }

  // Registers rank r's post for collective `seq`; returns once every rank has posted it.
  Collective& arrive(int r, uint64_t seq, Post post) {
    std::unique_lock<std::mutex> lock(m_);
    Collective& c = collective(seq);
    c.posted[static_cast<size_t>(r)] = true;
    c.posts[static_cast<size_t>(r)] = std::move(post);
    ++c.arrived;
    const std::string& mine = c.posts[static_cast<size_t>(r)].call;
    for (int p = 0; p < n_ && c.error.empty(); ++p) {
      if (c.posted[static_cast<size_t>(p)] && c.posts[static_cast<size_t>(p)].call != mine) {
        c.error = "thread communicator: rank " + std::to_string(r) + " called " + mine + " where rank " +
                  std::to_string(p) + " called " + c.posts[static_cast<size_t>(p)].call + " (collective " +
                  std::to_string(seq) + ")";
      }
    }
    cv_.notify_all();
    wait_for(lock, r, seq, mine, [&] { return c.arrived == n_; });
    return c;
  }

  // Rank r is done with collective `seq` once every rank is (so that no post is read after its owner moves
  // on): a barrier on the way out.
  void leave(int r, uint64_t seq) {
    std::unique_lock<std::mutex> lock(m_);
    Collective& c = collective(seq);
    --c.left;
    cv_.notify_all();
    wait_for(lock, r, seq, c.posts[static_cast<size_t>(r)].call, [&] { return c.left <= 0; });
    ++c.exited;
    finished(seq);
  }

  // All-to-all parts of `seq`: copied at once (not late) or handed to the delivery thread.
  void start_exchange(uint64_t seq) {
    std::unique_lock<std::mutex> lock(m_);
    Collective& c = collective(seq);
    if (c.queued) return;
    c.queued = true;
    c.pending_in.assign(static_cast<size_t>(n_), 0);
    c.pending_out.assign(static_cast<size_t>(n_), 0);
    c.receiving.assign(static_cast<size_t>(n_), false);
    for (int s = 0; s < n_; ++s) {
      for (int d = 0; d < n_; ++d) {
        if (c.posts[static_cast<size_t>(s)].send_counts[static_cast<size_t>(d)] == 0) continue;
        ++c.undelivered;
        ++c.pending_in[static_cast<size_t>(d)];
        ++c.pending_out[static_cast<size_t>(s)];
        parts_.push_back({seq, s, d});
      }
    }
    if (!opt_.late) {
      while (!parts_.empty()) {
        const Part p = parts_.front();
        parts_.pop_front();
        copy_part(p);
      }
    }
    cv_.notify_all();
  }

  // Blocks until every part into and out of rank r of collective `seq` is delivered, then leaves it.
  void wait_exchange(int r, uint64_t seq) {
    std::unique_lock<std::mutex> lock(m_);
    Collective& c = collective(seq);
    c.receiving[static_cast<size_t>(r)] = true;
    cv_.notify_all();
    wait_for(lock, r, seq, "all_to_all_v",
             [&] { return c.pending_in[static_cast<size_t>(r)] == 0 && c.pending_out[static_cast<size_t>(r)] == 0; });
    --c.left;
    ++c.exited;
    finished(seq);
  }

 private:
  struct Part {
    uint64_t seq;
    int src, dst;
  };

  Collective& collective(uint64_t seq) {
    auto it = live_.find(seq);
    if (it == live_.end()) {
      Collective c;
      c.posted.assign(static_cast<size_t>(n_), false);
      c.posts.resize(static_cast<size_t>(n_));
      c.left = n_;
      it = live_.emplace(seq, std::move(c)).first;
    }
    return it->second;
  }
  void finished(uint64_t seq) {
    auto it = live_.find(seq);
    if (it != live_.end() && it->second.exited == n_ && it->second.undelivered == 0) live_.erase(it);
  }

  // Copies one part (the caller holds the lock; the copy itself needs none: its buffers are reserved).
  void copy_part(const Part& p) {
    Collective& c = live_.at(p.seq);
    const Post& s = c.posts[static_cast<size_t>(p.src)];
    const Post& d = c.posts[static_cast<size_t>(p.dst)];
    const size_t es = comm_type_size(s.type);
    const int64_t count = s.send_counts[static_cast<size_t>(p.dst)];
    void* to = static_cast<char*>(d.recv) + static_cast<size_t>(d.recv_displs[static_cast<size_t>(p.src)]) * es;
    const void* from =
        static_cast<const char*>(s.send) + static_cast<size_t>(s.send_displs[static_cast<size_t>(p.dst)]) * es;
    if (opt_.copy) {
      opt_.copy(to, from, static_cast<size_t>(count) * es);
    } else {
      std::memcpy(to, from, static_cast<size_t>(count) * es);
    }
    --c.undelivered;
    --c.pending_in[static_cast<size_t>(p.dst)];
    --c.pending_out[static_cast<size_t>(p.src)];
    finished(p.seq);
  }

  // Late mode: one part at a time, chosen at random among the parts (of any exchange in flight) whose
  // receiver is waiting for them, after a random pause.
  void deliver() {
    std::unique_lock<std::mutex> lock(m_);
    std::vector<size_t> ready;
    for (;;) {
      cv_.wait(lock, [&] {
        if (stop_) return true;
        ready.clear();
        for (size_t i = 0; i < parts_.size(); ++i)
          if (live_.at(parts_[i].seq).receiving[static_cast<size_t>(parts_[i].dst)]) ready.push_back(i);
        return !ready.empty();
      });
      if (stop_) return;
      const size_t i = ready[std::uniform_int_distribution<size_t>(0, ready.size() - 1)(rng_)];
      const Part p = parts_[i];
      parts_.erase(parts_.begin() + static_cast<ptrdiff_t>(i));
      const int pause = std::uniform_int_distribution<int>(0, std::max(0, opt_.max_pause_us))(rng_);
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::microseconds(pause));
      lock.lock();
      copy_part(p);
      cv_.notify_all();
    }
  }

  template <class Pred>
  void wait_for(std::unique_lock<std::mutex>& lock, int r, uint64_t seq, const std::string& call, Pred done) {
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(opt_.timeout_s));
    const Collective& c = live_.at(seq);
    const bool ok = cv_.wait_until(lock, deadline, [&] { return !c.error.empty() || done(); });
    if (!c.error.empty()) fail(c.error);
    if (ok) return;
    std::string missing;
    for (int p = 0; p < n_; ++p)
      if (!c.posted[static_cast<size_t>(p)]) missing += (missing.empty() ? "" : ", ") + std::to_string(p);
    fail("thread communicator: rank ", r, ": ", call, " (collective ", seq, ") did not complete within ",
         opt_.timeout_s, " s", missing.empty() ? std::string() : "; ranks not arrived: " + missing);
  }

  const int n_;
  const ThreadCommOptions opt_;
  std::mutex m_;
  std::condition_variable cv_;
  std::map<uint64_t, Collective> live_;
  std::deque<Part> parts_;
  std::mt19937_64 rng_;
  bool stop_ = false;
  std::thread delivery_;
};

class ThreadPending final : public Communicator::Pending {
 public:
  ThreadPending(std::shared_ptr<Hub> hub, int rank, uint64_t seq) : hub_(std::move(hub)), rank_(rank), seq_(seq) {}
  ~ThreadPending() override {
    if (waiting_) {
      try {
        hub_->wait_exchange(rank_, seq_);  // an abandoned exchange still completes: its buffers are the caller's
      } catch (...) {
      }
    }
  }
  void wait() override {
    if (!waiting_) return;
    waiting_ = false;
    hub_->wait_exchange(rank_, seq_);
  }

 private:
  std::shared_ptr<Hub> hub_;
  int rank_;
  uint64_t seq_;
  bool waiting_ = true;
};

class ThreadCommunicator final : public Communicator {
 public:
  ThreadCommunicator(std::shared_ptr<Hub> hub, int rank) : hub_(std::move(hub)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return hub_->size(); }

  void all_to_all_v(const void* send, const std::vector<int64_t>& send_counts, const std::vector<int64_t>& send_displs,
                    void* recv, const std::vector<int64_t>& recv_counts, const std::vector<int64_t>& recv_displs,
                    CommType type) override {
    start_all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs, type)->wait();
  }

  std::unique_ptr<Pending> start_all_to_all_v(const void* send, const std::vector<int64_t>& send_counts,
                                              const std::vector<int64_t>& send_displs, void* recv,
                                              const std::vector<int64_t>& recv_counts,
                                              const std::vector<int64_t>& recv_displs, CommType type) override {
    const size_t n = static_cast<size_t>(size());
    require(send_counts.size() == n && send_displs.size() == n && recv_counts.size() == n && recv_displs.size() == n,
            "all_to_all_v: one count and displacement per rank expected (", n, " ranks)");
    Post post;
    post.call = "all_to_all_v";
    post.send = send;
    post.recv = recv;
    post.send_counts = send_counts;
    post.send_displs = send_displs;
    post.recv_counts = recv_counts;
    post.recv_displs = recv_displs;
    post.type = type;
    const uint64_t seq = seq_++;
    Collective& c = hub_->arrive(rank_, seq, std::move(post));
    // Every rank has posted: the pair counts must agree before anything moves.
    for (size_t p = 0; p < n; ++p) {
      require(c.posts[p].send_counts[static_cast<size_t>(rank_)] == recv_counts[p], "all_to_all_v: rank ", p,
              " sends ", c.posts[p].send_counts[static_cast<size_t>(rank_)], " elements to rank ", rank_,
              ", which expects ", recv_counts[p]);
    }
    hub_->start_exchange(seq);
    return std::make_unique<ThreadPending>(hub_, rank_, seq);
  }

  void group_send_recv(const std::vector<P2POp>& ops, CommType type) override {
    Post post;
    post.call = "group_send_recv";
    post.ops = ops;
    post.type = type;
    const uint64_t seq = seq_++;
    Collective& c = hub_->arrive(rank_, seq, std::move(post));
    // The k-th receive from p meets p's k-th send to this rank.
    std::map<int, int> nth;
    for (const P2POp& op : ops) {
      if (op.kind != P2POp::Kind::Recv) continue;
      require(op.peer >= 0 && op.peer < size(), "group_send_recv: peer ", op.peer, " out of range");
      const int k = nth[op.peer]++;
      int seen = 0;
      const P2POp* match = nullptr;
      for (const P2POp& s : c.posts[static_cast<size_t>(op.peer)].ops) {
        if (s.kind == P2POp::Kind::Send && s.peer == rank_ && seen++ == k) {
          match = &s;
          break;
        }
      }
      require(match != nullptr, "group_send_recv: rank ", rank_, " receives from ", op.peer, " a message it does not send");
      require(match->count == op.count, "group_send_recv: rank ", op.peer, " sends ", match->count, " elements, rank ",
              rank_, " receives ", op.count);
      std::memcpy(op.buffer, match->buffer, static_cast<size_t>(op.count) * comm_type_size(type));
    }
    hub_->leave(rank_, seq);
  }

  void all_reduce_sum(void* data, int64_t count, CommType type) override {
    require(type != CommType::BF16 && type != CommType::U8, "all_reduce_sum: sums of this type are not supported");
    Post post;
    post.call = "all_reduce_sum";
    post.recv = data;
    post.count = count;
    post.type = type;
    const uint64_t seq = seq_++;
    Collective& c = hub_->arrive(rank_, seq, std::move(post));
    // Sum in rank order (the same order on every rank, so every rank gets the same bits) into a copy;
    // write it only after every rank has read every input.
    std::vector<char> sum(static_cast<size_t>(count) * comm_type_size(type));
    for (int p = 0; p < size(); ++p) {
      require(c.posts[static_cast<size_t>(p)].count == count, "all_reduce_sum: rank ", p, " reduces ",
              c.posts[static_cast<size_t>(p)].count, " elements, rank ", rank_, " ", count);
      add(sum.data(), c.posts[static_cast<size_t>(p)].recv, count, type, p == 0);
    }
    hub_->leave(rank_, seq);  // every rank has read every input
    if (!sum.empty()) std::memcpy(data, sum.data(), sum.size());
  }

  void all_gather(const void* send, void* recv, int64_t count, CommType type) override {
    Post post;
    post.call = "all_gather";
    post.send = send;
    post.count = count;
    post.type = type;
    const uint64_t seq = seq_++;
    Collective& c = hub_->arrive(rank_, seq, std::move(post));
    const size_t es = comm_type_size(type);
    std::vector<char> out(static_cast<size_t>(count * size()) * es);
    for (int p = 0; p < size(); ++p) {
      require(c.posts[static_cast<size_t>(p)].count == count, "all_gather: rank ", p, " gives ",
              c.posts[static_cast<size_t>(p)].count, " elements, rank ", rank_, " ", count);
      if (count > 0)
        std::memcpy(out.data() + static_cast<size_t>(p * count) * es, c.posts[static_cast<size_t>(p)].send,
                    static_cast<size_t>(count) * es);
    }
    hub_->leave(rank_, seq);  // every rank has read every input (recv may alias send)
    if (!out.empty()) std::memcpy(recv, out.data(), out.size());
  }

  void barrier() override {
    Post post;
    post.call = "barrier";
    const uint64_t seq = seq_++;
    hub_->arrive(rank_, seq, std::move(post));
    hub_->leave(rank_, seq);
  }

 private:
  static void add(char* acc, const void* src, int64_t count, CommType type, bool first) {
    auto run = [&](auto tag) {
      using V = decltype(tag);
      V* a = reinterpret_cast<V*>(acc);
      const V* s = static_cast<const V*>(src);
      for (int64_t i = 0; i < count; ++i) a[i] = first ? s[i] : a[i] + s[i];
    };
    switch (type) {
      case CommType::F32: run(float{}); break;
      case CommType::F64: run(double{}); break;
      case CommType::I64: run(int64_t{}); break;
      default: fail("all_reduce_sum: unsupported type");
    }
  }

  std::shared_ptr<Hub> hub_;
  int rank_;
  uint64_t seq_ = 0;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_thread_communicators(int ranks, const ThreadCommOptions& options) {
  require(ranks >= 1, "make_thread_communicators: ranks must be >= 1, got ", ranks);
  auto hub = std::make_shared<Hub>(ranks, options);
  std::vector<std::unique_ptr<Communicator>> out;
  for (int r = 0; r < ranks; ++r) out.push_back(std::make_unique<ThreadCommunicator>(hub, r));
  return out;
}

}  // namespace treecp
