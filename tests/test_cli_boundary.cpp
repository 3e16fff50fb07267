// The command line as a new user meets it: every bad input refused in one line before any rank starts,
// --out checked before the compute and never left half-written, gdn and conv1d held to attention's
// checks, a stopped rank ending the job at its deadline, and `treecp help` listing what README.md does.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/cli.hpp"
#include "core/npy.hpp"
#include "tree/presets.hpp"

extern char** environ;

namespace treecp {
namespace {

namespace fs = std::filesystem;
using testing::read_text;
using testing::TempDir;
using testing::write_file;

struct Outcome {
  int rc = -1;
  std::string log;
};

Outcome treecp(const std::string& args, const TempDir& dir) {
  const testing::CliRun r = testing::run_treecp(args, dir / "log.txt");
  return {WIFEXITED(r.status) ? WEXITSTATUS(r.status) : -1, r.log};
}

// What a refusal must look like: status 1, one line, the command named once, no MPI banner.
void expect_one_line(const Outcome& o, const std::string& command, const std::string& expected) {
  EXPECT_EQ(o.rc, 1) << o.log;
  EXPECT_EQ(std::count(o.log.begin(), o.log.end(), '\n'), 1) << o.log;
  EXPECT_EQ(o.log.rfind("treecp " + command + ": ", 0), 0u) << o.log;
  EXPECT_EQ(o.log.find("treecp " + command + ": " + command + ":"), std::string::npos) << o.log;
  for (const char* banner : {"mpirun", "MPI_ABORT", "-----"}) EXPECT_EQ(o.log.find(banner), std::string::npos) << o.log;
  EXPECT_NE(o.log.find(expected), std::string::npos) << "expected '" << expected << "' in: " << o.log;
}

// A small tree with random float64 arrays for attention, gdn and conv1d.
struct Inputs {
  TempDir dir{"treecp_boundary"};
  int64_t S = 0;
  Inputs() {
    write_file(dir / "t.json", R"({"segments":[{"parent":-1,"length":30},{"parent":0,"length":7},)"
                               R"({"parent":1,"length":2},{"parent":0,"length":12},{"parent":-1,"length":4}]})");
    S = 55;
    std::mt19937_64 rng(std::random_device{}());
    std::normal_distribution<double> nd;
    auto save = [&](const std::string& name, std::vector<int64_t> shape, DType dt = DType::F64, double lo = 0, double hi = 0) {
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      std::vector<double> v(static_cast<size_t>(n));
      for (double& x : v) x = hi > lo ? lo + (hi - lo) * std::uniform_real_distribution<double>()(rng) : nd(rng);
      write_file(dir / name, npy_bytes(shape, v.data(), dt));
    };
    save("q.npy", {S, 4, 8});
    save("k.npy", {S, 2, 8});
    save("v.npy", {S, 2, 8});
    save("gq.npy", {S, 2, 8});
    save("gq32.npy", {S, 2, 8}, DType::F32);
    save("g.npy", {S, 2}, DType::F64, -0.5, 0.0);
    save("g_up.npy", {S, 2}, DType::F64, 0.1, 0.5);
    save("beta.npy", {S, 2}, DType::F64, 0.05, 0.95);
    save("x.npy", {S, 6});
    save("w.npy", {6, 4});
    std::vector<double> nan(static_cast<size_t>(S * 2), -0.1);
    nan[7] = std::nan("");
    write_file(dir / "g_nan.npy", npy_bytes({S, 2}, nan.data(), DType::F64));
  }
  std::string attention(const std::string& out) const {
    return "attention --tree " + (dir / "t.json") + " --q " + (dir / "q.npy") + " --k " + (dir / "k.npy") + " --v " +
           (dir / "v.npy") + " --out " + out;
  }
  std::string gdn(const std::string& q, const std::string& g, const std::string& out) const {
    return "gdn --tree " + (dir / "t.json") + " --q " + (dir / q) + " --k " + (dir / "gq.npy") + " --v " +
           (dir / "gq.npy") + " --g " + (dir / g) + " --beta " + (dir / "beta.npy") + " --out " + out;
  }
};

bool mpi_built() {
#ifdef TREECP_HAVE_MPI
  return true;
#else
  return false;
#endif
}

TEST(Boundary, MultiRankOptionErrorsAreOneLineBeforeAnyRankStarts) {
  if (!mpi_built()) GTEST_SKIP() << "built without MPI";
  TempDir dir("treecp_boundary_run");
  const struct {
    std::string args, expected;
  } cases[] = {
      {"--tree " + (dir / "missing.json"), "cannot read file"},
      {"--dtype half", "option --dtype must be one of float, double; got 'half'"},
      {"--dtype fp16", "--dtype fp16 goes with --device cuda (CPU ranks compute in float or double)"},
      {"--hq 6 --hkv 4", "option --hq (6) must be a multiple of --hkv (4)"},
      {"--d 0", "option --d must be in [1, 512], got 0"},
      {"--dv 513", "option --dv must be in [1, 512], got 513"},
      {"--layout bogus", "option --layout must be one of"},
      {"--chunk 2", "at least the kernel tile of 128 tokens, got 2"},
      {"--timeout 0", "option --timeout must be a number of seconds in (0, 1e6]"},
      {"--hq 65536", "GiB (2 ranks of attention forward and backward and the reference"},
      {"--cp 2", "option --cp given twice (as --ranks)"},
  };
  for (const auto& c : cases) expect_one_line(treecp("run --ranks 2 " + c.args, dir), "run", c.expected);
  expect_one_line(treecp("plan --preset fixed5k --ranks 8 --chunk 1", dir), "plan", "kernel tile of 128 tokens");
}

// On GPUs the head dims are the kernels' (D, Dv) pairs, refused in one line with the list (a build without CUDA
// refuses --device cuda first). --dv is D unless given, so --d 192 alone asks for (192, 192).
TEST(Boundary, GpuHeadDimsOutsideTheKernelsPairsAreRefusedWithTheList) {
  TempDir dir("treecp_boundary_dims");
  const struct {
    std::string command, args, got;
  } cases[] = {
      {"run", "--device cuda --d 96", "(96, 96)"},
      {"run", "--device cuda --d 192", "(192, 192)"},
      {"run", "--device cuda --d 128 --dv 64", "(128, 64)"},
      {"bench cp", "--device cuda --d 256 --dv 128", "(256, 128)"},
      {"bench cp", "--device cuda --d 192", "(192, 192)"},
  };
  for (const auto& c : cases) {
    const Outcome o = treecp(c.command + " " + c.args, dir);
    EXPECT_EQ(o.rc, 1) << o.log;
    EXPECT_EQ(std::count(o.log.begin(), o.log.end(), '\n'), 1) << o.log;
    const bool listed = o.log.find("must be one of (D, Dv) (64, 64), (128, 128), (192, 128), (256, 256), got " +
                                   c.got) != std::string::npos;
    const bool no_gpu_build = o.log.find("--device cuda: this treecp was built without CUDA") != std::string::npos;
    EXPECT_TRUE(listed || no_gpu_build) << c.command << " " << c.args << ": " << o.log;
  }
}

TEST(Boundary, OutputDirectoryIsCheckedBeforeTheComputeAndNeverHalfWritten) {
  const Inputs in;
  const std::string ranks = mpi_built() ? " --ranks 2" : "";
  write_file(in.dir / "file", "x");
  expect_one_line(treecp(in.attention(in.dir / "file/out") + ranks, in.dir), "attention", "is not a directory");
  expect_one_line(treecp(in.attention("/proc/treecp_out") + ranks, in.dir), "attention", "cannot create directory");
  // DIR/lse.npy is a directory: refused before anything is computed, and o.npy is not written either.
  fs::create_directories(in.dir / "blocked/lse.npy");
  const std::string blocked = in.dir / "blocked/lse.npy";
  expect_one_line(treecp(in.attention(in.dir / "blocked") + ranks, in.dir), "attention", blocked + "' is a directory");
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(in.dir / "blocked")) left.push_back(e.path().filename().string());
  EXPECT_EQ(left, std::vector<std::string>{"lse.npy"});
  // A refused input leaves no directory behind, not even an empty one.
  expect_one_line(treecp(in.attention(in.dir / "new/deeper") + " --window -1" + ranks, in.dir), "attention",
                  "option --window must be in [0, ");
  EXPECT_FALSE(fs::exists(in.dir / "new"));
  // A run that goes well leaves exactly its files, no staging directory.
  const Outcome ok = treecp(in.attention(in.dir / "good") + ranks, in.dir);
  ASSERT_EQ(ok.rc, 0) << ok.log;
  std::set<std::string> files;
  for (const auto& e : fs::directory_iterator(in.dir / "good")) files.insert(e.path().filename().string());
  EXPECT_EQ(files, (std::set<std::string>{"lse.npy", "o.npy"}));
}

TEST(Boundary, GdnAndConv1dRefuseWhatAttentionRefuses) {
  const Inputs in;
  const std::string out = in.dir / "never";
  expect_one_line(treecp(in.gdn("gq.npy", "g_nan.npy", out), in.dir), "gdn", "g: element 7 is nan (expected finite values)");
  expect_one_line(treecp(in.gdn("gq.npy", "g_up.npy", out), in.dir), "gdn", "expected values <= 0");
  expect_one_line(treecp(in.gdn("gq32.npy", "g.npy", out), in.dir), "gdn", "k is float64 but q is float32");
  expect_one_line(treecp(in.gdn("gq.npy", "g.npy", out) + " --scale 0", in.dir), "gdn",
                  "option --scale must be a finite number > 0, got 0");
  std::vector<double> x(static_cast<size_t>(in.S * 6), 1.0);
  x[11] = -std::numeric_limits<double>::infinity();
  write_file(in.dir / "x_inf.npy", npy_bytes({in.S, 6}, x.data(), DType::F64));
  expect_one_line(treecp("conv1d --tree " + (in.dir / "t.json") + " --x " + (in.dir / "x_inf.npy") + " --weight " +
                             (in.dir / "w.npy") + " --out " + out,
                         in.dir),
                  "conv1d", "x: element 11 is -inf");
  EXPECT_FALSE(fs::exists(out));
  // The same inputs with sound gates run.
  const Outcome ok = treecp(in.gdn("gq.npy", "g.npy", in.dir / "gdn_out"), in.dir);
  EXPECT_EQ(ok.rc, 0) << ok.log;
}

// Descendants of `root` whose command is `name`: the rank processes mpirun started.
std::vector<pid_t> descendants(pid_t root, const std::string& name) {
  std::vector<std::pair<pid_t, pid_t>> parent;  // (pid, ppid)
  std::vector<std::pair<pid_t, std::string>> comm;
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string id = e.path().filename().string();
    if (id.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(e.path() / "stat");
    std::string text((std::istreambuf_iterator<char>(stat)), {});
    const size_t open = text.find('('), close = text.rfind(')');
    if (open == std::string::npos || close == std::string::npos) continue;
    std::istringstream rest(text.substr(close + 2));
    char state = 0;
    pid_t ppid = 0;
    rest >> state >> ppid;
    if (state == 'Z') continue;
    parent.emplace_back(std::stoi(id), ppid);
    comm.emplace_back(std::stoi(id), text.substr(open + 1, close - open - 1));
  }
  std::set<pid_t> tree = {root};
  for (bool grew = true; grew;) {
    grew = false;
    for (const auto& [pid, ppid] : parent) grew |= tree.count(ppid) && tree.insert(pid).second;
  }
  std::vector<pid_t> out;
  for (const auto& [pid, c] : comm) {
    if (pid != root && tree.count(pid) && c == name) out.push_back(pid);
  }
  return out;
}

double cpu_seconds(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), {});
  const size_t close = text.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream rest(text.substr(close + 2));
  std::string field;
  double ticks = 0;
  for (int i = 3; i <= 15 && rest >> field; ++i) {
    if (i == 14 || i == 15) ticks += std::stod(field);  // utime, stime
  }
  return ticks / static_cast<double>(sysconf(_SC_CLK_TCK));
}

TEST(Boundary, StoppedRankEndsTheJobAtTheDeadlineWithOneLine) {
  if (!mpi_built()) GTEST_SKIP() << "built without MPI";
  TempDir dir("treecp_boundary_stop");
  const std::string log = dir / "log.txt";
  std::vector<std::string> words = {TREECP_CLI_PATH, "run",      "--ranks",   "3", "--preset", "fixed5k",
                                    "--scale",       "4",        "--timeout", "2"};
  std::vector<char*> argv;
  for (auto& w : words) argv.push_back(w.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  pid_t pid = 0;
  ASSERT_EQ(posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ), 0);
  posix_spawn_file_actions_destroy(&actions);
  // Stop a rank once it computes (0.3 s of CPU: past MPI's start and the planning, which have no
  // deadline), and before it ends.
  pid_t victim = 0;
  const auto start = std::chrono::steady_clock::now();
  while (victim == 0 && std::chrono::steady_clock::now() - start < std::chrono::seconds(60)) {
    const std::vector<pid_t> ranks = descendants(pid, "treecp");
    for (pid_t r : ranks) {
      if (ranks.size() == 3 && victim == 0 && cpu_seconds(r) >= 0.3) victim = r;
    }
    if (waitpid(pid, nullptr, WNOHANG) == pid) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (victim == 0) {
    waitpid(pid, nullptr, 0);
    GTEST_SKIP() << "the run ended before a rank could be stopped: " << read_text(log);
  }
  ASSERT_EQ(kill(victim, SIGSTOP), 0);
  const auto stopped = std::chrono::steady_clock::now();
  int status = 0;
  bool ended = false;
  while (!ended && std::chrono::steady_clock::now() - stopped < std::chrono::seconds(60)) {
    ended = waitpid(pid, &status, WNOHANG) == pid;
    if (!ended) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const double waited_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - stopped).count();
  kill(victim, SIGKILL);  // if mpirun did not take it with the job
  if (!ended) {
    for (pid_t p : descendants(pid, "mpirun")) kill(p, SIGKILL);
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    FAIL() << "the job still waited 60 s after a rank stopped: " << read_text(log);
  }
  const Outcome o{WIFEXITED(status) ? WEXITSTATUS(status) : -1, read_text(log)};
  expect_one_line(o, "run", "did not arrive within the 2 s timeout");
  EXPECT_LT(waited_s, 30.0);
}

// Every option README.md lists for a command is in that command's line of `treecp help`, and the
// help names every preset.
TEST(Boundary, HelpListsEveryOptionTheReadmeLists) {
  TempDir dir("treecp_boundary_help");
  const Outcome help = treecp("help", dir);
  ASSERT_EQ(help.rc, 0) << help.log;
  const std::string readme = read_text(std::string(TREECP_TESTS_DIR) + "/../README.md");
  const size_t begin = readme.find("```\ntreecp tree generate"), end = readme.find("```", begin + 3);
  ASSERT_NE(begin, std::string::npos);
  std::istringstream block(readme.substr(begin + 4, end - begin - 4));
  std::string command, line;
  int checked = 0;
  const std::regex flag("--[a-z][a-z-]*");
  while (std::getline(block, line)) {
    if (line.rfind("treecp ", 0) == 0) {
      std::istringstream words(line.substr(7));
      std::string w1, w2;
      words >> w1 >> w2;
      command = w1 == "tree" ? w1 + " " + w2 : w1;
    }
    const size_t at = help.log.find("  treecp " + command + " ");
    const size_t help_end = help.log.find('\n', at);
    const std::string help_line = at == std::string::npos ? "" : help.log.substr(at, help_end - at);
    for (std::sregex_iterator it(line.begin(), line.end(), flag), e; it != e; ++it) {
      EXPECT_NE(help_line.find(it->str()), std::string::npos) << "README lists " << it->str() << " for " << command;
      ++checked;
    }
  }
  EXPECT_GT(checked, 60);
  for (const PresetInfo& p : presets()) EXPECT_NE(help.log.find("  " + p.name + " "), std::string::npos) << p.name;
}

}  // namespace
}  // namespace treecp
