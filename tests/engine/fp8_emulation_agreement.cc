// What the CUDA engine's FP8 arithmetic costs in argmax agreement, measured on a CPU
// (ModelOptions::fp8_emulation, engine/fp8_emulation.h): the bundled model FP8-quantized by
// tools/make_real_format_checkpoint.py (FP8 projections, FP4 experts, ue8m0 scales), run by the
// CPU engine on its dequantized values in fp32 (the reference the GPU FP8 path is held to) and
// with each part of the FP8 path's arithmetic emulated: activations quantized per 1 x 128 to
// e4m3, bf16 outputs, both. Same prompts as tests/engine_gpu/gpu_fp8_weights_test.cc (the bundled
// model's logit-fixture prompts and a 300-token held-out stretch). Prints the figures
// (docs/engine-gpu.md quotes them); asserts that each emulated part changes the logits and that
// agreement stays >= 95% (a wrong quantization, e.g. scales off by a block, gives near-random
// argmaxes).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "engine/config.h"
#include "engine/model.h"
#include "engine/weights.h"
#include "nlohmann/json.hpp"

namespace pdserve::engine {
namespace {

namespace fs = std::filesystem;

std::string QuantizedBundledModel() {
  const fs::path bundled = PDSERVE_BUNDLED_MODEL;
  const fs::path out = fs::path(::testing::TempDir()) / "pdserve_fp8_emulation_kjv_v4_tiny";
  fs::remove_all(out);
  const std::string command =
      "python3 \"" +
      (bundled.parent_path().parent_path() / "tools/make_real_format_checkpoint.py").string() +
      "\" --out \"" + out.string() + "\" --quantize-from \"" + bundled.string() + "\" > /dev/null";
  return std::system(command.c_str()) == 0 ? out.string() : std::string();
}

std::vector<std::vector<int32_t>> Prompts() {
  const fs::path dir = PDSERVE_SMALL_MODEL_FIXTURES_DIR;
  std::ifstream json(dir / "logits.json");
  const nlohmann::json j = nlohmann::json::parse(json);
  std::vector<std::vector<int32_t>> prompts;
  for (const auto& p : j["prompts"]) prompts.push_back(p["ids"].get<std::vector<int32_t>>());
  std::ifstream in(dir / "heldout_slice_ids.bin", std::ios::binary);
  std::vector<uint32_t> raw(300);
  in.read(reinterpret_cast<char*>(raw.data()), static_cast<std::streamsize>(raw.size() * 4));
  prompts.emplace_back(raw.begin(), raw.end());
  return prompts;
}

struct Agreement {
  int64_t rows = 0;
  int64_t argmax_equal = 0;
  std::vector<double> rel;  // per row max|diff| / max|ref| (max over the prompt's logits)
  double Rate() const { return static_cast<double>(argmax_equal) / std::max<int64_t>(rows, 1); }
  double Quantile(double q) const {
    std::vector<double> s = rel;
    std::sort(s.begin(), s.end());
    return s.empty() ? 0.0 : s[static_cast<size_t>(q * static_cast<double>(s.size() - 1))];
  }
};

int64_t Argmax(const float* v, int64_t n) { return std::max_element(v, v + n) - v; }

TEST(Fp8EmulationTest, ArgmaxAgreementOfEachPartOfTheFp8Arithmetic) {
  const std::string dir = QuantizedBundledModel();
  ASSERT_FALSE(dir.empty()) << "tools/make_real_format_checkpoint.py --quantize-from failed";
  auto config = ModelConfig::Load(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  auto weights = Weights::Load(dir, *config);
  ASSERT_TRUE(weights.ok()) << weights.status();
  const std::vector<std::vector<int32_t>> prompts = Prompts();
  ASSERT_GT(prompts.size(), 1u);

  auto logits_of = [&](const ModelOptions& options) {
    auto model = Model::FromWeights(*config, *weights, options);
    EXPECT_TRUE(model.ok()) << model.status();
    std::vector<Tensor> out;
    for (const auto& tokens : prompts) {
      ModelState state = model->NewState();
      auto logits = model->Forward(&state, tokens);
      EXPECT_TRUE(logits.ok()) << logits.status();
      out.push_back(logits.ok() ? std::move(*logits) : Tensor());
    }
    return out;
  };
  const std::vector<Tensor> ref = logits_of(ModelOptions{});
  const int64_t vocab = config->vocab_size;

  struct Variant {
    const char* name;
    Fp8Emulation emulation;
  };
  auto variant = [](bool quantize, bool bf16, bool ue8m0, bool dense, bool experts) {
    Fp8Emulation e;
    e.quantize_inputs = quantize;
    e.bf16_outputs = bf16;
    e.ue8m0_scales = ue8m0;
    e.dense = dense;
    e.routed_experts = experts;
    return e;
  };
  Fp8Emulation w8a16 = variant(false, true, false, true, true);
  w8a16.bf16_inputs = true;
  for (const Variant& v : {
           Variant{"activations e4m3 per 1x128", variant(true, false, false, true, true)},
           Variant{"bf16 outputs", variant(false, true, false, true, true)},
           Variant{"both (the GPU FP8 path)", variant(true, true, false, true, true)},
           Variant{"both, dense projections only", variant(true, true, false, true, false)},
           Variant{"both, routed experts only", variant(true, true, false, false, true)},
           Variant{"both, ue8m0 activation scales", variant(true, true, true, true, true)},
           Variant{"W8A16: bf16 inputs and outputs (the GPU W8A16 path)", w8a16},
       }) {
    ModelOptions options;
    options.fp8_emulation = v.emulation;
    const std::vector<Tensor> got = logits_of(options);
    Agreement a;
    bool any_change = false;
    for (size_t p = 0; p < prompts.size(); ++p) {
      ASSERT_EQ(got[p].data.size(), ref[p].data.size());
      double max_ref = 0.0;
      for (float r : ref[p].data) max_ref = std::max(max_ref, std::fabs(static_cast<double>(r)));
      for (int64_t row = 0; row < ref[p].dim(0); ++row) {
        const float* g = got[p].ptr() + row * vocab;
        const float* r = ref[p].ptr() + row * vocab;
        double d = 0.0;
        for (int64_t i = 0; i < vocab; ++i) d = std::max(d, std::fabs(double{g[i]} - r[i]));
        any_change = any_change || d > 0.0;
        a.rel.push_back(d / std::max(max_ref, 1e-30));
        a.argmax_equal += Argmax(g, vocab) == Argmax(r, vocab);
        ++a.rows;
      }
    }
    std::cout << "fp8 emulation, " << v.name << " vs CPU fp32: " << a.rows
              << " rows, argmax agreement " << a.Rate() << ", max|diff|/max|ref| median "
              << a.Quantile(0.5) << ", p95 " << a.Quantile(0.95) << ", worst " << a.Quantile(1.0)
              << "\n";
    EXPECT_TRUE(any_change) << v.name;
    EXPECT_GE(a.Rate(), 0.95) << v.name;
    // Issue 25's bar, which W8A16 is to meet.
    if (v.emulation.bf16_inputs) {
      EXPECT_GE(a.Rate(), 0.99) << v.name;
    }
  }
}

}  // namespace
}  // namespace pdserve::engine
