// `--ranks N` on the command line: when the process was not started by mpirun, start N copies of
// this same command under mpirun and wait for them.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.hpp"
#include "core/error.hpp"

namespace treecp::cli {

// True when this process is one rank of an MPI job (started by mpirun/mpiexec).
bool started_under_mpi();

// If ranks > 1 and this process is not already an MPI rank, runs
// `mpirun -np ranks <this executable> <command words> <argv...>`, stores its exit code in *rc and
// returns true; otherwise returns false and the caller runs as a rank itself.
bool relaunch_under_mpi(const std::string& command, int ranks, const std::vector<std::string>& argv, int* rc);

// The ranks this process belongs to: under mpirun, MPI is initialised (and finalised when this goes
// away) and comm() spans MPI_COMM_WORLD; otherwise a single rank. Throws unless there are `ranks`.
class RankGroup {
 public:
  explicit RankGroup(int64_t ranks);
  Communicator& comm() { return *comm_; }

  // Runs body(comm()) and returns its result. In a job of several ranks an error on one rank would
  // leave the others waiting in a collective forever: the error is printed with its rank and the
  // whole job is aborted (MPI_Abort) instead. With one rank the error propagates as usual.
  int run(const std::function<int(Communicator&)>& body);

 private:
  std::shared_ptr<void> session_;       // the MPI session, when there is one
  std::unique_ptr<Communicator> comm_;  // declared last: released before the session finalises MPI
};

// Every rank reads the same input files with `load`; the ranks agree on the outcome before any other
// collective, so a rank that cannot read them makes every rank fail with its message.
template <class Load>
auto load_on_every_rank(Communicator& comm, Load load) -> decltype(load()) {
  decltype(load()) out{};
  std::string error;
  try {
    out = load();
  } catch (const Error& e) {
    error = e.what();
  }
  if (!comm.all_ok(error.empty())) fail(error.empty() ? "another rank could not read the inputs" : error);
  return out;
}

}  // namespace treecp::cli
