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

}  // namespace
}  // namespace remat::util
