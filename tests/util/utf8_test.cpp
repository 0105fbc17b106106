#include "util/utf8.h"

#include <gtest/gtest.h>

#include <string>

namespace remat::util {
namespace {

TEST(Utf8, FindsTheFirstInvalidSequence) {
  EXPECT_EQ(find_invalid_utf8("plain ascii"), std::string::npos);
  EXPECT_EQ(find_invalid_utf8("\xC3\xA9\xE2\x82\xAC\xF0\x9F\x99\x82\xF4\x8F\xBF\xBF"), std::string::npos);
  EXPECT_EQ(find_invalid_utf8("ab\xC0\x80"), 2u);        // overlong NUL
  EXPECT_EQ(find_invalid_utf8("ab\xE0\x80\x80"), 2u);    // overlong 3-byte
  EXPECT_EQ(find_invalid_utf8("a\xED\xA0\x80"), 1u);     // UTF-16 surrogate
  EXPECT_EQ(find_invalid_utf8("\xF4\x90\x80\x80"), 0u);  // above U+10FFFF
  EXPECT_EQ(find_invalid_utf8("abc\xE2\x82"), 3u);       // truncated at the end
  EXPECT_EQ(find_invalid_utf8("\x80"), 0u);              // stray continuation byte
  EXPECT_EQ(find_invalid_utf8("\xE2\x28\xA1"), 0u);      // bad continuation
}

// One U+FFFD per maximal subpart, the count Python's and Rust's lossy decoders give (the
// tokenizer goldens hold the same on longer text).
TEST(Utf8, ReplacesEachMaximalSubpartOfAnInvalidSequence) {
  const std::string r = "\xEF\xBF\xBD";
  EXPECT_EQ(replace_invalid_utf8("valid \xC3\xA9"), "valid \xC3\xA9");
  EXPECT_EQ(replace_invalid_utf8("a\xE2\x82 b"), "a" + r + " b");      // truncated: one
  EXPECT_EQ(replace_invalid_utf8("\xF0\x9F\x98"), r);                  // truncated at the end
  EXPECT_EQ(replace_invalid_utf8("\xED\xA0\x80"), r + r + r);          // surrogate: each byte
  EXPECT_EQ(replace_invalid_utf8("\xC0\xAF"), r + r);                  // overlong
  EXPECT_EQ(replace_invalid_utf8("\xF4\x90\x80\x80"), r + r + r + r);  // above U+10FFFF
  EXPECT_EQ(replace_invalid_utf8("\xE2\x28\xA1"), r + "(" + r);        // bad continuation
  EXPECT_EQ(replace_invalid_utf8("\xFF\xFE"), r + r);
}

// Text from a file or an argument reaches a message escaped: nothing that moves the
// cursor, clears the screen, starts a line, reorders one or ends a C string.
TEST(Utf8, PrintableEscapesEveryControlCharacterAndInvalidByte) {
  EXPECT_EQ(printable("layer.0\x1b[2J"), "layer.0\\x1b[2J");
  EXPECT_EQ(printable(std::string("a\0b", 3)), "a\\x00b");
  EXPECT_EQ(printable("one\ntwo\r\tthree\x7f"), "one\\ntwo\\r\\tthree\\x7f");
  EXPECT_EQ(printable("\xC2\x9B"
                      "31m"),
            "\\u009B31m");                                      // C1's CSI
  EXPECT_EQ(printable("abc\xE2\x80\xAEgpj"), "abc\\u202Egpj");  // right-to-left override
  EXPECT_EQ(printable("b\x93ock\xE2\x82"), "b\\x93ock\\xe2\\x82");
  EXPECT_EQ(printable("Grüße, 世界 🙂"), "Grüße, 世界 🙂");
  // Clipped first, never inside a character, then escaped.
  EXPECT_EQ(printable("ab\x01" + std::string(300, 'x'), 4), "ab\\x01x... (303 bytes in all)");
  EXPECT_EQ(printable("aé", 2), "a... (3 bytes in all)");
  // A whole message keeps its line breaks and nothing else.
  EXPECT_EQ(terminal_text("line one\nline\x1b]0;two\x07"), "line one\nline\\x1b]0;two\\x07");
}

TEST(Utf8, FindsTheFirstControlCharacter) {
  EXPECT_EQ(find_control("plain, é"), std::string::npos);
  EXPECT_EQ(find_control("ab\x1b"), 2u);
  EXPECT_EQ(find_control("a\nb\tc"), 1u);
  EXPECT_EQ(find_control("a\nb\tc", true), std::string::npos);
  EXPECT_EQ(find_control("a\nb\rc", true), 3u);
  EXPECT_EQ(find_control("x\xE2\x81\xA6"), 1u);         // U+2066, an isolate
  EXPECT_EQ(find_control("b\x93"), std::string::npos);  // not UTF-8, which find_invalid_utf8 finds
}

}  // namespace
}  // namespace remat::util
