#include "launcher.hpp"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <optional>
#include <sstream>

#include "command.hpp"
#include "core/error.hpp"
#include "output_dir.hpp"

#ifdef TREECP_HAVE_MPI
#include "comm/mpi_communicator.hpp"
#endif

extern char** environ;

namespace treecp::cli {

namespace fs = std::filesystem;

bool started_under_mpi() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE"}) {
    if (std::getenv(var) != nullptr) return true;
  }
  return false;
}

namespace {

// Files of the report directory: how rank r ended (its exit status), and its error when it had one.
std::string exit_file(const std::string& dir, int r) { return (fs::path(dir) / ("rank-" + std::to_string(r) + ".exit")).string(); }
std::string error_file(const std::string& dir, int r) { return (fs::path(dir) / ("rank-" + std::to_string(r) + ".error")).string(); }

std::optional<std::string> read_if_present(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A report to the launcher: written whole, then renamed into place.
bool write_report(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    if (!out) return false;
  }
  return std::rename(tmp.c_str(), path.c_str()) == 0;
}
const char* report_dir() {
  const char* dir = std::getenv(kReportEnv);
  return dir != nullptr && *dir != '\0' ? dir : nullptr;
}

// The first non-empty line of mpirun's log, for the one line that names it.
std::string first_line(const std::string& text) {
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.find_first_not_of(" \t\r-=*") != std::string::npos) return printable(line, 160);
  }
  return "(mpirun printed nothing)";
}

}  // namespace

int run_under_mpirun(const std::string& command, const RankOptions& ranks, const std::vector<std::string>& argv,
                     OutputDir* out) {
#ifndef TREECP_HAVE_MPI
  (void)command, (void)argv, (void)out;
  fail("--ranks ", ranks.count, " needs MPI, but this treecp was built without it (install libopenmpi-dev and rebuild)");
#else
  std::error_code ec;
  const std::string self = fs::read_symlink("/proc/self/exe", ec).string();
  require(!ec, "cannot find this executable to start ranks: ", ec.message());
  std::vector<std::string> words = {"mpirun"};
  if (geteuid() == 0) words.push_back("--allow-run-as-root");
  for (const char* w : {"--oversubscribe", "-np"}) words.push_back(w);
  words.push_back(std::to_string(ranks.count));
  words.push_back(self);
  std::istringstream cmd(command);
  for (std::string w; cmd >> w;) words.push_back(w);
  words.insert(words.end(), argv.begin(), argv.end());
  std::vector<char*> cargv;
  for (auto& w : words) cargv.push_back(w.data());
  cargv.push_back(nullptr);

  std::string dir = (fs::temp_directory_path() / "treecp-ranks-XXXXXX").string();
  require(::mkdtemp(dir.data()) != nullptr, "cannot create a directory for the ranks' reports in ",
          fs::temp_directory_path().string(), " (", std::strerror(errno), ")");
  bool keep_dir = false;
  struct Cleanup {
    const std::string& dir;
    const bool& keep;
    ~Cleanup() {
      std::error_code e;
      if (!keep) fs::remove_all(dir, e);
    }
  } cleanup{dir, keep_dir};
  const std::string log = (fs::path(dir) / "mpirun.log").string();

  // This environment, with the report directory (and the output staging directory) for the ranks.
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string var(*e);
    if (var.rfind(std::string(kReportEnv) + "=", 0) == 0 || var.rfind(std::string(OutputDir::kStagingEnv) + "=", 0) == 0)
      continue;
    env.push_back(var);
  }
  env.push_back(std::string(kReportEnv) + "=" + dir);
  if (out != nullptr) env.push_back(std::string(OutputDir::kStagingEnv) + "=" + out->staging());
  std::vector<char*> cenv;
  for (auto& e : env) cenv.push_back(e.data());
  cenv.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  require(posix_spawn_file_actions_init(&actions) == 0, "posix_spawn_file_actions_init failed");
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  pid_t pid = 0;
  const int err = posix_spawnp(&pid, "mpirun", &actions, nullptr, cargv.data(), cenv.data());
  posix_spawn_file_actions_destroy(&actions);
  require(err == 0, "cannot start mpirun (", std::strerror(err), "); is openmpi-bin installed?");
  int wstatus = 0;
  while (waitpid(pid, &wstatus, 0) < 0) {
    require(errno == EINTR, "waiting for mpirun failed: ", std::strerror(errno));
  }
  const int mpirun_status = WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : 128 + (WIFSIGNALED(wstatus) ? WTERMSIG(wstatus) : 0);

  int status = 0;
  std::vector<int> silent;
  for (int r = 0; r < ranks.count; ++r) {
    if (auto error = read_if_present(error_file(dir, r))) fail(*error);  // the lowest rank's error, once
    const auto exit = read_if_present(exit_file(dir, r));
    if (!exit) {
      silent.push_back(r);
      continue;
    }
    status = std::max(status, std::atoi(exit->c_str()));
  }
  const std::string log_text = read_if_present(log).value_or("");
  if (!silent.empty()) {
    keep_dir = true;
    std::string who;
    for (size_t i = 0; i < silent.size(); ++i) who += (i ? ", " : "") + std::to_string(silent[i]);
    fail(silent.size() == 1 ? "rank " : "ranks ", who, " ended without a report (killed or crashed; mpirun exit status ",
         mpirun_status, "): ", first_line(log_text), "; mpirun's log: ", log);
  }
  if (status == 0) {
    if (out != nullptr) out->commit();
    std::cerr << log_text;  // warnings of a run that went well; after a failure it is mpirun's banner
  }
  return status;
#endif
}

void agree(Communicator& comm, const std::function<void()>& fn) {
  std::string error;
  try {
    fn();
  } catch (const std::exception& e) {
    error = *e.what() != '\0' ? e.what() : "unknown error";
  }
  const int n = comm.size();
  const int64_t mine = error.empty() ? 0 : 1;
  std::vector<int64_t> failed(static_cast<size_t>(n));
  comm.all_gather(&mine, failed.data(), 1, CommType::I64);
  const auto first = std::find(failed.begin(), failed.end(), 1);
  if (first == failed.end()) return;
  const int who = static_cast<int>(first - failed.begin());
  // The lowest failing rank's message, to every rank: its length, then its bytes (zeros elsewhere).
  int64_t length = comm.rank() == who ? static_cast<int64_t>(error.size()) : 0;
  comm.all_reduce_sum(&length, 1, CommType::I64);
  std::string text(static_cast<size_t>(length), '\0');
  if (comm.rank() == who) text = error;
  comm.all_reduce_sum(text.data(), length, CommType::U8);
  const bool everywhere = std::count(failed.begin(), failed.end(), 1) == n;
  throw AgreedError(everywhere ? text : "rank " + std::to_string(who) + ": " + text);
}

RankGroup::RankGroup(const RankOptions& ranks) {
#ifdef TREECP_HAVE_MPI
  if (started_under_mpi()) {
    session_ = std::make_shared<MpiSession>();
    comm_ = make_world_communicator();
  }
#endif
  if (!comm_) comm_ = make_self_communicator();
  comm_->set_timeout_s(ranks.timeout_s);
  require(comm_->size() == ranks.count, "--ranks ", ranks.count, " but ", count_of(comm_->size(), "process was", "processes were"),
          " started");
}

int RankGroup::run(const std::function<int(Communicator&)>& body) {
  const int n = comm_->size(), me = comm_->rank();
  const char* dir = report_dir();
  int status = 0;
  try {
    status = body(*comm_);
    if (n > 1) comm_->barrier();  // every rank ends its work here, under the deadline; MPI_Finalize has none
  } catch (const AgreedError& e) {
    if (n <= 1) throw;
    // Every rank has the same message: rank 0 reports it (main prints it), the others end quietly.
    if (me == 0 && dir == nullptr) throw;
    if (me == 0) write_report(error_file(dir, me), e.what());
    status = 1;
  } catch (const std::exception& e) {
    if (n <= 1) throw;
    const std::string message = "rank " + std::to_string(me) + ": " + e.what();
    if (dir == nullptr || !write_report(error_file(dir, me), message)) {
      std::fprintf(stderr, "treecp: %s; aborting the job\n", message.c_str());
      std::fflush(stderr);
    }
#ifdef TREECP_HAVE_MPI
    MPI_Abort(MPI_COMM_WORLD, 1);
#endif
    throw;
  }
  if (dir != nullptr) write_report(exit_file(dir, me), std::to_string(status));
  return status;
}

}  // namespace treecp::cli
