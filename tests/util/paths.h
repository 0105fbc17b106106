// Where the tests find the remat executable and the source tree's fixtures. Both are
// absolute paths of the checkout, set in paths.cpp alone: a source compiled with them on
// its command line differs in every checkout, so ccache would compile every test again in
// each clean clone CI makes.
#pragma once

namespace remat::testing {

/// The remat executable this build made.
extern const char* const kRematBinary;
/// The root of the source tree (its tests/, bench/ and configs/).
extern const char* const kSourceDir;

}  // namespace remat::testing
