// Fuzzes the OpenAI request parser with untrusted body bytes, chat encoding included: each body
// is parsed for /v1/chat/completions and /v1/completions, and a chat request that parses is
// rendered and tokenized with the bundled model's chat format. Properties: an error is a 4xx
// whose JSON parses; a parsed chat request either renders to ids inside the vocabulary or fails
// with InvalidArgument (never another error, never a crash).
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string_view>
#include <variant>

#include "frontend/api_request.h"
#include "frontend/chat_prompt.h"
#include "nlohmann/json.hpp"
#include "text/chat_format.h"
#include "text/tokenizer.h"

namespace {

using namespace pdserve::frontend;

void Check(bool ok) {
  if (!ok) std::abort();
}

// The bundled model's tokenizer and chat format, loaded once.
struct Model {
  std::unique_ptr<pdserve::text::Tokenizer> tokenizer;
  std::unique_ptr<pdserve::text::ChatFormat> format;
};
const Model& Bundled() {
  static const Model* model = [] {
    auto* m = new Model;
    m->tokenizer = pdserve::text::Tokenizer::Load(PDSERVE_BUNDLED_MODEL).value();
    m->format = pdserve::text::LoadChatFormat(PDSERVE_BUNDLED_MODEL, *m->tokenizer).value();
    return m;
  }();
  return *model;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  for (Endpoint endpoint : {Endpoint::kChatCompletions, Endpoint::kCompletions}) {
    ParsedRequest parsed = ParseRequest(endpoint, body);
    if (const auto* error = std::get_if<ApiError>(&parsed)) {
      Check(error->http_status >= 400 && error->http_status < 500);
      Check(!nlohmann::json::parse(error->ToJson(), nullptr, false).is_discarded());
      continue;
    }
    const ApiRequest& req = std::get<ApiRequest>(parsed);
    if (endpoint != Endpoint::kChatCompletions) continue;
    auto ids = ChatPromptTokens(*Bundled().format, *Bundled().tokenizer, req);
    if (!ids.ok()) {
      Check(ids.status().code() == absl::StatusCode::kInvalidArgument);
      continue;
    }
    for (int32_t id : *ids) Check(id >= 0 && id < Bundled().tokenizer->vocab_size());
  }
  return 0;
}
