// `--ranks N` on the command line: a command checks everything first (its boundary), then, when the
// process was not started by mpirun, starts N copies of itself under mpirun and waits for them. An
// error reaches the user once, as one line, without mpirun's banner: every rank reports how it ended
// into a directory the launcher made (kReportEnv), and the launcher prints the lowest rank's error.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "checks.hpp"
#include "command.hpp"
#include "output_dir.hpp"
#include "comm/communicator.hpp"
#include "core/error.hpp"

namespace treecp::cli {

// True when this process is one rank of an MPI job (started by mpirun/mpiexec).
bool started_under_mpi();

// Runs `mpirun -np ranks.count <this executable> <command words> <argv...>` and waits for it. A rank's
// error comes back thrown as treecp::Error (the lowest rank's, once); mpirun's own output, its abort
// banner included, goes to a log that is kept (and named) only when a rank ended without reporting.
// With `out`, the ranks write into its staging directory and it is committed only when every rank
// ended with status 0. Returns the ranks' exit status (the largest).
int run_under_mpirun(const std::string& command, const RankOptions& ranks, const std::vector<std::string>& argv,
                     OutputDir* out = nullptr);
constexpr const char* kReportEnv = "TREECP_REPORT_DIR";

// An error every rank raised together, after agreeing on it (agree()): reported once, and the ranks
// end normally instead of aborting the job.
class AgreedError : public Error {
 public:
  using Error::Error;
};

// Runs `fn` on every rank and agrees on the outcome before any other collective: when it fails
// anywhere, every rank throws AgreedError with the message of the lowest rank that failed ("rank 2: ..."
// when not every rank failed).
void agree(Communicator& comm, const std::function<void()>& fn);

// The ranks this process belongs to: under mpirun, MPI is initialised (and finalised when this goes
// away) and comm() spans MPI_COMM_WORLD with the --timeout deadline; otherwise a single rank. Throws
// unless there are ranks.count of them.
class RankGroup {
 public:
  explicit RankGroup(const RankOptions& ranks);
  Communicator& comm() { return *comm_; }

  // Runs body(comm()) and returns its result. In a job of several ranks an error on one rank would
  // leave the others waiting in a collective: it is reported (to the launcher, or printed with its
  // rank) and the whole job is aborted (MPI_Abort). An AgreedError is reported once and returned as
  // status 1 on every rank. With one rank errors propagate as usual.
  int run(const std::function<int(Communicator&)>& body);

 private:
  std::shared_ptr<void> session_;       // the MPI session, when there is one
  std::unique_ptr<Communicator> comm_;  // declared last: released before the session finalises MPI
};

// The one flow of a command that reads inputs and writes files to --out. `declare(args)` names its
// options (before the parse); `prepare(args)` checks every
// option and input and returns Inputs with `ranks` and `out_dir`; `execute(comm, inputs, out)` computes
// on every rank and writes the files on rank 0. Outside mpirun: prepare (the boundary, before any rank
// starts), the output directory checked and staged (before the compute), then the ranks under mpirun
// or this process alone, and the commit. As a rank: prepare and the output directory agreed by every
// rank, then execute.
template <class Inputs>
int run_file_command(const std::string& command, const std::vector<std::string>& argv, void (*declare)(Args&),
                     const std::vector<std::string>& outputs, Inputs (*prepare)(const Args&),
                     const std::function<int(Communicator&, const Inputs&, OutputDir*)>& execute) {
  Args args(argv);
  declare(args);
  args.parse();
  if (started_under_mpi()) {
    RankGroup group(rank_options(args, 1));
    return group.run([&](Communicator& comm) {
      Inputs in;
      std::unique_ptr<OutputDir> out;
      agree(comm, [&] {
        in = prepare(args);
        if (comm.rank() == 0) out = OutputDir::for_rank(in.out_dir, outputs);
      });
      return execute(comm, in, out.get());
    });
  }
  const Inputs in = prepare(args);
  OutputDir out(in.out_dir, outputs);
  if (in.ranks.count > 1) return run_under_mpirun(command, in.ranks, argv, &out);
  RankGroup group(in.ranks);
  return group.run([&](Communicator& comm) { return execute(comm, in, &out); });
}

}  // namespace treecp::cli
