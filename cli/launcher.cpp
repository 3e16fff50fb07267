#include "launcher.hpp"

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <sstream>

#include "core/error.hpp"

#ifdef TREECP_HAVE_MPI
#include "comm/mpi_communicator.hpp"
#endif

extern char** environ;

namespace treecp::cli {

bool started_under_mpi() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE"}) {
    if (std::getenv(var) != nullptr) return true;
  }
  return false;
}

bool relaunch_under_mpi(const std::string& command, int ranks, const std::vector<std::string>& argv, int* rc) {
  if (ranks <= 1 || started_under_mpi()) return false;
#ifndef TREECP_HAVE_MPI
  (void)command, (void)argv, (void)rc;
  fail("--ranks ", ranks, " needs MPI, but this treecp was built without it (install libopenmpi-dev and rebuild)");
#else
  std::error_code ec;
  const std::string self = std::filesystem::read_symlink("/proc/self/exe", ec).string();
  require(!ec, "cannot find this executable to start ranks: ", ec.message());
  std::vector<std::string> words = {"mpirun"};
  if (geteuid() == 0) words.push_back("--allow-run-as-root");
  for (const char* w : {"--oversubscribe", "-np"}) words.push_back(w);
  words.push_back(std::to_string(ranks));
  words.push_back(self);
  std::istringstream cmd(command);
  for (std::string w; cmd >> w;) words.push_back(w);
  words.insert(words.end(), argv.begin(), argv.end());
  std::vector<char*> cargv;
  for (auto& w : words) cargv.push_back(w.data());
  cargv.push_back(nullptr);
  pid_t pid = 0;
  const int err = posix_spawnp(&pid, "mpirun", nullptr, nullptr, cargv.data(), environ);
  require(err == 0, "cannot start mpirun (", std::strerror(err), "); is openmpi-bin installed?");
  int wstatus = 0;
  while (waitpid(pid, &wstatus, 0) < 0) {
    require(errno == EINTR, "waiting for mpirun failed: ", std::strerror(errno));
  }
  *rc = WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : 128 + (WIFSIGNALED(wstatus) ? WTERMSIG(wstatus) : 0);
  return true;
#endif
}

RankGroup::RankGroup(int64_t ranks) {
#ifdef TREECP_HAVE_MPI
  if (started_under_mpi()) {
    session_ = std::make_shared<MpiSession>();
    comm_ = make_world_communicator();
  }
#endif
  if (!comm_) comm_ = make_self_communicator();
  require(comm_->size() == ranks, "--ranks ", ranks, " but ", comm_->size(), " processes were started");
}

int RankGroup::run(const std::function<int(Communicator&)>& body) {
  try {
    return body(*comm_);
  } catch (const std::exception& e) {
    if (comm_->size() <= 1) throw;
    std::fprintf(stderr, "treecp: rank %d of %d: %s; aborting the job\n", comm_->rank(), comm_->size(), e.what());
    std::fflush(stderr);
#ifdef TREECP_HAVE_MPI
    MPI_Abort(MPI_COMM_WORLD, 1);
#endif
    throw;
  }
}

}  // namespace treecp::cli
