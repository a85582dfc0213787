// `pdserve tokenize` and `pdserve detokenize`: the model directory's tokenizer from the shell.
//
//   pdserve tokenize --model DIR (--text T | --file F) [--allow-special] [--no-bos]
//     prints the ids, comma-separated, on one line;
//   pdserve detokenize --model DIR --ids 1,2,3 [--skip-special-tokens]
//     prints the decoded text followed by a newline.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "cli/command_registry.h"
#include "text/tokenizer.h"

namespace pdserve::cli {
namespace {

struct TokenizeArgs {
  std::string model;
  std::string text;
  std::string file;
  bool allow_special = false;
  bool no_bos = false;
};

struct DetokenizeArgs {
  std::string model;
  std::string ids;
  bool skip_special = false;
};

std::unique_ptr<text::Tokenizer> LoadOrReport(const std::string& model) {
  auto tokenizer = text::Tokenizer::Load(model);
  if (!tokenizer.ok()) {
    std::fprintf(stderr, "error: %s\n", tokenizer.status().ToString().c_str());
    return nullptr;
  }
  return *std::move(tokenizer);
}

int RunTokenize(const TokenizeArgs& args) {
  auto tokenizer = LoadOrReport(args.model);
  if (tokenizer == nullptr) return 1;
  std::string input = args.text;
  if (!args.file.empty()) {
    auto content = text::ReadFile(args.file);
    if (!content.ok()) {
      std::fprintf(stderr, "error: %s\n", content.status().ToString().c_str());
      return 1;
    }
    input = *std::move(content);
  }
  auto ids = tokenizer->Encode(
      input, {.add_special_tokens = !args.no_bos, .allow_special = args.allow_special});
  if (!ids.ok()) {
    std::fprintf(stderr, "error: %s\n", ids.status().ToString().c_str());
    return 1;
  }
  std::printf("%s\n", absl::StrJoin(*ids, ",").c_str());
  return 0;
}

int RunDetokenize(const DetokenizeArgs& args) {
  std::vector<int32_t> ids;
  for (absl::string_view part : absl::StrSplit(args.ids, ',', absl::SkipWhitespace())) {
    int32_t id = 0;
    if (!absl::SimpleAtoi(part, &id)) {
      std::fprintf(stderr, "error: --ids: '%s' is not an integer\n", std::string(part).c_str());
      return 1;
    }
    ids.push_back(id);
  }
  auto tokenizer = LoadOrReport(args.model);
  if (tokenizer == nullptr) return 1;
  auto text = tokenizer->Decode(ids, args.skip_special);
  if (!text.ok()) {
    std::fprintf(stderr, "error: %s\n", text.status().ToString().c_str());
    return 1;
  }
  std::printf("%s\n", text->c_str());
  return 0;
}

const CommandRegistrar kTokenize([](CLI::App& app, int* exit_code) {
  auto args = std::make_shared<TokenizeArgs>();
  CLI::App* cmd = app.add_subcommand("tokenize", "Print the token ids of a text");
  cmd->add_option("--model", args->model, "Model directory (tokenizer.json)")->required();
  CLI::Option_group* input = cmd->add_option_group("input", "Exactly one of --text, --file");
  input->add_option("--text", args->text, "Text to tokenize");
  input->add_option("--file", args->file, "File whose content to tokenize");
  input->require_option(1);
  cmd->add_flag("--allow-special", args->allow_special,
                "Match special-token text as special tokens (default: plain text)");
  cmd->add_flag("--no-bos", args->no_bos, "Do not add the post-processor's BOS/EOS");
  cmd->callback([args, exit_code] { *exit_code = RunTokenize(*args); });
});

const CommandRegistrar kDetokenize([](CLI::App& app, int* exit_code) {
  auto args = std::make_shared<DetokenizeArgs>();
  CLI::App* cmd = app.add_subcommand("detokenize", "Print the text of token ids");
  cmd->add_option("--model", args->model, "Model directory (tokenizer.json)")->required();
  cmd->add_option("--ids", args->ids, "Comma-separated token ids")->required();
  cmd->add_flag("--skip-special-tokens", args->skip_special, "Leave out special tokens");
  cmd->callback([args, exit_code] { *exit_code = RunDetokenize(*args); });
});

}  // namespace
}  // namespace pdserve::cli
