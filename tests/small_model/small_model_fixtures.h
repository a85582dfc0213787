// Paths and readers for the bundled model (models/kjv-v4-tiny) and the fixtures its training
// script wrote (tests/fixtures/small_model, tools/train_small_model/train.py "fixtures" stage):
// logits.json (prompts, their transformers logits files, the perplexity record),
// indexer_ties.json (tools/train_small_model/numpy_reference.py), heldout_slice_ids.bin (uint32
// little-endian token ids) and transformers_samples.json. Test-only; readers report a missing or
// short file through gtest and return what they could read.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace pdserve::small_model_testing {

inline const std::filesystem::path kModelDir = PDSERVE_SMALL_MODEL_DIR;
inline const std::filesystem::path kFixturesDir = PDSERVE_SMALL_MODEL_FIXTURES_DIR;

inline nlohmann::json ReadJson(const std::filesystem::path& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  return nlohmann::json::parse(in);
}

inline std::vector<char> ReadBytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// A raw little-endian float32 file (the logits fixtures: [tokens, vocab] row-major).
inline std::vector<float> ReadFloats(const std::filesystem::path& path) {
  const std::vector<char> bytes = ReadBytes(path);
  std::vector<float> values(bytes.size() / sizeof(float));
  std::memcpy(values.data(), bytes.data(), values.size() * sizeof(float));
  return values;
}

// The committed held-out slice as token ids (heldout_slice.txt tokenized by the training script).
inline std::vector<int32_t> HeldOutIds() {
  const std::vector<char> bytes = ReadBytes(kFixturesDir / "heldout_slice_ids.bin");
  std::vector<uint32_t> raw(bytes.size() / sizeof(uint32_t));
  std::memcpy(raw.data(), bytes.data(), raw.size() * sizeof(uint32_t));
  return {raw.begin(), raw.end()};
}

// Where a test that measures figures for docs writes them as JSON: the directory named by the
// environment variable PDSERVE_SMALL_MODEL_REPORT_DIR (set by tools/small_model_coherence.py), or
// nothing when it is unset.
inline void WriteReport(const std::string& file_name, const nlohmann::json& report) {
  const char* dir = std::getenv("PDSERVE_SMALL_MODEL_REPORT_DIR");
  if (dir == nullptr || *dir == '\0') return;
  std::ofstream out(std::filesystem::path(dir) / file_name);
  out << report.dump(1) << "\n";
  EXPECT_TRUE(out.good()) << dir << "/" << file_name;
}

}  // namespace pdserve::small_model_testing
