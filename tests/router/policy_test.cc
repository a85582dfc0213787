#include "router/policy.h"

#include <gtest/gtest.h>

#include <set>
#include <vector>

namespace pdserve::router {
namespace {

TEST(PolicyTest, ParsesTheFourNames) {
  EXPECT_EQ(*ParsePolicy("round_robin"), PolicyKind::kRoundRobin);
  EXPECT_EQ(*ParsePolicy("least_load"), PolicyKind::kLeastLoad);
  EXPECT_EQ(*ParsePolicy("power_of_two"), PolicyKind::kPowerOfTwo);
  EXPECT_EQ(*ParsePolicy("prefix_aware"), PolicyKind::kPrefixAware);
  EXPECT_FALSE(ParsePolicy("random").ok());
}

TEST(PolicyTest, RoundRobinSkipsWorkersThatAreDown) {
  Policy policy(PolicyKind::kRoundRobin);
  std::vector<Candidate> c = {{true, 0}, {false, 0}, {true, 0}};
  std::vector<int> picks;
  for (int i = 0; i < 4; ++i) picks.push_back(policy.Pick(c, {}));
  EXPECT_EQ(picks, (std::vector<int>{0, 2, 0, 2}));
}

TEST(PolicyTest, NoneUpIsMinusOne) {
  Policy policy(PolicyKind::kLeastLoad);
  std::vector<Candidate> c = {{false, 0}, {false, 0}};
  EXPECT_EQ(policy.Pick(c, {}), -1);
}

TEST(PolicyTest, LeastLoadTakesTheLowestLoadLowestIndexOnTies) {
  Policy policy(PolicyKind::kLeastLoad);
  EXPECT_EQ(policy.Pick(std::vector<Candidate>{{true, 3}, {true, 1}, {true, 1}}, {}), 1);
  EXPECT_EQ(policy.Pick(std::vector<Candidate>{{true, 3}, {true, 1}, {true, 1}}, {}, 1), 2);
}

TEST(PolicyTest, PowerOfTwoNeverPicksTheMostLoadedOfThree) {
  Policy policy(PolicyKind::kPowerOfTwo, 8, 7);
  std::vector<Candidate> c = {{true, 1}, {true, 50}, {true, 2}};
  for (int i = 0; i < 100; ++i) EXPECT_NE(policy.Pick(c, {}), 1);
}

TEST(PolicyTest, PrefixAwareSendsASharedPrefixToOneWorker) {
  Policy policy(PolicyKind::kPrefixAware, 4);
  std::vector<Candidate> c = {{true, 0}, {true, 0}, {true, 0}, {true, 0}};
  std::vector<int32_t> prefix(Policy::kPrefixTokens, 11);
  std::vector<int32_t> a = prefix, b = prefix;
  a.push_back(1);
  b.push_back(2);
  const int first = policy.Pick(c, a);
  EXPECT_EQ(policy.Pick(c, b), first);
  // Different prefixes spread over the workers.
  std::set<int> seen;
  for (int32_t t = 0; t < 64; ++t) seen.insert(policy.Pick(c, std::vector<int32_t>{t, t + 1}));
  EXPECT_EQ(seen.size(), 4u);
}

TEST(PolicyTest, PrefixAwareRespectsTheLoadCap) {
  Policy policy(PolicyKind::kPrefixAware, 4);
  std::vector<int32_t> prompt = {1, 2, 3};
  std::vector<Candidate> c = {{true, 0}, {true, 0}};
  const int home = policy.Pick(c, prompt);
  c[home].load = 4;
  EXPECT_EQ(policy.Pick(c, prompt), home);  // at the cap: still home
  c[home].load = 5;
  EXPECT_EQ(policy.Pick(c, prompt), 1 - home);
}

}  // namespace
}  // namespace pdserve::router
