// What every native module reports first in build_info(): the ampfused version and the hash of csrc/ it
// was built from (both set by setup.py on the module files; the loader compares them with the checkout),
// the Python and the compiler.
#pragma once

#include <pybind11/pybind11.h>

#ifndef AMPFUSED_VERSION
#define AMPFUSED_VERSION "unknown"
#endif
#ifndef AMPFUSED_SOURCES_HASH
#define AMPFUSED_SOURCES_HASH "unknown"
#endif

namespace ampfused {

inline pybind11::dict build_identity() {
  pybind11::dict d;
  d["version"] = AMPFUSED_VERSION;
  d["sources_hash"] = AMPFUSED_SOURCES_HASH;
  d["python"] = PY_VERSION;
  d["compiler"] = __VERSION__;
  return d;
}

}  // namespace ampfused
