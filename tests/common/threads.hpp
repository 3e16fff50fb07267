// Ranks as threads of one process over the thread communicator (comm/thread_communicator.hpp): the CPU
// suite's multi-rank runtime tests and the GPU tests' ranks sharing one device.
#pragma once

#include <exception>
#include <functional>
#include <thread>
#include <vector>

#include "comm/thread_communicator.hpp"

namespace treecp::testing {

// Runs body(rank, comm) on `ranks` threads; rethrows the first failure.
inline void on_threads(int ranks, const ThreadCommOptions& opt, const std::function<void(int, Communicator&)>& body) {
  auto comms = make_thread_communicators(ranks, opt);
  std::vector<std::exception_ptr> errors(static_cast<size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(r, *comms[static_cast<size_t>(r)]);
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace treecp::testing
