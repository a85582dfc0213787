#include "router/policy.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "xxhash.h"

namespace pdserve::router {

absl::StatusOr<PolicyKind> ParsePolicy(std::string_view name) {
  if (name == "round_robin") return PolicyKind::kRoundRobin;
  if (name == "least_load") return PolicyKind::kLeastLoad;
  if (name == "power_of_two") return PolicyKind::kPowerOfTwo;
  if (name == "prefix_aware") return PolicyKind::kPrefixAware;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown policy \"", std::string(name),
                   "\"; expected round_robin, least_load, power_of_two or prefix_aware"));
}

Policy::Policy(PolicyKind kind, int64_t load_cap, uint64_t seed)
    : kind_(kind), load_cap_(load_cap), random_(seed) {}

int Policy::LeastLoad(std::span<const Candidate> candidates, int exclude) const {
  int best = -1;
  for (int i = 0; i < static_cast<int>(candidates.size()); ++i) {
    if (!candidates[i].up || i == exclude) continue;
    if (best < 0 || candidates[i].load < candidates[best].load) best = i;
  }
  return best;
}

int Policy::Pick(std::span<const Candidate> candidates, std::span<const int32_t> prompt,
                 int exclude) {
  std::vector<int> up;
  for (int i = 0; i < static_cast<int>(candidates.size()); ++i) {
    if (candidates[i].up && i != exclude) up.push_back(i);
  }
  if (up.empty()) return -1;
  switch (kind_) {
    case PolicyKind::kRoundRobin: {
      absl::MutexLock lock(&mu_);
      return up[cursor_++ % up.size()];
    }
    case PolicyKind::kLeastLoad:
      return LeastLoad(candidates, exclude);
    case PolicyKind::kPowerOfTwo: {
      if (up.size() == 1) return up[0];
      size_t a, b;
      {
        absl::MutexLock lock(&mu_);
        a = random_() % up.size();
        b = random_() % (up.size() - 1);
      }
      if (b >= a) ++b;
      const int x = up[a], y = up[b];
      if (candidates[x].load != candidates[y].load) {
        return candidates[x].load < candidates[y].load ? x : y;
      }
      return std::min(x, y);
    }
    case PolicyKind::kPrefixAware: {
      const size_t n = std::min(prompt.size(), kPrefixTokens);
      const uint64_t prefix = XXH3_64bits(prompt.data(), n * sizeof(int32_t));
      int best = -1;
      uint64_t best_score = 0;
      for (int i : up) {
        const uint64_t key[2] = {prefix, static_cast<uint64_t>(i)};
        const uint64_t score = XXH3_64bits(key, sizeof(key));
        if (best < 0 || score > best_score) {
          best = i;
          best_score = score;
        }
      }
      const int least = LeastLoad(candidates, exclude);
      if (candidates[best].load - candidates[least].load > load_cap_) return least;
      return best;
    }
  }
  return -1;
}

}  // namespace pdserve::router
