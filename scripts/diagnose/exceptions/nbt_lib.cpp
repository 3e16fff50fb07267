// The thrower of nbt_tr: a custom exception type thrown from a static library, as treecp's core throws
// treecp::Error into the extension.
#include "nbt_lib.hpp"
namespace nbt {
int lib_thrower(int x) {
  if (x > 0) throw Error("bad x from the library");
  return x;
}
}  // namespace nbt
