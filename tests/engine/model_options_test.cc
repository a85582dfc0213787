// engine::ModelOptions: reference-kernel names parse (unknown ones are refused), the test-only
// indexer fault comes only from PDSERVE_TEST_SCRAMBLE_INDEXER=1, and the startup lines say so.
#include "engine/model_options.h"

#include <cstdlib>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace pdserve::engine {
namespace {

TEST(ModelOptionsTest, ParsesReferenceKernelNames) {
  absl::StatusOr<std::vector<SwitchablePiece>> pieces =
      ParseReferencePieces({"indexer", "sparse_attention", "indexer", "fp8_state"});
  ASSERT_TRUE(pieces.ok()) << pieces.status();
  EXPECT_EQ(*pieces, (std::vector<SwitchablePiece>{SwitchablePiece::kIndexer,
                                                   SwitchablePiece::kSparseAttention,
                                                   SwitchablePiece::kFp8State}));
  EXPECT_TRUE(ParseReferencePieces({}).ok());
}

TEST(ModelOptionsTest, UnknownReferenceKernelIsRefused) {
  absl::StatusOr<std::vector<SwitchablePiece>> pieces = ParseReferencePieces({"indexr"});
  ASSERT_TRUE(absl::IsInvalidArgument(pieces.status()));
  EXPECT_NE(pieces.status().message().find("'indexr'"), std::string::npos);
}

TEST(ModelOptionsTest, ScrambleOnlyFromTheEnvironmentVariableSetToOne) {
  unsetenv(kScrambleIndexerEnv);
  EXPECT_EQ(WithTestFaultsFromEnvironment({}).indexer_fault, IndexerFault::kNone);
  setenv(kScrambleIndexerEnv, "true", 1);
  EXPECT_EQ(WithTestFaultsFromEnvironment({}).indexer_fault, IndexerFault::kNone);
  setenv(kScrambleIndexerEnv, "1", 1);
  const ModelOptions faulty = WithTestFaultsFromEnvironment({{SwitchablePiece::kIndexer}});
  unsetenv(kScrambleIndexerEnv);
  EXPECT_EQ(faulty.indexer_fault, IndexerFault::kUnmaskedSlots);
  EXPECT_EQ(faulty.reference_pieces, std::vector<SwitchablePiece>{SwitchablePiece::kIndexer});
  EXPECT_NE(TestFaultWarning(faulty).find("DELIBERATELY WRONG"), std::string::npos);
  EXPECT_NE(ImplementationSummary(faulty).find("TEST FAULT indexer=unmasked_slots"),
            std::string::npos);
  EXPECT_NE(ImplementationSummary(faulty).find("indexer=reference (asked)"), std::string::npos);
}

TEST(ModelOptionsTest, ScrambleLowestTurnsOnTheLowestScoresFault) {
  setenv(kScrambleIndexerEnv, "lowest", 1);
  const ModelOptions faulty = WithTestFaultsFromEnvironment({});
  unsetenv(kScrambleIndexerEnv);
  EXPECT_EQ(faulty.indexer_fault, IndexerFault::kLowestScores);
  EXPECT_NE(ImplementationSummary(faulty).find("TEST FAULT indexer=lowest_scores"),
            std::string::npos);
}

TEST(ModelOptionsTest, DefaultOptionsCarryNoFault) {
  const ModelOptions options;
  EXPECT_EQ(options.indexer_fault, IndexerFault::kNone);
  EXPECT_EQ(TestFaultWarning(options), "");
  EXPECT_EQ(ImplementationSummary(options).find("TEST FAULT"), std::string::npos);
}

}  // namespace
}  // namespace pdserve::engine
