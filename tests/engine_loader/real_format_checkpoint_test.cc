// tools/make_real_format_checkpoint.py through the engine's loader: the ctest
// tools.real_format_checkpoint writes a 2-layer tiny checkpoint in DeepSeek's release layout
// (sharded, FP8 + 128 x 128 scales, FP4 experts + 1 x 32 scales) and the same tensors as the tool
// dequantizes them (F32), and passes both directories here (PDSERVE_RF_QUANTIZED,
// PDSERVE_RF_REFERENCE). Skips when they are not set (a plain run of the binary).
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "engine/config.h"
#include "engine/memory_plan.h"
#include "engine/quant.h"
#include "engine/safetensors.h"
#include "engine/stored_experts.h"
#include "engine/stored_fp8.h"
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

// The GPU engine's FP8 path (engine/stored_fp8.h, WeightsLoadOptions::skip_fp8_matrices): every
// FP8 projection listed with its stored bytes, whose dequantization is the loader's value bit for
// bit, and a load that leaves exactly those projections out and every other tensor as before.
TEST(RealFormatCheckpointTest, Fp8ProjectionsStayStoredWithTheLoadersValues) {
  const char* quantized = std::getenv("PDSERVE_RF_QUANTIZED");
  if (quantized == nullptr) GTEST_SKIP() << "run by ctest only";
  auto config = ModelConfig::Load(quantized);
  ASSERT_TRUE(config.ok()) << config.status();
  auto full = Weights::Load(quantized, *config);
  ASSERT_TRUE(full.ok()) << full.status();
  WeightsLoadOptions options;
  options.skip_fp8_matrices = true;
  auto slim = Weights::Load(quantized, *config, options);
  ASSERT_TRUE(slim.ok()) << slim.status();
  auto stored = StoredFp8Weights::Open(quantized);
  ASSERT_TRUE(stored.ok()) << stored.status();

  int64_t projections = 0;
  for (const std::string& name : stored->Names()) {
    auto m = stored->Get(name);
    ASSERT_TRUE(m.ok()) << m.status();
    ASSERT_EQ(m->weight.size(), static_cast<size_t>(m->rows * m->cols)) << name;
    ASSERT_EQ(m->scales.size(),
              static_cast<size_t>(((m->rows + 127) / 128) * ((m->cols + 127) / 128)))
        << name;
    const std::vector<float> values = DequantizeStored(*m);
    const Tensor& want = full->At(name);
    ASSERT_EQ(values.size(), want.data.size()) << name;
    ASSERT_EQ(std::memcmp(values.data(), want.data.data(), values.size() * sizeof(float)), 0)
        << name;
    if (name.ends_with("_proj.weight")) {
      ++projections;
      EXPECT_TRUE(slim->left_stored().count(name)) << name;
      EXPECT_FALSE(slim->Get(name).ok()) << name;
    }
  }
  // 2 layers (sliding, CSA): q_a q_b kv o_a o_b + 3 shared experts each, and the CSA layer's
  // compressor 2 + indexer compressor 2 + indexer q_b and weights_proj.
  EXPECT_EQ(projections, 2 * 8 + 6);
  EXPECT_EQ(static_cast<int64_t>(slim->left_stored().size()), projections);
  EXPECT_EQ(slim->all().size() + slim->left_stored().size(), full->all().size());
  for (const auto& [name, t] : slim->all()) {
    const Tensor& want = full->At(name);
    ASSERT_EQ(t.data.size(), want.data.size()) << name;
    ASSERT_EQ(std::memcmp(t.data.data(), want.data.data(), t.data.size() * sizeof(float)), 0)
        << name;
  }
}

// The GPU engine's FP8 experts (engine/stored_experts.h, WeightsLoadOptions::
// skip_quantized_experts): the tool's FP4 experts become FP8 whose dequantization is the loader's
// value bit for bit (the tool's ue8m0 scales make the conversion exact), expert by expert, and a
// load that leaves exactly the stacked expert tensors out.
TEST(RealFormatCheckpointTest, Fp4ExpertsBecomeFp8WithTheLoadersValues) {
  const char* quantized = std::getenv("PDSERVE_RF_QUANTIZED");
  if (quantized == nullptr) GTEST_SKIP() << "run by ctest only";
  auto config = ModelConfig::Load(quantized);
  ASSERT_TRUE(config.ok()) << config.status();
  auto full = Weights::Load(quantized, *config);
  ASSERT_TRUE(full.ok()) << full.status();
  WeightsLoadOptions options;
  options.skip_quantized_experts = true;
  auto slim = Weights::Load(quantized, *config, options);
  ASSERT_TRUE(slim.ok()) << slim.status();
  auto stored = StoredExperts::Open(quantized, *config);
  ASSERT_TRUE(stored.ok()) << stored.status();

  const int64_t hidden = config->hidden_size, inter = config->moe_intermediate_size;
  int64_t checked = 0;
  for (int64_t l = 0; l < config->num_hidden_layers; ++l) {
    for (const char* part : {"gate_up_proj", "down_proj"}) {
      const std::string name = "model.layers." + std::to_string(l) + ".mlp.experts." + part;
      ASSERT_TRUE(stored->Has(name)) << name;
      EXPECT_TRUE(slim->left_stored().count(name)) << name;
      EXPECT_FALSE(slim->Get(name).ok()) << name;
      const Tensor& want = full->At(name);
      const bool down = std::string(part) == "down_proj";
      const int64_t rows = down ? hidden : 2 * inter, cols = down ? inter : hidden;
      for (int64_t e = 0; e < config->n_routed_experts; ++e) {
        auto got = stored->Expert(name, e);
        ASSERT_TRUE(got.ok()) << got.status();
        ASSERT_EQ(got->rows, rows);
        ASSERT_EQ(got->cols, cols);
        ASSERT_EQ(got->scales.size(), static_cast<size_t>((rows + 127) / 128 * (cols / 128)));
        std::vector<float> values(static_cast<size_t>(rows * cols));
        DequantizeFp8(got->weight.data(), rows, cols, got->scales.data(), values.data());
        ASSERT_EQ(std::memcmp(values.data(), want.data.data() + e * rows * cols,
                              values.size() * sizeof(float)),
                  0)
            << name << " expert " << e;
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, config->num_hidden_layers * 2 * config->n_routed_experts);
  EXPECT_FALSE(stored->Expert("model.layers.0.mlp.experts.gate_up_proj", 1 << 20).ok());
  EXPECT_EQ(static_cast<int64_t>(slim->left_stored().size()), config->num_hidden_layers * 2);
  EXPECT_EQ(slim->all().size() + slim->left_stored().size(), full->all().size());
}

}  // namespace
}  // namespace pdserve::engine
