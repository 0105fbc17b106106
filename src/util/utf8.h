// UTF-8 validity, for text that must stay UTF-8: a corpus to tokenize, config values that
// a run records in TOML.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace remat::util {

/// Byte offset of the first invalid UTF-8 sequence in `text` (overlong forms, surrogates
/// and code points above U+10FFFF are invalid), or npos.
size_t find_invalid_utf8(std::string_view text);

/// `text` for a message about it: whole when at most `max_bytes` long, else its first
/// `max_bytes` bytes (never cutting a UTF-8 character) and "... (N bytes in all)", so that
/// an error about a huge input never repeats it.
std::string clip(std::string_view text, size_t max_bytes = 200);

}  // namespace remat::util
