// comm/: a narrow communicator (all-to-all with per-peer counts, grouped send/receive, all-reduce,
// all-gather, barrier, agreement) and its MPI, NCCL and thread implementations.
//
// Ranks as threads of one process: a Communicator per rank over a shared hub, host memory (all-to-all
// parts may move through a caller's copy function instead: ThreadCommOptions::copy). It serves
// tests of the protocol code (many rank counts in one process, no MPI) and in-process multi-rank runs.
//
// Started exchanges complete late and out of order on purpose when `late` is set: nothing lands before its
// receiver calls wait(), and a delivery thread copies the parts of every started all-to-all one at a time,
// in random order across all exchanges in flight, each after a random pause (a sender's wait() returns
// once everything it sent has landed, so it may block until its receivers wait). A protocol that reads a received buffer, or reuses a sent one,
// before the exchange's wait() then sees wrong values, which is what the tests of the stream-ordered
// protocol rely on. The blocking collectives (all_reduce_sum, all_gather, barrier, group_send_recv)
// complete inside the call.
//
// Collectives are matched by their position in each rank's sequence of calls (the Communicator
// contract); a rank calling another collective than its peers at the same position gets an Error naming
// both. A wait longer than `timeout_s` throws an Error naming the call and the ranks not yet arrived.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "comm/communicator.hpp"

namespace treecp {

struct ThreadCommOptions {
  bool late = false;           // started exchanges complete late (at the receiver's wait) and out of order
  uint64_t seed = 1;           // of the delivery order and pauses
  int max_pause_us = 200;      // pause before each delivered part, uniform in [0, max_pause_us]
  double timeout_s = 60.0;     // deadline of every wait
  // How an all-to-all part moves (default: memcpy). Tests of a GPU backend on one device pass a copy that
  // first waits for the device (the sender's packing) and then copies device memory.
  std::function<void(void* dst, const void* src, size_t bytes)> copy;
};

// One communicator per rank; use communicator r from one thread at a time (rank r's thread).
std::vector<std::unique_ptr<Communicator>> make_thread_communicators(int ranks, const ThreadCommOptions& options = {});

}  // namespace treecp
