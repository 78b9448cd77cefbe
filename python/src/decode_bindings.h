// The decode layers' bindings (decode_bindings.cc), registered by module.cc into seqpar._seqpar.
#pragma once

#include <pybind11/pybind11.h>

#include <functional>

#include "parallel/cp_common.h"

namespace seqpar::python {

// The CpGroups of a Python CpGrid object (module.cc owns the grid type); the grid outlives the layers made from it
// (keep_alive).
using GroupsOf = std::function<CpGroups(pybind11::handle grid)>;

// Registers MhaDecodeCp, DsaDecodeCp, GdnDecodeCp, their configurations and caches on `m`.
void bind_decode(pybind11::module_& m, GroupsOf groups_of);

}  // namespace seqpar::python
