#include "util/sha256.h"

#include <gtest/gtest.h>

namespace {

using remat::util::Sha256;
using remat::util::sha256_hex;

// FIPS 180-4 / NIST example vectors.
TEST(Sha256, KnownVectors) {
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
}

TEST(Sha256, IncrementalEqualsOneShot) {
  // One million 'a', fed in uneven pieces that straddle block boundaries.
  const std::string a(1000000, 'a');
  Sha256 hash;
  size_t pos = 0, step = 1;
  while (pos < a.size()) {
    const size_t n = std::min(step, a.size() - pos);
    hash.update(a.data() + pos, n);
    pos += n;
    step = step * 3 % 127 + 1;
  }
  EXPECT_EQ(hash.hex_digest(), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  EXPECT_EQ(sha256_hex(a), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

}  // namespace
