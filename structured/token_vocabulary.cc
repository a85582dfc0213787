#include "structured/token_vocabulary.h"

#include <algorithm>
#include <utility>

#include "common/status.h"

namespace pdserve::structured {

std::shared_ptr<const TokenVocabulary> TokenVocabulary::Create(
    const std::vector<std::optional<std::string>>& token_bytes) {
  std::shared_ptr<TokenVocabulary> v(new TokenVocabulary());
  v->size_ = static_cast<int32_t>(token_bytes.size());
  std::fill(std::begin(v->single_byte_), std::end(v->single_byte_), -1);
  v->bytes_.resize(token_bytes.size());
  std::vector<std::pair<std::string_view, int32_t>> sorted;
  for (size_t id = 0; id < token_bytes.size(); ++id) {
    if (token_bytes[id] && !token_bytes[id]->empty()) {
      v->bytes_[id] = *token_bytes[id];
      sorted.emplace_back(v->bytes_[id], static_cast<int32_t>(id));
    }
  }
  std::sort(sorted.begin(), sorted.end());
  // Sorted strings give the trie in preorder: each string keeps the path it shares with the one
  // before and adds nodes for the rest.
  v->byte_.push_back(0);
  v->depth_.push_back(0);
  v->skip_.push_back(0);
  std::vector<int32_t> node_of_token;
  std::vector<int32_t> path = {0};  // node at each depth of the current string
  std::string_view previous;
  for (const auto& [bytes, id] : sorted) {
    size_t common = 0;
    while (common < previous.size() && common < bytes.size() && previous[common] == bytes[common]) {
      ++common;
    }
    while (path.size() > common + 1) {
      v->skip_[path.back()] = static_cast<int32_t>(v->byte_.size());
      path.pop_back();
    }
    for (size_t d = common; d < bytes.size(); ++d) {
      path.push_back(static_cast<int32_t>(v->byte_.size()));
      v->byte_.push_back(static_cast<uint8_t>(bytes[d]));
      v->depth_.push_back(static_cast<uint16_t>(d + 1));
      v->skip_.push_back(0);
    }
    node_of_token.push_back(path.back());
    v->max_depth_ = std::max(v->max_depth_, static_cast<int32_t>(bytes.size()));
    if (bytes.size() == 1) v->single_byte_[static_cast<uint8_t>(bytes[0])] = id;
    previous = bytes;
  }
  const auto nodes = static_cast<int32_t>(v->byte_.size());
  for (int32_t node : path) v->skip_[node] = nodes;
  // Tokens grouped by node, in node order (sorted strings already are).
  v->token_begin_.assign(static_cast<size_t>(nodes) + 1, 0);
  for (int32_t node : node_of_token) ++v->token_begin_[static_cast<size_t>(node) + 1];
  for (int32_t i = 0; i < nodes; ++i) v->token_begin_[i + 1] += v->token_begin_[i];
  for (const auto& [bytes, id] : sorted) v->tokens_.push_back(id);
  return v;
}

absl::StatusOr<std::shared_ptr<const TokenVocabulary>> TokenVocabulary::FromTokenizer(
    const text::Tokenizer& tokenizer) {
  std::vector<std::optional<std::string>> bytes(static_cast<size_t>(tokenizer.vocab_size()));
  for (int32_t id = 0; id < tokenizer.vocab_size(); ++id) {
    if (tokenizer.IsSpecial(id) || !tokenizer.IdToToken(id)) continue;
    std::string out;
    PDSERVE_RETURN_IF_ERROR(tokenizer.AppendTokenBytes(id, /*skip_special_tokens=*/false, &out));
    bytes[id] = std::move(out);
  }
  return Create(bytes);
}

}  // namespace pdserve::structured
