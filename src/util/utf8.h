// UTF-8 validity, for text that must stay UTF-8: a corpus to tokenize, config values that
// a run records in TOML.
#pragma once

#include <cstddef>
#include <string_view>

namespace remat::util {

/// Byte offset of the first invalid UTF-8 sequence in `text` (overlong forms, surrogates
/// and code points above U+10FFFF are invalid), or npos.
size_t find_invalid_utf8(std::string_view text);

}  // namespace remat::util
