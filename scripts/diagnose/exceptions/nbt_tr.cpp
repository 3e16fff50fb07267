// Like _core: a registered exception translator for a custom type thrown from a static library.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>
#include "nbt_lib.hpp"
namespace nb = nanobind;
NB_MODULE(MODNAME, m) {
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const nbt::Error& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });
  m.def("thrower", &nbt::lib_thrower);
  m.def("vec_thrower", [](const std::vector<long>& v) { return nbt::lib_thrower(int(v.size())); });
}
