// UTF-8 validity, for text that must stay UTF-8 (a corpus to tokenize, config values that
// a run records in TOML), and the one sanitiser of text from files and arguments on its
// way to the terminal or a file a person reads.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace remat::util {

/// Byte offset of the first invalid UTF-8 sequence in `text` (overlong forms, surrogates
/// and code points above U+10FFFF are invalid), or npos.
size_t find_invalid_utf8(std::string_view text);

/// `text` with each invalid UTF-8 sequence's maximal subpart replaced by U+FFFD, as
/// Unicode recommends and Python's and Rust's lossy decoders do.
std::string replace_invalid_utf8(std::string_view text);

/// `text` for a message about it: whole when at most `max_bytes` long, else its first
/// `max_bytes` bytes (never cutting a UTF-8 character) and "... (N bytes in all)", so that
/// an error about a huge input never repeats it.
std::string clip(std::string_view text, size_t max_bytes = 200);

/// The offset of the first character of `text` that printable escapes but for '\n' and
/// '\t' where `text_controls` (a prompt's), or npos.
size_t find_control(std::string_view text, bool text_controls = false);

/// `text` clipped (clip) and safe to show: every control character (C0, DEL, C1 and the
/// bidirectional overrides, which can clear a screen, forge a line or reorder one) and
/// every byte that is not UTF-8 written as an escape (\n, \t, \r, \xNN, \u202E); a NUL
/// byte no longer cuts a message short. The one way a name or value from a file or an
/// argument enters a message.
std::string printable(std::string_view text, size_t max_bytes = 200);

/// A whole message for the terminal: printable's escapes for every control character but
/// its newlines, uncut.
std::string terminal_text(std::string_view text);

}  // namespace remat::util
