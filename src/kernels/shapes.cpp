#include "kernels/shapes.hpp"

#include "core/error.hpp"

namespace treecp {

void AttentionShape::validate() const {
  require(hq > 0, "attention: hq must be > 0, got ", hq);
  require(hkv > 0, "attention: hkv must be > 0, got ", hkv);
  require(hq % hkv == 0, "attention: hq (", hq, ") must be a multiple of hkv (", hkv, ")");
  require(d > 0, "attention: d must be > 0, got ", d);
  require(dv >= 0, "attention: dv must be >= 0 (0: keys only, as a sparse MLA indexer), got ", dv);
  require(window >= 0, "attention: window must be >= 0 (0 = none), got ", window);
  require(std::isfinite(scale), "attention: scale must be finite, got ", scale);
}

void GdnShape::validate() const {
  require(heads >= 1, "gdn: heads must be >= 1, got ", heads);
  require(dk >= 1 && dv >= 1, "gdn: dk and dv must be >= 1, got ", dk, " and ", dv);
  require(chunk >= 1 && chunk <= 4096, "gdn: chunk must be in [1, 4096], got ", chunk);
  require(std::isfinite(scale), "gdn: scale must be finite, got ", scale);
}

void ConvShape::validate() const {
  require(channels >= 1, "conv1d: channels must be >= 1, got ", channels);
  require(width >= 1 && width <= 64, "conv1d: width must be in [1, 64], got ", width);
}

}  // namespace treecp
