#include <nanobind/nanobind.h>
#include <stdexcept>
static int thrower(int x) { if (x > 0) throw std::invalid_argument("bad x"); return x; }
NB_MODULE(MODNAME, m) { m.def("thrower", &thrower); }
