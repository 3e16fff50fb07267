#include "runtime/gdn_cp.hpp"

namespace treecp {
namespace {

// The GDN/KDA chunked kernels as the affine protocol's recurrence.
template <class T>
struct GdnRecurrence {
  using Scalar = T;
  using Grads = GdnGrads<T>;
  static constexpr const char* name = "gdn";
  const GdnParams<T>& p;

  int heads() const { return p.heads; }
  int rows() const { return p.dk; }
  int cols() const { return p.dv; }
  int64_t tokens() const { return p.tokens; }
  void check() const { gdn_check_params(p); }
  void forward(int h, int64_t t0, int64_t t1, T* s, T* y) const { gdn_chunked_forward(p, h, t0, t1, s, y); }
  void summary(int h, int64_t t0, int64_t t1, T* M, T* E) const { gdn_chunked_summary(p, h, t0, t1, M, E); }
  void backward(int h, int64_t t0, int64_t t1, const T* s_in, const T* dy, T* ds, const Grads& g) const {
    gdn_chunked_backward(p, h, t0, t1, s_in, dy, ds, g);
  }
};

}  // namespace

template <class T>
GdnSaved<T> gdn_cp_forward(Communicator& comm, const Row& row, const GdnPlan& plan, const GdnParams<T>& local, T* y) {
  return affine_cp_forward(comm, row, plan, GdnRecurrence<T>{local}, y);
}

template <class T>
void gdn_cp_backward(Communicator& comm, const Row& row, const GdnPlan& plan, const GdnParams<T>& local,
                     const GdnSaved<T>& saved, const T* dy, const GdnGrads<T>& grads) {
  affine_cp_backward(comm, row, plan, GdnRecurrence<T>{local}, saved, dy, grads);
}

#define TREECP_GDN_CP_INSTANTIATE(T)                                                                            \
  template GdnSaved<T> gdn_cp_forward<T>(Communicator&, const Row&, const GdnPlan&, const GdnParams<T>&, T*);  \
  template void gdn_cp_backward<T>(Communicator&, const Row&, const GdnPlan&, const GdnParams<T>&,             \
                                   const GdnSaved<T>&, const T*, const GdnGrads<T>&);

TREECP_GDN_CP_INSTANTIATE(float)
TREECP_GDN_CP_INSTANTIATE(double)

}  // namespace treecp
