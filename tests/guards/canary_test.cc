// guards::CheckLastTokenLogits and CanarySampler on the bundled model: the serving path's logits
// (prefill, then token-by-token decode) pass, a logit vector perturbed by 1% of its range fails,
// and the sampler picks a stable 1 in N of request ids.
#include "guards/canary.h"

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/model.h"
#include "gtest/gtest.h"

namespace pdserve::guards {
namespace {

const engine::Model& BundledModel() {
  static const engine::Model* model =
      new engine::Model(*engine::Model::Load(PDSERVE_BUNDLED_MODEL));
  return *model;
}

// 120 tokens (past the 64-token window and many CSA windows), prefilled 50 then decoded one by one.
struct Served {
  std::vector<int32_t> tokens;
  std::vector<float> last_logits;
};

Served ComputeIncrementally() {
  const engine::Model& model = BundledModel();
  Served s;
  for (int i = 0; i < 120; ++i) s.tokens.push_back((i * 733 + 11) % 4000 + 3);
  engine::ModelState state = model.NewState();
  std::vector<int32_t> prefill(s.tokens.begin(), s.tokens.begin() + 50);
  engine::Tensor logits = *model.Forward(&state, prefill);
  for (size_t i = 50; i < s.tokens.size(); ++i) logits = *model.Forward(&state, {s.tokens[i]});
  s.last_logits.assign(logits.ptr(), logits.ptr() + logits.dim(1));
  return s;
}

// Computed once per test binary (70 decode steps are slow on a loaded CI machine); tests copy it.
const Served& ServeIncrementally() {
  static const Served* served = new Served(ComputeIncrementally());
  return *served;
}

TEST(CanaryTest, IncrementalLogitsPass) {
  const Served s = ServeIncrementally();
  absl::StatusOr<CanaryResult> r = CheckLastTokenLogits(BundledModel(), s.tokens, s.last_logits);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->pass);
  // Measured 2026-12-01: ~1e-6 (float summation order); the tolerance is 1e-3.
  EXPECT_LT(r->error, 1e-5);
  EXPECT_GT(r->max_abs_ref, 1.0);
  RecordProperty("normal_error", absl::StrCat(r->error));
  std::printf("canary normal error (prefill 50 + 70 decode steps): %.3g\n", r->error);
}

TEST(CanaryTest, PerturbedLogitFails) {
  Served s = ServeIncrementally();
  absl::StatusOr<CanaryResult> clean =
      CheckLastTokenLogits(BundledModel(), s.tokens, s.last_logits);
  ASSERT_TRUE(clean.ok());
  s.last_logits[1234] += static_cast<float>(0.01 * clean->max_abs_ref);
  absl::StatusOr<CanaryResult> r = CheckLastTokenLogits(BundledModel(), s.tokens, s.last_logits);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->pass);
  EXPECT_NEAR(r->error, 0.01, 1e-4);
  const absl::Status error = CanaryMismatchError("sequence 3", *r);
  EXPECT_TRUE(absl::IsInternal(error));
  EXPECT_NE(error.message().find("canary mismatch: sequence 3"), std::string::npos);
}

TEST(CanaryTest, LogitsOfAnotherContextFail) {
  // What contamination looks like: right shape, plausible values, another sequence's logits.
  Served s = ServeIncrementally();
  std::vector<int32_t> other = s.tokens;
  other[100] = 5;
  engine::ModelState state = BundledModel().NewState();
  engine::Tensor logits = *BundledModel().Forward(&state, other);
  std::vector<float> wrong(logits.ptr() + (logits.dim(0) - 1) * logits.dim(1),
                           logits.ptr() + logits.dim(0) * logits.dim(1));
  absl::StatusOr<CanaryResult> r = CheckLastTokenLogits(BundledModel(), s.tokens, wrong);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->pass) << r->error;
}

TEST(CanaryTest, NanFails) {
  Served s = ServeIncrementally();
  s.last_logits[7] = std::nanf("");
  absl::StatusOr<CanaryResult> r = CheckLastTokenLogits(BundledModel(), s.tokens, s.last_logits);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->pass);
}

TEST(CanaryTest, BadInputsAreInvalidArgument) {
  const Served s = ServeIncrementally();
  EXPECT_TRUE(
      absl::IsInvalidArgument(CheckLastTokenLogits(BundledModel(), {}, s.last_logits).status()));
  std::vector<float> short_logits(10, 0.0f);
  EXPECT_TRUE(absl::IsInvalidArgument(
      CheckLastTokenLogits(BundledModel(), s.tokens, short_logits).status()));
  std::vector<int32_t> too_long(513, 3);
  EXPECT_TRUE(absl::IsInvalidArgument(
      CheckLastTokenLogits(BundledModel(), too_long, s.last_logits).status()));
}

// CompareLogits alone (what the CUDA runner compares its GPU recompute with): the normalized
// error, the tolerance as an inclusive bound, NaN / Inf on either side, bad sizes.
TEST(CanaryCompareTest, NormalizedErrorAgainstTolerance) {
  const std::vector<float> ref = {1.0f, -4.0f, 2.0f, 0.5f};
  std::vector<float> served = ref;
  served[2] += 0.2f;  // max|diff| 0.2, max|ref| 4
  absl::StatusOr<CanaryResult> r = CompareLogits(served, ref, kGpuCanaryTolerance);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NEAR(r->max_abs_diff, 0.2, 1e-6);
  EXPECT_DOUBLE_EQ(r->max_abs_ref, 4.0);
  EXPECT_NEAR(r->error, 0.05, 1e-6);
  EXPECT_FALSE(CompareLogits(served, ref, 0.049)->pass);
  EXPECT_TRUE(CompareLogits(served, ref, 0.051)->pass);
  EXPECT_TRUE(CompareLogits(ref, ref, 0.0)->pass);
  EXPECT_DOUBLE_EQ(CompareLogits(ref, ref, 0.0)->error, 0.0);
}

TEST(CanaryCompareTest, NonFiniteOnEitherSideFails) {
  const std::vector<float> ref = {1.0f, 2.0f, 3.0f};
  std::vector<float> nan_served = ref;
  nan_served[1] = std::nanf("");
  std::vector<float> inf_ref = ref;
  inf_ref[0] = INFINITY;
  for (const auto& [served, want] : {std::pair{nan_served, ref}, std::pair{ref, inf_ref}}) {
    absl::StatusOr<CanaryResult> r = CompareLogits(served, want, 1.0);
    ASSERT_TRUE(r.ok());
    EXPECT_FALSE(r->pass);
    EXPECT_TRUE(std::isinf(r->error));
  }
}

TEST(CanaryCompareTest, SizesMustMatch) {
  const std::vector<float> three(3, 1.0f);
  const std::vector<float> four(4, 1.0f);
  EXPECT_TRUE(absl::IsInvalidArgument(CompareLogits(three, four, 1.0).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(CompareLogits({}, {}, 1.0).status()));
}

TEST(CanarySamplerTest, PicksOneInNDeterministically) {
  const CanarySampler never(0);
  const CanarySampler always(1);
  const CanarySampler one_in_10(10);
  int picked = 0;
  for (int i = 0; i < 10000; ++i) {
    const std::string id = absl::StrCat("chatcmpl-", i);
    EXPECT_FALSE(never.Picks(id));
    EXPECT_TRUE(always.Picks(id));
    if (one_in_10.Picks(id)) ++picked;
    EXPECT_EQ(one_in_10.Picks(id), CanarySampler(10).Picks(id));
  }
  // xxh3-64 over these fixed ids: a fixed count, near 1000.
  EXPECT_GT(picked, 900);
  EXPECT_LT(picked, 1100);
}

}  // namespace
}  // namespace pdserve::guards
