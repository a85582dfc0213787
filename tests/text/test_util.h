// Shared helpers of the text tests: the fixture tokenizer, trained by
// tools/text_train_fixture_tokenizer.py with DeepSeek's pre-tokenizer configuration.
#pragma once

#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "text/tokenizer.h"

namespace pdserve::text {

inline const std::string& FixtureDir() {
  static const std::string dir = PDSERVE_TEXT_FIXTURES "/deepseek_like";
  return dir;
}

// The fixture tokenizer, loaded once per test binary.
inline const Tokenizer& FixtureTokenizer() {
  static const Tokenizer* tokenizer = [] {
    auto loaded = Tokenizer::Load(FixtureDir());
    if (!loaded.ok()) {
      ADD_FAILURE() << loaded.status();
      std::abort();
    }
    return loaded->release();
  }();
  return *tokenizer;
}

}  // namespace pdserve::text
