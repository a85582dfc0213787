// Checks the C++ tokenizer against golden vectors written by tools/text_golden_vectors.py (the
// Python `tokenizers` package). By default it reads the committed fixture; the live cross-check
// (crosscheck_tokenizers.py) sets PDSERVE_TEXT_GOLDEN="model_dir=golden.json,..." to freshly
// generated vectors of every tokenizer directory in its list.
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "text/tokenizer.h"

namespace pdserve::text {
namespace {

using nlohmann::json;

struct GoldenSet {
  std::string model_dir;
  std::unique_ptr<Tokenizer> tokenizer;
  json data;
};

std::vector<GoldenSet> LoadGoldenSets() {
  std::string spec =
      PDSERVE_TEXT_FIXTURES "/deepseek_like=" PDSERVE_TEXT_FIXTURES "/deepseek_like_golden.json";
  if (const char* env = std::getenv("PDSERVE_TEXT_GOLDEN"); env != nullptr && *env != '\0') {
    spec = env;
  }
  std::vector<GoldenSet> sets;
  for (absl::string_view entry : absl::StrSplit(spec, ',')) {
    const std::vector<std::string> parts = absl::StrSplit(entry, absl::MaxSplits('=', 1));
    EXPECT_EQ(parts.size(), 2u) << "bad PDSERVE_TEXT_GOLDEN entry";
    if (parts.size() != 2) continue;
    auto tokenizer = Tokenizer::Load(parts[0]);
    EXPECT_TRUE(tokenizer.ok()) << tokenizer.status();
    auto text = ReadFile(parts[1]);
    EXPECT_TRUE(text.ok()) << text.status();
    if (!tokenizer.ok() || !text.ok()) continue;
    sets.push_back({parts[0], *std::move(tokenizer), json::parse(*text)});
  }
  return sets;
}

const std::vector<GoldenSet>& GoldenSets() {
  static const auto* sets = new std::vector<GoldenSet>(LoadGoldenSets());
  return *sets;
}

std::vector<int32_t> Ids(const json& j) { return j.get<std::vector<int32_t>>(); }

// Runs `check` on every case of every set; reports the count and the first few mismatches.
template <typename Check>
void ExpectNoMismatch(const char* what, const char* cases_key, Check check) {
  ASSERT_FALSE(GoldenSets().empty());
  for (const GoldenSet& set : GoldenSets()) {
    size_t mismatches = 0;
    size_t total = 0;
    for (const json& c : set.data.at(cases_key)) {
      ++total;
      std::string detail;
      if (!check(*set.tokenizer, c, &detail)) {
        if (++mismatches <= 5) ADD_FAILURE() << what << " mismatch: " << detail;
      }
    }
    EXPECT_GE(total, 300u);
    std::printf("[%s] %s: %zu cases, %zu mismatches\n", set.model_dir.c_str(), what, total,
                mismatches);
    EXPECT_EQ(mismatches, 0u) << what << " on " << set.model_dir;
  }
}

std::string Dump(const std::vector<int32_t>& ids) { return json(ids).dump(); }

TEST(GoldenVectorsTest, EncodeWithSpecialTokensMatchesTokenizers) {
  ExpectNoMismatch("encode(add_special, allow_special)", "cases",
                   [](const Tokenizer& tok, const json& c, std::string* detail) {
                     auto ids = tok.Encode(c["text"].get<std::string>(),
                                           {.add_special_tokens = true, .allow_special = true});
                     if (!ids.ok()) return false;
                     *detail = c["text"].dump() + " got " + Dump(*ids) + " want " + c["ids"].dump();
                     return *ids == Ids(c["ids"]);
                   });
}

TEST(GoldenVectorsTest, EncodeSpecialTextAsPlainMatchesTokenizers) {
  ExpectNoMismatch(
      "encode(plain)", "cases", [](const Tokenizer& tok, const json& c, std::string* detail) {
        auto ids = tok.Encode(c["text"].get<std::string>(),
                              {.add_special_tokens = false, .allow_special = false});
        if (!ids.ok()) return false;
        *detail = c["text"].dump() + " got " + Dump(*ids) + " want " + c["plain_ids"].dump();
        return *ids == Ids(c["plain_ids"]);
      });
}

TEST(GoldenVectorsTest, DecodeMatchesTokenizers) {
  ExpectNoMismatch("decode", "cases", [](const Tokenizer& tok, const json& c, std::string* d) {
    auto text = tok.Decode(Ids(c["ids"]), false);
    auto skipped = tok.Decode(Ids(c["ids"]), true);
    if (!text.ok() || !skipped.ok()) return false;
    *d = c["ids"].dump() + " got " + json(*text).dump() + " / " + json(*skipped).dump();
    return *text == c["decoded"].get<std::string>() &&
           *skipped == c["decoded_skip"].get<std::string>();
  });
}

TEST(GoldenVectorsTest, DecodeOfRandomIdsMatchesTokenizers) {
  ExpectNoMismatch("decode(random ids)", "decode_cases",
                   [](const Tokenizer& tok, const json& c, std::string* d) {
                     auto text = tok.Decode(Ids(c["ids"]), false);
                     auto skipped = tok.Decode(Ids(c["ids"]), true);
                     if (!text.ok() || !skipped.ok()) return false;
                     *d = c["ids"].dump() + " got " + json(*text).dump();
                     return *text == c["decoded"].get<std::string>() &&
                            *skipped == c["decoded_skip"].get<std::string>();
                   });
}

}  // namespace
}  // namespace pdserve::text
