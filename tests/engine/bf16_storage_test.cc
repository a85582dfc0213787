// ModelOptions::EmulateGpuStorage (the CPU emulation of the CUDA engine's storage precision, used
// by tests/engine_gpu): every stored key, compressed entry and indexer key is a bf16 value, the
// logits move by rounding-sized amounts only, and the default engine is untouched by it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "engine/config.h"
#include "engine/model.h"
#include "engine/quant.h"
#include "engine/random_weights.h"
#include "engine/weights.h"
#include "nlohmann/json.hpp"
#include "tests/engine/rounded_weights.h"
#include "tests/engine/tiny_config.h"

namespace pdserve::engine {
namespace {

bool AllBf16(const Tensor& t) {
  return std::all_of(t.data.begin(), t.data.end(), [](float v) { return RoundToBf16(v) == v; });
}

TEST(Bf16StorageTest, StoredRowsAreBf16AndLogitsMoveByRoundingOnly) {
  const ModelConfig config = testing::TinyConfig();
  const Weights weights = RandomWeights(config, 7);
  ModelOptions rounded;
  rounded.EmulateGpuStorage();
  auto plain = Model::FromWeights(config, weights);
  auto emulated = Model::FromWeights(config, weights, rounded);
  ASSERT_TRUE(plain.ok() && emulated.ok());
  std::mt19937_64 rng(3);
  std::vector<int32_t> tokens(41);
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % config.vocab_size);
  ModelState a = plain->NewState();
  ModelState b = emulated->NewState();
  auto la = plain->Forward(&a, tokens);
  auto lb = emulated->Forward(&b, tokens);
  ASSERT_TRUE(la.ok() && lb.ok());

  bool any_plain_not_bf16 = false;
  for (size_t l = 0; l < b.layers.size(); ++l) {
    EXPECT_TRUE(AllBf16(b.layers[l].window_kv)) << "layer " << l;
    EXPECT_TRUE(AllBf16(b.layers[l].compressor.entries)) << "layer " << l;
    EXPECT_TRUE(AllBf16(b.layers[l].indexer.entries)) << "layer " << l;
    any_plain_not_bf16 |= !AllBf16(a.layers[l].window_kv);
  }
  EXPECT_TRUE(any_plain_not_bf16) << "the default engine must keep fp32 state";

  // Per position, max|diff| / max|ref| over the vocabulary. Rounding the state moves most
  // positions by rounding-sized amounts; a discrete choice at a near-tie (an expert or an indexer
  // entry) can flip and move a position and the ones after it by more, so the bound is on the
  // median position, and the two engines must still differ somewhere.
  const int64_t vocab = config.vocab_size;
  std::vector<double> errors;
  for (size_t pos = 0; pos < tokens.size(); ++pos) {
    double max_diff = 0.0;
    double max_ref = 0.0;
    for (int64_t v = 0; v < vocab; ++v) {
      const double ref = la->data[pos * vocab + v];
      max_diff = std::max(max_diff, std::abs(ref - lb->data[pos * vocab + v]));
      max_ref = std::max(max_ref, std::abs(ref));
    }
    errors.push_back(max_diff / max_ref);
  }
  std::sort(errors.begin(), errors.end());
  std::cout << "bf16 storage vs fp32, per position: min " << errors.front() << ", median "
            << errors[errors.size() / 2] << ", max " << errors.back() << "\n";
  EXPECT_GT(errors.back(), 0.0);
  EXPECT_LT(errors[errors.size() / 2], 2e-2);  // issue 10's bf16 bound
}

TEST(Bf16StorageTest, RoundToBf16RoundsToNearestEven) {
  EXPECT_EQ(RoundToBf16(1.0f), 1.0f);
  // 1 + 2^-8 lies halfway between bf16 neighbours 1 and 1 + 2^-7: ties go to the even one, 1.
  EXPECT_EQ(RoundToBf16(1.0f + 1.0f / 256), 1.0f);
  EXPECT_EQ(RoundToBf16(1.0f + 3.0f / 256), 1.0f + 4.0f / 256);
  EXPECT_EQ(RoundToBf16(-2.5f), -2.5f);
  EXPECT_TRUE(std::isnan(RoundToBf16(std::nanf(""))));
  EXPECT_TRUE(std::isinf(RoundToBf16(INFINITY)));
}

// A model directory and the prompts the GPU tests run on it (tests/engine_gpu/gpu_test_models.h):
// the transformers fixtures' cases and the bundled model's fixture prompts plus 300 held-out
// tokens.
struct StudyModel {
  std::string name;
  std::filesystem::path dir;
  std::vector<std::vector<int32_t>> prompts;
};

std::vector<StudyModel> StudyModels() {
  namespace fs = std::filesystem;
  std::vector<StudyModel> models;
  for (const char* name : {"mixed_yarn_f32", "csa_sigmoid_bf16", "legacy_f32"}) {
    const fs::path dir = fs::path(PDSERVE_ENGINE_FIXTURES_DIR) / name;
    std::ifstream in(dir / "cases.json");
    StudyModel m{name, dir / "model", {}};
    const nlohmann::json cases = nlohmann::json::parse(in);
    for (const auto& c : cases.at("cases")) {
      m.prompts.push_back(c.at("tokens").get<std::vector<int32_t>>());
    }
    models.push_back(std::move(m));
  }
  const fs::path small = PDSERVE_SMALL_MODEL_FIXTURES_DIR;
  StudyModel kjv{"kjv-v4-tiny", PDSERVE_BUNDLED_MODEL, {}};
  std::ifstream in(small / "logits.json");
  const nlohmann::json fixture = nlohmann::json::parse(in);
  for (const auto& p : fixture.at("prompts")) {
    kjv.prompts.push_back(p.at("ids").get<std::vector<int32_t>>());
  }
  std::ifstream held(small / "heldout_slice_ids.bin", std::ios::binary);
  std::vector<uint32_t> raw(300);
  held.read(reinterpret_cast<char*>(raw.data()), static_cast<std::streamsize>(raw.size() * 4));
  EXPECT_TRUE(held.good());
  kjv.prompts.emplace_back(raw.begin(), raw.end());
  models.push_back(std::move(kjv));
  return models;
}

// Issue 10's bound (max|diff| / max|ref| <= 2e-2 per position, the maximum of |ref| taken over the
// prompt) on the CPU engine alone: the fp32 engine against itself with one precision change of
// the CUDA engine's at a time. Rounding the weights to bf16 keeps every position within the
// bound; rounding the state (bf16_state, which the issue prescribes for the GPU) or the experts'
// input flips discrete choices made at near-ties (experts, top-k entries) on some positions and
// moves them past it, with argmax agreement still >= 99%. So no engine that stores the state in
// bf16 meets the bound on every position of these prompts (docs/engine-gpu.md).
TEST(Bf16StorageTest, EachGpuRoundingAloneOnTheFixtures) {
  struct Variant {
    const char* name;
    bool state;
    bool experts;
  };
  const Variant variants[] = {{"bf16 weights", false, false},
                              {"bf16 weights + bf16 state", true, false},
                              {"bf16 weights + bf16 expert input", false, true},
                              {"bf16 weights + both (the CUDA engine)", true, true}};
  const std::vector<StudyModel> models = StudyModels();
  for (const Variant& v : variants) {
    int64_t rows = 0;
    int64_t over = 0;
    int64_t argmax_equal = 0;
    double worst = 0.0;
    for (const StudyModel& m : models) {
      auto config = ModelConfig::Load(m.dir.string());
      ASSERT_TRUE(config.ok()) << config.status();
      auto weights = Weights::Load(m.dir.string(), *config);
      ASSERT_TRUE(weights.ok()) << weights.status();
      auto reference = Model::FromWeights(*config, *weights);
      ModelOptions options;
      options.bf16_state = v.state;
      options.bf16_expert_input = v.experts;
      auto rounded = Model::FromWeights(*config, RoundedLikeGpu(*weights), options);
      ASSERT_TRUE(reference.ok() && rounded.ok());
      for (const auto& tokens : m.prompts) {
        ModelState a = reference->NewState();
        ModelState b = rounded->NewState();
        auto ref = reference->Forward(&a, tokens);
        auto got = rounded->Forward(&b, tokens);
        ASSERT_TRUE(ref.ok() && got.ok());
        const int64_t vocab = ref->dim(1);
        double max_ref = 0.0;
        for (float x : ref->data) max_ref = std::max(max_ref, std::abs(static_cast<double>(x)));
        for (int64_t pos = 0; pos < ref->dim(0); ++pos) {
          const float* r = ref->ptr() + pos * vocab;
          const float* g = got->ptr() + pos * vocab;
          double diff = 0.0;
          for (int64_t i = 0; i < vocab; ++i) {
            diff = std::max(diff, std::abs(static_cast<double>(g[i]) - r[i]));
          }
          const double rel = diff / max_ref;
          worst = std::max(worst, rel);
          over += rel > 2e-2;
          argmax_equal += std::max_element(r, r + vocab) - r == std::max_element(g, g + vocab) - g;
          ++rows;
        }
      }
    }
    std::cout << v.name << " vs fp32: " << rows << " positions, " << over << " over 2e-2, worst "
              << worst << ", argmax agreement "
              << static_cast<double>(argmax_equal) / static_cast<double>(rows) << "\n";
    EXPECT_GE(static_cast<double>(argmax_equal), 0.99 * static_cast<double>(rows)) << v.name;
    if (!v.state && !v.experts) {
      EXPECT_EQ(over, 0) << "bf16 weights alone: worst " << worst;
    } else {
      EXPECT_GT(over, 0) << v.name << ": no position past the bound any more; if the fixtures "
                         << "changed, docs/engine-gpu.md's reading of the GPU figures is stale";
    }
  }
}

}  // namespace
}  // namespace pdserve::engine
