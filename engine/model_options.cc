#include "engine/model_options.h"

#include <algorithm>
#include <cstdlib>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace pdserve::engine {

const char* SwitchablePieceName(SwitchablePiece piece) {
  switch (piece) {
    case SwitchablePiece::kSparseAttention:
      return "sparse_attention";
    case SwitchablePiece::kIndexer:
      return "indexer";
    case SwitchablePiece::kFp8State:
      return "fp8_state";
  }
  return "unknown";
}

std::vector<SwitchablePiece> AllSwitchablePieces() {
  return {SwitchablePiece::kSparseAttention, SwitchablePiece::kIndexer, SwitchablePiece::kFp8State};
}

absl::StatusOr<std::vector<SwitchablePiece>> ParseReferencePieces(
    const std::vector<std::string>& names) {
  std::vector<SwitchablePiece> out;
  for (const std::string& name : names) {
    const std::vector<SwitchablePiece> all = AllSwitchablePieces();
    const auto it = std::find_if(all.begin(), all.end(),
                                 [&](SwitchablePiece p) { return SwitchablePieceName(p) == name; });
    if (it == all.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown reference kernel '", name, "' (known: sparse_attention, indexer, fp8_state)"));
    }
    if (std::find(out.begin(), out.end(), *it) == out.end()) out.push_back(*it);
  }
  return out;
}

std::string IndexerFaultName(IndexerFault fault) {
  switch (fault) {
    case IndexerFault::kNone:
      return "none";
    case IndexerFault::kUnmaskedSlots:
      return "unmasked_slots";
    case IndexerFault::kLowestScores:
      return "lowest_scores";
  }
  return "unknown";
}

ModelOptions WithTestFaultsFromEnvironment(ModelOptions base) {
  const char* value = std::getenv(kScrambleIndexerEnv);
  if (value != nullptr && std::string(value) == "1") {
    base.indexer_fault = IndexerFault::kUnmaskedSlots;
  } else if (value != nullptr && std::string(value) == "lowest") {
    base.indexer_fault = IndexerFault::kLowestScores;
  }
  return base;
}

std::string TestFaultWarning(const ModelOptions& options) {
  if (options.indexer_fault == IndexerFault::kNone) return "";
  return absl::StrCat("WARNING: ", kScrambleIndexerEnv,
                      " is set: the lightning indexer is DELIBERATELY WRONG (test only, never in a "
                      "deployment; docs/guards.md)");
}

std::string ImplementationSummary(const ModelOptions& options) {
  std::string out = "backend cpu:";
  for (SwitchablePiece piece : AllSwitchablePieces()) {
    const bool asked = std::find(options.reference_pieces.begin(), options.reference_pieces.end(),
                                 piece) != options.reference_pieces.end();
    absl::StrAppend(&out, " ", SwitchablePieceName(piece), "=reference");
    if (asked) absl::StrAppend(&out, " (asked)");
  }
  absl::StrAppend(&out, " (every CPU piece is the reference; the CUDA backend honours the list)");
  if (options.indexer_fault != IndexerFault::kNone) {
    absl::StrAppend(&out, " TEST FAULT indexer=", IndexerFaultName(options.indexer_fault));
  }
  return out;
}

}  // namespace pdserve::engine
