#include "common/api_keys.h"

#include <gtest/gtest.h>

#include <string>

namespace pdserve::common {
namespace {

TEST(ApiKeysTest, AcceptsEachKeyOfTheFileAsBearer) {
  auto keys = ApiKeys::FromText("# team a\nsk-alpha\n\n  sk-beta\t\n", "keys.txt");
  ASSERT_TRUE(keys.ok()) << keys.status();
  EXPECT_EQ((*keys)->size(), 2u);
  EXPECT_TRUE((*keys)->Matches("Bearer sk-alpha"));
  EXPECT_TRUE((*keys)->Matches("Bearer sk-beta"));
  EXPECT_TRUE((*keys)->Matches("bearer sk-beta"));  // the scheme is case-insensitive
  EXPECT_TRUE((*keys)->Matches("BEARER  sk-alpha "));
}

TEST(ApiKeysTest, RefusesWrongMissingAndMalformedCredentials) {
  auto keys = ApiKeys::FromText("sk-alpha\n", "keys.txt");
  ASSERT_TRUE(keys.ok()) << keys.status();
  EXPECT_FALSE((*keys)->Matches(""));
  EXPECT_FALSE((*keys)->Matches("Bearer "));
  EXPECT_FALSE((*keys)->Matches("Bearer sk-alph"));    // a prefix of the key
  EXPECT_FALSE((*keys)->Matches("Bearer sk-alphaa"));  // the key and more
  EXPECT_FALSE((*keys)->Matches("sk-alpha"));          // no scheme
  EXPECT_FALSE((*keys)->Matches("Basic sk-alpha"));
  EXPECT_FALSE((*keys)->Matches("Bearer # team a"));  // comments are not keys
}

TEST(ApiKeysTest, AFileWithoutKeysIsAnError) {
  auto keys = ApiKeys::FromText("# nobody\n\n", "keys.txt");
  ASSERT_FALSE(keys.ok());
  EXPECT_EQ(keys.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(keys.status().message().find("keys.txt: no API key"), std::string::npos);
}

TEST(ApiKeysTest, AKeyWithASpaceIsRefusedWithoutEchoingIt) {
  auto keys = ApiKeys::FromText("sk-good\nsk secret half\n", "keys.txt");
  ASSERT_FALSE(keys.ok());
  EXPECT_NE(keys.status().message().find("keys.txt:2:"), std::string::npos);
  EXPECT_EQ(keys.status().message().find("secret"), std::string::npos);
}

TEST(ApiKeysTest, AMissingFileIsNotFound) {
  auto keys = ApiKeys::LoadFile("/nonexistent/pdserve-keys.txt");
  ASSERT_FALSE(keys.ok());
  EXPECT_EQ(keys.status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace pdserve::common
