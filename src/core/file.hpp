// core/: the ground every layer stands on: errors, JSON, .npy and output files, trace spans, random values.
//
// Writing an output file so that a failure leaves nothing behind: the text goes to a temporary file
// next to the target, which is renamed into place only once it is complete.
#pragma once

#include <string>

namespace treecp {

// Throws treecp::Error naming the path when it cannot be written; the target is untouched then.
void write_file_atomic(const std::string& path, const std::string& text);

}  // namespace treecp
