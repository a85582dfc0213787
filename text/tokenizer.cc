#include "text/tokenizer.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "text/byte_level.h"
#include "text/utf8.h"

namespace pdserve::text {
namespace {

using nlohmann::json;

absl::Status CheckNormalizer(const json& spec) {
  if (spec.is_null()) return absl::OkStatus();
  if (spec.value("type", "") == "Sequence" && spec.value("normalizers", json::array()).empty()) {
    return absl::OkStatus();
  }
  return absl::UnimplementedError("normalizer " + spec.dump() +
                                  " (only null, as DeepSeek ships, is supported)");
}

absl::Status CheckDecoder(const json& spec) {
  if (spec.is_object() && spec.value("type", "") == "ByteLevel") return absl::OkStatus();
  return absl::UnimplementedError("decoder " + spec.dump() + " (only ByteLevel is supported)");
}

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromJson(std::string_view tokenizer_json,
                                                               TokenizerConfig config) {
  json spec;
  try {
    spec = json::parse(tokenizer_json);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: ", e.what()));
  }
  if (!spec.is_object() || !spec.contains("model")) {
    return absl::InvalidArgumentError("tokenizer.json: no \"model\" object");
  }
  PDSERVE_RETURN_IF_ERROR(CheckNormalizer(spec.value("normalizer", json())));
  PDSERVE_RETURN_IF_ERROR(CheckDecoder(spec.value("decoder", json())));
  PDSERVE_ASSIGN_OR_RETURN(auto model, BpeModel::FromJson(spec["model"]));
  PDSERVE_ASSIGN_OR_RETURN(auto pre_tokenizer,
                           PreTokenizer::FromJson(spec.value("pre_tokenizer", json())));
  PDSERVE_ASSIGN_OR_RETURN(auto added,
                           AddedVocabulary::FromJson(spec.value("added_tokens", json())));
  auto tokenizer = std::unique_ptr<Tokenizer>(new Tokenizer(
      std::move(model), std::move(pre_tokenizer), std::move(added), std::move(config)));
  tokenizer->vocab_size_ = tokenizer->model_->id_limit();
  for (const AddedToken& token : tokenizer->added_.tokens()) {
    tokenizer->vocab_size_ = std::max(tokenizer->vocab_size_, token.id + 1);
  }
  const TokenizerConfig& cfg = tokenizer->config_;
  if (cfg.bos_token) tokenizer->bos_id_ = tokenizer->TokenToId(*cfg.bos_token);
  if (cfg.eos_token) tokenizer->eos_id_ = tokenizer->TokenToId(*cfg.eos_token);
  PDSERVE_RETURN_IF_ERROR(tokenizer->InitPostProcessor(spec.value("post_processor", json())));
  return tokenizer;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Load(const std::filesystem::path& model_dir) {
  PDSERVE_ASSIGN_OR_RETURN(std::string text, ReadFile(model_dir / "tokenizer.json"));
  PDSERVE_ASSIGN_OR_RETURN(TokenizerConfig config,
                           TokenizerConfig::Load(model_dir / "tokenizer_config.json"));
  return FromJson(text, std::move(config));
}

absl::Status Tokenizer::InitPostProcessor(const json& spec) {
  if (spec.is_null()) {
    // No post_processor in the file: transformers' LlamaTokenizerFast (DeepSeek's
    // tokenizer_class) builds one from add_bos_token / add_eos_token.
    if (config_.add_bos_token.value_or(false)) {
      if (!bos_id_) return absl::InvalidArgumentError("add_bos_token set but bos_token unknown");
      prefix_ids_.push_back(*bos_id_);
    }
    if (config_.add_eos_token.value_or(false)) {
      if (!eos_id_) return absl::InvalidArgumentError("add_eos_token set but eos_token unknown");
      suffix_ids_.push_back(*eos_id_);
    }
    return absl::OkStatus();
  }
  const std::string type = spec.value("type", "");
  try {
    if (type == "ByteLevel") return absl::OkStatus();  // adjusts offsets only
    if (type == "Sequence") {
      for (const json& step : spec.at("processors")) {
        PDSERVE_RETURN_IF_ERROR(InitPostProcessor(step));
      }
      return absl::OkStatus();
    }
    if (type != "TemplateProcessing") {
      return absl::UnimplementedError(absl::StrCat("post_processor type '", type, "'"));
    }
    bool after_sequence = false;
    for (const json& item : spec.at("single")) {
      if (item.contains("Sequence")) {
        after_sequence = true;
        continue;
      }
      const std::string name = item.at("SpecialToken").at("id").get<std::string>();
      for (const json& id : spec.at("special_tokens").at(name).at("ids")) {
        (after_sequence ? suffix_ids_ : prefix_ids_).push_back(id.get<int32_t>());
      }
    }
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("post_processor: ", e.what()));
  }
  return absl::OkStatus();
}

absl::Status Tokenizer::EncodePlain(std::string_view text, std::vector<int32_t>* ids) const {
  thread_local std::vector<PreTokenizer::Piece> pieces;
  thread_local std::vector<PreTokenizer::Piece> scratch;
  PDSERVE_RETURN_IF_ERROR(pre_tokenizer_.Split(text, &pieces, &scratch));
  for (const PreTokenizer::Piece& piece : pieces) {
    model_->Encode(text.substr(piece.begin, piece.end - piece.begin), ids);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int32_t>> Tokenizer::Encode(std::string_view text,
                                                       const EncodeOptions& options) const {
  if (!IsValidUtf8(text)) return absl::InvalidArgumentError("encode: input is not valid UTF-8");
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  if (options.add_special_tokens) ids.assign(prefix_ids_.begin(), prefix_ids_.end());
  thread_local std::vector<AddedVocabulary::Segment> segments;
  added_.Split(text, options.allow_special, &segments);
  for (const AddedVocabulary::Segment& segment : segments) {
    if (segment.id >= 0) {
      ids.push_back(segment.id);
    } else {
      PDSERVE_RETURN_IF_ERROR(
          EncodePlain(text.substr(segment.begin, segment.end - segment.begin), &ids));
    }
  }
  if (options.add_special_tokens) ids.insert(ids.end(), suffix_ids_.begin(), suffix_ids_.end());
  return ids;
}

absl::Status Tokenizer::AppendTokenBytes(int32_t id, bool skip_special_tokens,
                                         std::string* out) const {
  std::string_view token;
  if (const AddedToken* added = added_.Find(id)) {
    if (skip_special_tokens && added->special) return absl::OkStatus();
    token = added->content;
  } else if (auto model_token = model_->IdToToken(id)) {
    token = *model_token;
  } else {
    return absl::OutOfRangeError(absl::StrCat("decode: unknown token id ", id));
  }
  if (!ByteLevelDecode(token, out)) out->append(token);
  return absl::OkStatus();
}

absl::StatusOr<std::string> Tokenizer::Decode(std::span<const int32_t> ids,
                                              bool skip_special_tokens) const {
  std::string bytes;
  for (int32_t id : ids) PDSERVE_RETURN_IF_ERROR(AppendTokenBytes(id, skip_special_tokens, &bytes));
  return Utf8Lossy(bytes);
}

std::optional<std::string> Tokenizer::IdToToken(int32_t id) const {
  if (const AddedToken* added = added_.Find(id)) return added->content;
  if (auto token = model_->IdToToken(id)) return std::string(*token);
  return std::nullopt;
}

std::optional<int32_t> Tokenizer::TokenToId(std::string_view token) const {
  if (auto id = added_.TokenToId(token)) return id;
  return model_->TokenToId(token);
}

bool Tokenizer::IsSpecial(int32_t id) const {
  const AddedToken* added = added_.Find(id);
  return added != nullptr && added->special;
}

}  // namespace pdserve::text
