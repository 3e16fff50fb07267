#include "output_dir.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/error.hpp"

namespace treecp::cli {

namespace fs = std::filesystem;

OutputDir::OutputDir(const std::string& path, std::vector<std::string> names) : path_(path), names_(std::move(names)) {
  require(!path_.empty(), "--out needs a directory");
  const std::string shown = printable(path_);
  std::error_code ec;
  // The nearest existing directory on the way to DIR, then every missing one below it, made here.
  std::vector<fs::path> missing;
  std::string trimmed = path_;
  while (trimmed.size() > 1 && trimmed.back() == '/') trimmed.pop_back();
  fs::path p = fs::path(trimmed).lexically_normal();
  while (!fs::exists(p, ec)) {
    missing.push_back(p);
    if (p.parent_path() == p) break;
    p = p.parent_path().empty() ? fs::path(".") : p.parent_path();
  }
  require(fs::is_directory(p, ec), "--out '", shown, "': '", printable(p.string()), "' is not a directory");
  for (auto it = missing.rbegin(); it != missing.rend(); ++it) {
    if (::mkdir(it->c_str(), 0777) != 0) {
      const int err = errno;
      for (auto jt = created_.rbegin(); jt != created_.rend(); ++jt) fs::remove(*jt, ec);
      fail("--out '", shown, "': cannot create directory '", printable(it->string()), "' (", std::strerror(err), ")");
    }
    created_.push_back(it->string());
  }
  for (const std::string& name : names_) {
    const fs::path target = fs::path(path_) / name;
    require(!fs::is_directory(target, ec), "--out '", shown, "': '", printable(target.string()),
            "' is a directory, where this command writes a file");
  }
  std::string pattern = (fs::path(path_) / ".treecp-staging-XXXXXX").string();
  if (::mkdtemp(pattern.data()) == nullptr) {
    const int err = errno;
    for (auto jt = created_.rbegin(); jt != created_.rend(); ++jt) fs::remove(*jt, ec);
    fail("--out '", shown, "': cannot write there (", std::strerror(err), ")");
  }
  staging_ = pattern;
}

std::unique_ptr<OutputDir> OutputDir::for_rank(const std::string& path, std::vector<std::string> names) {
  const char* staging = std::getenv(kStagingEnv);
  if (staging == nullptr || *staging == '\0') return std::make_unique<OutputDir>(path, std::move(names));
  std::unique_ptr<OutputDir> out(new OutputDir());
  out->path_ = path;
  out->staging_ = staging;
  out->names_ = std::move(names);
  out->adopted_ = true;
  std::error_code ec;
  require(fs::is_directory(out->staging_, ec), "--out '", printable(path), "': the launcher's staging directory '",
          printable(out->staging_), "' is missing");
  return out;
}

OutputDir::~OutputDir() {
  if (committed_ || adopted_ || staging_.empty()) return;
  std::error_code ec;
  fs::remove_all(staging_, ec);
  for (auto it = created_.rbegin(); it != created_.rend(); ++it) fs::remove(*it, ec);  // only if empty
}

void OutputDir::write(const std::string& name, const std::string& bytes) {
  require(std::find(names_.begin(), names_.end(), name) != names_.end(), "OutputDir: '", name,
          "' is not one of the command's outputs");
  const std::string file = (fs::path(staging_) / name).string();
  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  require(out.good(), "--out '", printable(path_), "': cannot write '", name, "'");
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  require(!out.fail(), "--out '", printable(path_), "': error while writing '", name, "' (disk full?)");
}

void OutputDir::commit() {
  if (adopted_) return;
  std::error_code ec;
  for (const std::string& name : names_) {
    const fs::path staged = fs::path(staging_) / name, target = fs::path(path_) / name;
    if (fs::exists(staged, ec)) {
      fs::rename(staged, target, ec);
      require(!ec, "--out '", printable(path_), "': cannot move '", name, "' into place (", ec.message(), ")");
    } else if (fs::is_regular_file(target, ec)) {
      fs::remove(target, ec);
    }
  }
  fs::remove_all(staging_, ec);
  committed_ = true;
}

}  // namespace treecp::cli
