#include "kernels/shapes.hpp"

#include "core/error.hpp"

namespace treecp {

void AttentionShape::validate() const {
  require(hq > 0, "attention: hq must be > 0, got ", hq);
  require(hkv > 0, "attention: hkv must be > 0, got ", hkv);
  require(hq % hkv == 0, "attention: hq (", hq, ") must be a multiple of hkv (", hkv, ")");
  require(d > 0, "attention: d must be > 0, got ", d);
  require(dv > 0, "attention: dv must be > 0, got ", dv);
  require(window >= 0, "attention: window must be >= 0 (0 = none), got ", window);
  require(std::isfinite(scale), "attention: scale must be finite, got ", scale);
}

}  // namespace treecp
