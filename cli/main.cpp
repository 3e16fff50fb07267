// treecp: context parallelism over packed prefix-tree rows. Dispatches to registered subcommands.
#include <algorithm>
#include <cstdio>
#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include "checks.hpp"
#include "command.hpp"
#include "comm/communicator.hpp"
#include "core/error.hpp"
#include "plan/planner.hpp"
#include "tree/presets.hpp"

namespace {

void print_help() {
  std::cout << "usage: treecp <command> [options]\n\ncommands:\n";
  auto commands = treecp::cli::registry();
  std::sort(commands.begin(), commands.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  for (const auto& c : commands) std::cout << "  treecp " << c.name << " " << c.usage << "\n      " << c.summary << "\n";
  std::cout << "  treecp help\n      this text\n\npresets (--preset NAME; a row of base tokens x N ranks):\n";
  for (const treecp::PresetInfo& p : treecp::presets()) {
    std::printf("  %-14s %s; %lld base tokens per rank\n", p.name.c_str(), p.family.c_str(),
                static_cast<long long>(p.base_tokens_per_rank));
  }
  std::cout << "\nlayouts (--layout L):";
  for (const std::string& l : treecp::layout_names()) std::cout << " " << l;
  std::printf(
      "\n\n--ranks N (also spelled --cp N): the ranks a command runs on (started under mpirun unless it runs under\n"
      "  mpirun already) or plans for. --timeout S: the longest a rank waits for the others in one call (default\n"
      "  %.0f s); then the job ends with one line naming the call and the ranks that did not arrive.\n"
      "Every input is checked before any rank starts; an error is one line and the exit status 1, and --out is\n"
      "left as it was.\n",
      treecp::Communicator::kDefaultTimeoutS);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "help" || args[0] == "--help" || args[0] == "-h") {
    print_help();
    return args.empty() ? 2 : 0;
  }
  // Longest match first: "tree stats" before "tree".
  const treecp::cli::Command* best = nullptr;
  size_t best_words = 0;
  for (const auto& c : treecp::cli::registry()) {
    std::vector<std::string> words;
    size_t start = 0;
    while (start <= c.name.size()) {
      size_t sp = c.name.find(' ', start);
      words.push_back(c.name.substr(start, sp == std::string::npos ? std::string::npos : sp - start));
      if (sp == std::string::npos) break;
      start = sp + 1;
    }
    if (words.size() > args.size() || words.size() <= best_words) continue;
    if (std::equal(words.begin(), words.end(), args.begin())) {
      best = &c;
      best_words = words.size();
    }
  }
  if (!best) {
    std::cerr << "treecp: unknown command '" << args[0] << "' (see 'treecp help')\n";
    return 2;
  }
  try {
    return best->run(std::vector<std::string>(args.begin() + static_cast<long>(best_words), args.end()));
  } catch (const treecp::Error& e) {
    std::cerr << "treecp " << best->name << ": " << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "treecp " << best->name << ": internal error: " << e.what() << "\n";
    return 1;
  }
}
