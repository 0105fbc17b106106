// Feeds `remat prepare`'s text input up to the tokenizer: read_utf8_file (the checks on a
// --text file: NUL bytes, whitespace only, line length, UTF-8) and util::find_invalid_utf8. The
// SentencePiece steps after it are the tokenizer harness's (fuzz/tokenizer.cpp): the shim is
// dlopen'ed with RTLD_DEEPBIND, which AddressSanitizer's runtime refuses.
// A finding: anything but a std::runtime_error sentence out of read_utf8_file (a crash, a
// sanitizer report, a hang), a text it accepts that is not the file's bytes, or
// find_invalid_utf8 disagreeing with the decoder below, written the other way round: it
// decodes a code point first, then refuses overlong forms, surrogates and values above U+10FFFF.
#include <cstdint>
#include <exception>
#include <string>
#include <string_view>

#include "harness.h"
#include "remat/data.h"
#include "util/utf8.h"

namespace {

// The offset of the first ill-formed sequence, or npos: code points decoded, then range-checked.
size_t reference_invalid_utf8(std::string_view text) {
  size_t i = 0;
  while (i < text.size()) {
    const auto lead = static_cast<unsigned char>(text[i]);
    size_t length = lead < 0x80 ? 1 : (lead >> 5) == 0x6 ? 2 : (lead >> 4) == 0xE ? 3 : (lead >> 3) == 0x1E ? 4 : 0;
    if (length == 0 || i + length > text.size()) return i;
    uint32_t cp = length == 1 ? lead : lead & (0x7F >> length);
    for (size_t k = 1; k < length; ++k) {
      const auto b = static_cast<unsigned char>(text[i + k]);
      if ((b & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (b & 0x3F);
    }
    const uint32_t least[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < least[length] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
    i += length;
  }
  return std::string_view::npos;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  const size_t got = remat::util::find_invalid_utf8(bytes), want = reference_invalid_utf8(bytes);
  if (got != want) {
    remat::fuzz::finding("find_invalid_utf8 says " + std::to_string(got) + ", the reference decoder " +
                         std::to_string(want));
  }
  const remat::fuzz::TempFile file(remat::fuzz::temp_path("prepare"), data, size);
  try {
    const std::string text = remat::data::read_utf8_file(file.path());
    if (text != bytes) remat::fuzz::finding("read_utf8_file returned other bytes than the file holds");
  } catch (const std::runtime_error&) {
    return 0;
  }
  return 0;
}
