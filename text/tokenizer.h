// A Hugging Face tokenizer.json byte-level BPE tokenizer, as DeepSeek-V3/V3.2/V4 ship it.
//
// Pipeline (identical to the Python `tokenizers` package on these files, which the tests in
// tests/text prove on >= 2,000 strings): added-token matching -> normalizer (null only) ->
// pre-tokenizer Split regexes (PCRE2) -> byte-level BPE -> post-processor (TemplateProcessing:
// BOS/EOS). Decoding concatenates each token's bytes (ByteLevel decoder; an added token whose
// text is not in the byte map contributes its own UTF-8) and replaces invalid UTF-8 by U+FFFD
// exactly as Rust's from_utf8_lossy does.
//
// Thread-safety: immutable after construction except the BPE memo (internally synchronized);
// every method may be called concurrently.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "text/added_vocabulary.h"
#include "text/bpe_model.h"
#include "text/pre_tokenizer.h"
#include "text/tokenizer_config.h"

namespace pdserve::text {

struct EncodeOptions {
  // Apply the post-processor (DeepSeek: prepend BOS).
  bool add_special_tokens = true;
  // Match special-token text (e.g. "<｜User｜>") in the input as the special token. Off by default
  // so that user content can never forge a control token; then that text is ordinary text.
  // Non-special added tokens are always matched, as in `tokenizers`.
  bool allow_special = false;
};

class Tokenizer {
 public:
  // Builds from the text of a tokenizer.json. `config` supplies add_bos_token/add_eos_token when
  // the file has no post_processor (LlamaTokenizerFast behaviour) and the BOS/EOS names.
  // Errors: InvalidArgument for malformed files; Unimplemented for components outside byte-level
  // BPE (the message names the component).
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromJson(std::string_view tokenizer_json,
                                                             TokenizerConfig config = {});

  // Loads `model_dir`/tokenizer.json and, if present, `model_dir`/tokenizer_config.json.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Load(const std::filesystem::path& model_dir);

  // Token ids of `text`. Errors: InvalidArgument when `text` is not valid UTF-8;
  // ResourceExhausted if the regex engine gives up (see Regex::FindAll).
  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text,
                                              const EncodeOptions& options = {}) const;

  // Text of `ids`. Errors: OutOfRange for an id that is neither in the vocabulary nor added.
  absl::StatusOr<std::string> Decode(std::span<const int32_t> ids,
                                     bool skip_special_tokens = false) const;

  // Appends the raw bytes `id` contributes to a decode (nothing for a skipped special token).
  // Decode(ids) == Utf8Lossy(concatenation of TokenBytes). Errors: OutOfRange as Decode.
  absl::Status AppendTokenBytes(int32_t id, bool skip_special_tokens, std::string* out) const;

  // The vocabulary string of `id` (added-token text for added tokens), or nullopt.
  std::optional<std::string> IdToToken(int32_t id) const;
  // Id of a vocabulary string or added-token text, or nullopt.
  std::optional<int32_t> TokenToId(std::string_view token) const;
  bool IsSpecial(int32_t id) const;

  // One more than the largest id (model vocabulary and added tokens).
  int32_t vocab_size() const { return vocab_size_; }
  std::optional<int32_t> bos_id() const { return bos_id_; }
  std::optional<int32_t> eos_id() const { return eos_id_; }
  const TokenizerConfig& config() const { return config_; }
  const AddedVocabulary& added_vocabulary() const { return added_; }

 private:
  Tokenizer(std::unique_ptr<BpeModel> model, PreTokenizer pre_tokenizer, AddedVocabulary added,
            TokenizerConfig config)
      : model_(std::move(model)),
        pre_tokenizer_(std::move(pre_tokenizer)),
        added_(std::move(added)),
        config_(std::move(config)) {}
  absl::Status InitPostProcessor(const nlohmann::json& spec);
  absl::Status EncodePlain(std::string_view text, std::vector<int32_t>* ids) const;

  std::unique_ptr<BpeModel> model_;
  PreTokenizer pre_tokenizer_;
  AddedVocabulary added_;
  TokenizerConfig config_;
  std::vector<int32_t> prefix_ids_;  // post-processor ids before the sequence
  std::vector<int32_t> suffix_ids_;  // and after it
  int32_t vocab_size_ = 0;
  std::optional<int32_t> bos_id_;
  std::optional<int32_t> eos_id_;
};

}  // namespace pdserve::text
