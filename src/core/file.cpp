#include "core/file.hpp"

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "core/error.hpp"

namespace treecp {

void write_file_atomic(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp-treecp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    require(out.good(), "cannot write '", path, "'");
    out << text;
    out.close();
    if (!out) {
      std::remove(tmp.c_str());
      fail("error while writing '", path, "'");
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::remove(tmp.c_str());
    fail("cannot write '", path, "': ", ec.message());
  }
}

}  // namespace treecp
