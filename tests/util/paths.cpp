#include "util/paths.h"

namespace remat::testing {

// Constants, so that they are set before any test file's own statics read them.
const char* const kRematBinary = REMAT_BINARY;
const char* const kSourceDir = REMAT_SOURCE_DIR;

}  // namespace remat::testing
