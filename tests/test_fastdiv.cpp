// FastDiv against the built-in division: small and large divisors, powers of two and their
// neighbours, every numerator near the multiples of the divisor, and random numerators below 2^31.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "moekit/common/fastdiv.h"

namespace moekit {
namespace {

TEST(FastDiv, MatchesIntegerDivision) {
  std::vector<uint32_t> divisors;
  for (uint32_t d = 1; d <= 300; ++d) divisors.push_back(d);
  for (int b = 9; b < 31; ++b)
    for (int64_t o : {-1, 0, 1}) divisors.push_back(uint32_t((int64_t(1) << b) + o));
  for (uint32_t d : {396u, 264u, 528u, 1056u, 2881u, 45u, 90u, 112u, 7168u, 123456789u, 0x7fffffffu})
    divisors.push_back(d);
  std::mt19937 rng(5);
  std::uniform_int_distribution<uint32_t> any(0, 0x7fffffffu);
  int64_t bad = 0;
  for (uint32_t d : divisors) {
    const FastDiv f = FastDiv::make(d);
    auto check = [&](uint32_t n) {
      if (n > 0x7fffffffu) return;
      bad += f.div(n) != n / d;
    };
    for (uint32_t n = 0; n < 2000; ++n) check(n);
    for (uint32_t q : {1u, 2u, 3u, 1000u, 0x7fffffffu / d, 0x7fffffffu / d - 1})
      for (int64_t o : {-1, 0, 1}) check(uint32_t(int64_t(q) * d + o));
    for (int i = 0; i < 2000; ++i) check(any(rng));
    check(0x7fffffffu);
  }
  EXPECT_EQ(bad, 0);
  EXPECT_EQ(FastDiv::make(4).div(int(13)), 3);
}

}  // namespace
}  // namespace moekit
