#include "serving/philox.h"

#include "gtest/gtest.h"

namespace pdserve::serving {
namespace {

// Known answers from Random123 (github.com/DEShawResearch/random123, tests/kat_vectors, the three
// "philox4x32 10" lines: counter, key, expected output), the reference implementation of
// Salmon et al. 2011.
TEST(PhiloxTest, MatchesRandom123KnownAnswers) {
  EXPECT_EQ(Philox4x32({0, 0, 0, 0}, {0, 0}),
            (PhiloxCounter{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(Philox4x32({0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff}),
            (PhiloxCounter{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  EXPECT_EQ(Philox4x32({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0}),
            (PhiloxCounter{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
}

TEST(PhiloxTest, UniformTakesTop53BitsOfFirstTwoWords) {
  const uint64_t word = (uint64_t{0x6627e8d5} << 32) | 0xe169c58d;
  EXPECT_EQ(PhiloxUniform({0, 0, 0, 0}, {0, 0}),
            static_cast<double>(word >> 11) / 9007199254740992.0);
}

}  // namespace
}  // namespace pdserve::serving
