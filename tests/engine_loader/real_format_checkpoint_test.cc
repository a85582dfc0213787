// tools/make_real_format_checkpoint.py through the engine's loader: the ctest
// tools.real_format_checkpoint writes a 2-layer tiny checkpoint in DeepSeek's release layout
// (sharded, FP8 + 128 x 128 scales, FP4 experts + 1 x 32 scales) and the same tensors as the tool
// dequantizes them (F32), and passes both directories here (PDSERVE_RF_QUANTIZED,
// PDSERVE_RF_REFERENCE). Skips when they are not set (a plain run of the binary).
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>

#include "engine/config.h"
#include "engine/memory_plan.h"
#include "engine/safetensors.h"
#include "engine/weights.h"
#include "gtest/gtest.h"

namespace pdserve::engine {
namespace {

TEST(RealFormatCheckpointTest, LoaderReturnsTheToolsOwnDequantization) {
  const char* quantized = std::getenv("PDSERVE_RF_QUANTIZED");
  const char* reference = std::getenv("PDSERVE_RF_REFERENCE");
  if (quantized == nullptr || reference == nullptr) GTEST_SKIP() << "run by ctest only";
  auto config = ModelConfig::Load(quantized);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->num_hidden_layers, 2);

  // The layout: several shards holding F8_E4M3 + F8_E8M0 scales and I8-packed FP4 experts.
  auto files = OpenCheckpointFiles(quantized);
  ASSERT_TRUE(files.ok()) << files.status();
  EXPECT_GT(files->size(), 1u);
  std::map<std::string, int> dtypes;
  for (const SafetensorsFile& f : *files) {
    for (const TensorInfo& t : f.tensors()) ++dtypes[DTypeName(t.dtype)];
  }
  EXPECT_GT(dtypes["F8_E4M3"], 0);
  EXPECT_GT(dtypes["F8_E8M0"], 0);
  EXPECT_GT(dtypes["I8"], 0);
  EXPECT_GT(dtypes["BF16"], 0);

  auto q = Weights::Load(quantized, *config);
  ASSERT_TRUE(q.ok()) << q.status();
  auto r = Weights::Load(reference, *config);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(q->all().size(), r->all().size());
  int64_t nonzero = 0;
  for (const auto& [name, t] : r->all()) {
    const Tensor& got = q->At(name);
    ASSERT_EQ(got.shape, t.shape) << name;
    ASSERT_EQ(got.data.size(), t.data.size()) << name;
    for (size_t i = 0; i < t.data.size(); ++i) {
      ASSERT_EQ(std::memcmp(&got.data[i], &t.data[i], sizeof(float)), 0)
          << name << "[" << i << "]: loader " << got.data[i] << ", tool " << t.data[i];
      nonzero += t.data[i] != 0.0f;
    }
  }
  EXPECT_GT(nonzero, 1000000);

  // The plan's config-only rule gives the bytes the tool stored (the headers' data sections).
  auto from_headers = PlanWeightBytes(quantized, *config);
  ASSERT_TRUE(from_headers.ok()) << from_headers.status();
  const WeightBytes from_rule = WeightBytesFromConfig(*config, /*quantized=*/true);
  EXPECT_EQ(from_headers->experts, from_rule.experts);
  EXPECT_EQ(from_headers->replicated, from_rule.replicated);
}

}  // namespace
}  // namespace pdserve::engine
