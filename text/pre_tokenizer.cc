#include "text/pre_tokenizer.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace pdserve::text {
namespace {

using nlohmann::json;

absl::Status CheckByteLevel(const json& spec) {
  if (spec.value("add_prefix_space", false) || spec.value("use_regex", true)) {
    return absl::UnimplementedError(
        "pre_tokenizer ByteLevel: only add_prefix_space=false, use_regex=false is supported "
        "(DeepSeek's configuration); got " +
        spec.dump());
  }
  return absl::OkStatus();
}

absl::StatusOr<Regex> CompileSplitPattern(const json& pattern) {
  if (pattern.contains("Regex")) return Regex::Compile(pattern["Regex"].get<std::string>());
  if (pattern.contains("String")) {
    return Regex::Compile(pattern["String"].get<std::string>(), /*literal=*/true);
  }
  return absl::InvalidArgumentError("pre_tokenizer Split: pattern needs Regex or String");
}

}  // namespace

absl::StatusOr<PreTokenizer> PreTokenizer::FromJson(const json& spec) {
  if (!spec.is_object()) {
    return absl::UnimplementedError("pre_tokenizer: null is not supported (byte-level BPE only)");
  }
  std::vector<json> steps;
  if (spec.value("type", "") == "Sequence") {
    for (const json& step : spec.at("pretokenizers")) steps.push_back(step);
  } else {
    steps.push_back(spec);
  }
  std::vector<Stage> stages;
  bool byte_level_seen = false;
  try {
    for (const json& step : steps) {
      const std::string type = step.value("type", "");
      if (byte_level_seen) {
        return absl::UnimplementedError("pre_tokenizer: ByteLevel must be the last step");
      }
      if (type == "ByteLevel") {
        PDSERVE_RETURN_IF_ERROR(CheckByteLevel(step));
        byte_level_seen = true;
        continue;
      }
      if (type != "Split") {
        return absl::UnimplementedError(absl::StrCat("pre_tokenizer type '", type, "'"));
      }
      const std::string behavior = step.value("behavior", "");
      if ((behavior != "Isolated" && behavior != "Removed") || step.value("invert", false)) {
        return absl::UnimplementedError(absl::StrCat("pre_tokenizer Split: behavior '", behavior,
                                                     "' invert=", step.value("invert", false)));
      }
      PDSERVE_ASSIGN_OR_RETURN(Regex regex, CompileSplitPattern(step.at("pattern")));
      stages.push_back({std::move(regex), behavior == "Removed"});
    }
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("pre_tokenizer: ", e.what()));
  }
  if (!byte_level_seen) {
    return absl::UnimplementedError("pre_tokenizer: no ByteLevel step (byte-level BPE only)");
  }
  return PreTokenizer(std::move(stages));
}

absl::Status PreTokenizer::Split(std::string_view text, std::vector<Piece>* pieces,
                                 std::vector<Piece>* scratch) const {
  pieces->clear();
  if (text.empty()) return absl::OkStatus();
  pieces->push_back({0, text.size()});
  std::vector<Piece> matches;
  for (const Stage& stage : stages_) {
    scratch->clear();
    for (const Piece& piece : *pieces) {
      matches.clear();
      PDSERVE_RETURN_IF_ERROR(
          stage.regex.FindAll(text.substr(piece.begin, piece.end - piece.begin), &matches));
      size_t cursor = piece.begin;
      for (const Regex::Match& m : matches) {
        const size_t begin = piece.begin + m.begin;
        const size_t end = piece.begin + m.end;
        if (begin > cursor) scratch->push_back({cursor, begin});
        if (!stage.remove_matches) scratch->push_back({begin, end});
        cursor = end;
      }
      if (cursor < piece.end) scratch->push_back({cursor, piece.end});
    }
    pieces->swap(*scratch);
  }
  return absl::OkStatus();
}

}  // namespace pdserve::text
