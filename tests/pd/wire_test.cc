// worker::SamplingFromProto: the wire's sampling fields as both workers read them.
#include "worker/wire.h"

#include <gtest/gtest.h>

#include "router/convert.h"

namespace pdserve::worker {
namespace {

TEST(SamplingFromProtoTest, ChoiceSelectsItsStreamAndZeroMeansOff) {
  pdserve::worker::v1::SamplingParams proto;
  proto.set_temperature(0.6f);
  proto.set_max_tokens(7);
  proto.set_seed(42);
  proto.set_choice(3);
  proto.set_logprobs(2);
  proto.add_stop_token_ids(9);
  absl::StatusOr<serving::SamplingParams> params = SamplingFromProto(proto, 100);
  ASSERT_TRUE(params.ok()) << params.status();
  EXPECT_EQ(params->n, 4);
  EXPECT_EQ(params->top_p, 1.0);
  EXPECT_EQ(params->repetition_penalty, 1.0);
  EXPECT_EQ(params->max_tokens, 7);
  EXPECT_EQ(params->seed, 42u);
  EXPECT_EQ(params->logprobs, 2);
  EXPECT_EQ(params->stop_token_ids, std::vector<int32_t>{9});
  EXPECT_FLOAT_EQ(static_cast<float>(params->temperature), 0.6f);
}

TEST(SamplingFromProtoTest, IgnoreEosTravelsAndLeavesMinTokensAlone) {
  pdserve::worker::v1::SamplingParams proto;
  proto.set_max_tokens(8);
  proto.set_min_tokens(2);
  proto.add_stop_token_ids(9);
  absl::StatusOr<serving::SamplingParams> params = SamplingFromProto(proto, 100);
  ASSERT_TRUE(params.ok()) << params.status();
  EXPECT_FALSE(params->ignore_eos);
  proto.set_ignore_eos(true);
  params = SamplingFromProto(proto, 100);
  ASSERT_TRUE(params.ok()) << params.status();
  EXPECT_TRUE(params->ignore_eos);
  EXPECT_EQ(params->min_tokens, 2);
  EXPECT_EQ(params->stop_token_ids, std::vector<int32_t>{9});
}

TEST(SamplingFromProtoTest, TheResponseFormatSchemaTravelsFromTheRouter) {
  serving::SamplingParams params;
  params.max_tokens = 8;
  params.json_schema = R"({"type":"object","properties":{"b":{},"a":{}}})";
  absl::StatusOr<serving::SamplingParams> read =
      SamplingFromProto(router::ToProto(params, /*choice=*/0), 100);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->json_schema, params.json_schema);
  params.min_tokens = 1;  // the JSON's end ends the choice: no min_tokens with it
  EXPECT_EQ(SamplingFromProto(router::ToProto(params, 0), 100).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(SamplingFromProtoTest, OutOfRangeFieldsAreInvalidArgument) {
  pdserve::worker::v1::SamplingParams proto;
  proto.set_max_tokens(0);
  EXPECT_EQ(SamplingFromProto(proto, 100).status().code(), absl::StatusCode::kInvalidArgument);
  proto.set_max_tokens(4);
  proto.set_top_p(1.5f);
  EXPECT_EQ(SamplingFromProto(proto, 100).status().code(), absl::StatusCode::kInvalidArgument);
  proto.set_top_p(0.9f);
  proto.set_choice(1000);
  EXPECT_EQ(SamplingFromProto(proto, 100).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdserve::worker
