// The message a call throws, for tests of error sentences.
#pragma once

#include <functional>
#include <string>

namespace remat::testing {

/// The what() of the `E` that `f` throws, or "" when it returns. Another exception type
/// propagates and fails the test, so the type is asserted along with the sentence.
template <class E>
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "";
}

}  // namespace remat::testing
