// The --out directory of a command, made so that a failure leaves no partial output: checked, with a
// staging directory created inside it, before the compute; files are written into the staging
// directory and renamed into place by commit(). Without commit() (an error anywhere, a failed rank)
// the staging directory, and the directories this created, are removed.
#pragma once

#include <memory>
#include <string>
#include <vector>

namespace treecp::cli {

class OutputDir {
 public:
  // `names` are every file the command may write: none of them may be a directory, and at commit
  // those this run did not write are removed (an earlier run's gradients must not pass for this one's).
  OutputDir(const std::string& path, std::vector<std::string> names);
  ~OutputDir();
  OutputDir(const OutputDir&) = delete;
  OutputDir& operator=(const OutputDir&) = delete;

  // Rank 0 of a job that treecp's launcher started writes into the staging directory the launcher
  // made (kStagingEnv), and commits nothing: the launcher commits once every rank ended well. Anywhere
  // else this is an OutputDir of its own.
  static std::unique_ptr<OutputDir> for_rank(const std::string& path, std::vector<std::string> names);
  static constexpr const char* kStagingEnv = "TREECP_OUT_STAGING";

  const std::string& path() const { return path_; }
  const std::string& staging() const { return staging_; }
  void write(const std::string& name, const std::string& bytes);
  void commit();

 private:
  OutputDir() = default;

  std::string path_, staging_;
  std::vector<std::string> names_;
  std::vector<std::string> created_;  // directories this made, outermost first
  bool adopted_ = false, committed_ = false;
};

}  // namespace treecp::cli
