// `pdserve score`: the float32 logits of every position of a token sequence, so the engine can be
// compared with another implementation (e.g. transformers).
//
//   pdserve score --model DIR --tokens 3,17,42 [--decode-from N] --out FILE
//
// Prefills the first N tokens in one Forward call (default: all of them), then feeds the rest one
// token at a time, and writes [tokens, vocab] float32 little-endian row-major logits to FILE. A
// sequence longer than the model's context (max_position_embeddings) is refused, as serving does.
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "cli/command_registry.h"
#include "common/status.h"
#include "engine/model.h"
#include "engine/score.h"

namespace pdserve::cli {
namespace {

struct ScoreOptions {
  std::string model_dir;
  std::string tokens;
  int64_t decode_from = -1;  // -1: prefill everything at once
  std::string out;
};

absl::StatusOr<std::vector<int32_t>> ParseTokens(const std::string& text) {
  std::vector<int32_t> tokens;
  if (absl::StripAsciiWhitespace(text).empty()) {
    return absl::InvalidArgumentError("--tokens: no token ids");
  }
  for (absl::string_view piece : absl::StrSplit(text, ',')) {
    int32_t id = 0;
    if (absl::StripAsciiWhitespace(piece).empty()) {  // "1,,2" or a trailing comma: not skipped
      return absl::InvalidArgumentError(
          absl::StrCat("--tokens: empty token id at position ", tokens.size() + 1));
    }
    if (!absl::SimpleAtoi(piece, &id)) {
      return absl::InvalidArgumentError(absl::StrCat("--tokens: not an integer: '", piece, "'"));
    }
    tokens.push_back(id);
  }
  return tokens;
}

absl::Status Score(const ScoreOptions& options) {
  PDSERVE_ASSIGN_OR_RETURN(std::vector<int32_t> tokens, ParseTokens(options.tokens));
  const int64_t total = static_cast<int64_t>(tokens.size());
  const int64_t prefill = options.decode_from < 0 ? total : options.decode_from;
  if (prefill > total) {
    return absl::InvalidArgumentError(
        absl::StrCat("--decode-from ", prefill, " exceeds the ", total, " tokens given"));
  }
  // Open the output first: an unwritable path fails before the model is loaded and run.
  std::ofstream out(options.out, std::ios::binary | std::ios::trunc);
  if (!out) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot open ", options.out, " for writing: ", std::strerror(errno)));
  }
  PDSERVE_ASSIGN_OR_RETURN(engine::Model model, engine::Model::Load(options.model_dir));
  // Serving refuses a longer sequence (400 context_length_exceeded); positions past it are
  // outside what the model was trained for, so their logits mean nothing.
  if (const int64_t context = model.config().max_position_embeddings; total > context) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tokens: ", total, " tokens exceed the model's maximum context length of ",
                     context, " tokens (max_position_embeddings in config.json)"));
  }
  PDSERVE_ASSIGN_OR_RETURN(engine::Tensor logits,
                           engine::ScorePrefillThenDecode(model, tokens, prefill));
  out.write(reinterpret_cast<const char*>(logits.ptr()),
            static_cast<std::streamsize>(logits.data.size() * sizeof(float)));
  out.close();
  if (!out) {
    return absl::InternalError(
        absl::StrCat("cannot write ", options.out, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

const CommandRegistrar kRegistrar([](CLI::App& app, int* exit_code) {
  auto options = std::make_shared<ScoreOptions>();
  CLI::App* cmd = app.add_subcommand(
      "score", "Write the float32 logits [tokens, vocab] of a token sequence to a file");
  cmd->add_option("--model", options->model_dir, "Hugging Face model directory")->required();
  cmd->add_option("--tokens", options->tokens, "Comma-separated token ids, e.g. 3,17,42")
      ->required();
  cmd->add_option("--decode-from", options->decode_from,
                  "Prefill the first N tokens at once, then decode one token at a time")
      ->check(NonNegative());
  cmd->add_option("--out", options->out, "Output file (raw little-endian float32)")->required();
  cmd->callback([options, exit_code] {
    const absl::Status status = Score(*options);
    if (!status.ok()) {
      std::fprintf(stderr, "pdserve score: %s\n", status.ToString().c_str());
      *exit_code = 1;
    }
  });
});

}  // namespace
}  // namespace pdserve::cli
