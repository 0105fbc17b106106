#include "util/utf8.h"

#include <fmt/format.h>

namespace remat::util {
namespace {

// The sequence at `i` of `s` (`n` bytes): its length when it is valid UTF-8 (`valid`
// true), else the length of its maximal subpart (a lead byte and the continuation bytes
// that still fit it, at least 1), the span Unicode replaces by one U+FFFD. The lead byte
// sets the second byte's range, which excludes overlong forms, surrogates and code points
// above U+10FFFF.
size_t sequence(const unsigned char* s, size_t n, size_t i, bool& valid) {
  const unsigned char c = s[i];
  valid = true;
  if (c < 0x80) return 1;
  size_t length = 0;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    length = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    length = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    length = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    valid = false;
    return 1;
  }
  for (size_t k = 1; k < length; ++k) {
    const bool fits = i + k < n && (k == 1 ? s[i + k] >= lo && s[i + k] <= hi : (s[i + k] & 0xC0) == 0x80);
    if (!fits) {
      valid = false;
      return k;
    }
  }
  return length;
}

// The length of the UTF-8 sequence at `i` of `text`, 0 where it is not one.
size_t sequence_at(std::string_view text, size_t i) {
  bool valid = false;
  const size_t length = sequence(reinterpret_cast<const unsigned char*>(text.data()), text.size(), i, valid);
  return valid ? length : 0;
}

// The code point of the valid sequence of `length` bytes at `s`.
char32_t code_point(const unsigned char* s, size_t length) {
  if (length == 1) return s[0];
  char32_t c = s[0] & (0x7F >> length);
  for (size_t k = 1; k < length; ++k) c = (c << 6) | (s[k] & 0x3F);
  return c;
}

bool is_control(char32_t c) {
  return c < 0x20 || c == 0x7F || (c >= 0x80 && c <= 0x9F) || (c >= 0x202A && c <= 0x202E) ||
         (c >= 0x2066 && c <= 0x2069);
}

// Walks `text`, calling `control(offset, length, code point)` for each control character
// and `invalid(offset)` for each byte that is not UTF-8; stops where one returns true.
template <class Control, class Invalid, class Plain>
void walk(std::string_view text, Control control, Invalid invalid, Plain plain) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  for (size_t i = 0; i < text.size();) {
    const size_t length = sequence_at(text, i);
    if (length == 0) {
      if (invalid(i)) return;
      ++i;
      continue;
    }
    const char32_t c = code_point(s + i, length);
    if (is_control(c) ? control(i, length, c) : plain(i, length)) return;
    i += length;
  }
}

std::string escaped(std::string_view text, bool keep_newlines) {
  std::string out;
  out.reserve(text.size());
  walk(
      text,
      [&](size_t, size_t length, char32_t c) {
        if (c == '\n' && keep_newlines) {
          out += '\n';
        } else if (c == '\n' || c == '\t' || c == '\r') {
          out += c == '\n' ? "\\n" : c == '\t' ? "\\t" : "\\r";
        } else if (length == 1) {
          out += fmt::format("\\x{:02x}", static_cast<unsigned>(c));
        } else {
          out += fmt::format("\\u{:04X}", static_cast<unsigned>(c));
        }
        return false;
      },
      [&](size_t i) {
        out += fmt::format("\\x{:02x}", static_cast<unsigned char>(text[i]));
        return false;
      },
      [&](size_t i, size_t length) {
        out.append(text.substr(i, length));
        return false;
      });
  return out;
}

}  // namespace

size_t find_invalid_utf8(std::string_view text) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  for (size_t i = 0; i < text.size();) {
    bool valid = false;
    const size_t length = sequence(s, text.size(), i, valid);
    if (!valid) return i;
    i += length;
  }
  return std::string_view::npos;
}

std::string replace_invalid_utf8(std::string_view text) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    bool valid = false;
    const size_t length = sequence(s, text.size(), i, valid);
    if (valid) {
      out.append(text.substr(i, length));
    } else {
      out.append("\xEF\xBF\xBD");
    }
    i += length;
  }
  return out;
}

std::string clip(std::string_view text, size_t max_bytes) {
  if (text.size() <= max_bytes) return std::string(text);
  size_t end = max_bytes;
  // Back over continuation bytes to the start of the character that would be cut.
  while (end > 0 && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) --end;
  return std::string(text.substr(0, end)) + "... (" + std::to_string(text.size()) + " bytes in all)";
}

size_t find_control(std::string_view text, bool text_controls) {
  size_t found = std::string_view::npos;
  walk(
      text,
      [&](size_t i, size_t, char32_t c) {
        if (text_controls && (c == '\n' || c == '\t')) return false;
        found = i;
        return true;
      },
      [](size_t) { return false; }, [](size_t, size_t) { return false; });
  return found;
}

std::string printable(std::string_view text, size_t max_bytes) { return escaped(clip(text, max_bytes), false); }

std::string terminal_text(std::string_view text) { return escaped(text, true); }

}  // namespace remat::util
