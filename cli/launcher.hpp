// `--ranks N` on the command line: when the process was not started by mpirun, start N copies of
// this same command under mpirun and wait for them.
#pragma once

#include <string>
#include <vector>

namespace treecp::cli {

// True when this process is one rank of an MPI job (started by mpirun/mpiexec).
bool started_under_mpi();

// If ranks > 1 and this process is not already an MPI rank, runs
// `mpirun -np ranks <this executable> <command words> <argv...>`, stores its exit code in *rc and
// returns true; otherwise returns false and the caller runs as a rank itself.
bool relaunch_under_mpi(const std::string& command, int ranks, const std::vector<std::string>& argv, int* rc);

}  // namespace treecp::cli
