#include "runtime/version.h"

namespace seqpar {

const char* version() { return SEQPAR_VERSION_STRING; }

}  // namespace seqpar
