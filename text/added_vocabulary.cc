#include "text/added_vocabulary.h"

#include "absl/strings/str_cat.h"
#include "text/string_view_compat.h"

namespace pdserve::text {

using nlohmann::json;

void AddedVocabulary::Trie::Insert(std::string_view content, int32_t token) {
  int32_t node = 0;
  for (char c : content) {
    const auto byte = static_cast<uint8_t>(c);
    auto it = nodes[node].children.find(byte);
    if (it == nodes[node].children.end()) {
      nodes.push_back(Node{});
      it = nodes[node].children.emplace(byte, static_cast<int32_t>(nodes.size() - 1)).first;
    }
    node = it->second;
  }
  nodes[node].token = token;
  if (!content.empty()) first_byte[static_cast<uint8_t>(content[0])] = true;
}

int32_t AddedVocabulary::Trie::LongestAt(std::string_view text, size_t pos, size_t* length) const {
  int32_t best = -1;
  int32_t node = 0;
  for (size_t i = pos; i < text.size(); ++i) {
    auto it = nodes[node].children.find(static_cast<uint8_t>(text[i]));
    if (it == nodes[node].children.end()) break;
    node = it->second;
    if (nodes[node].token >= 0) {
      best = nodes[node].token;
      *length = i + 1 - pos;
    }
  }
  return best;
}

absl::StatusOr<AddedVocabulary> AddedVocabulary::FromJson(const json& added_tokens) {
  AddedVocabulary vocab;
  if (added_tokens.is_null()) return vocab;
  try {
    for (const json& entry : added_tokens) {
      for (const char* flag : {"lstrip", "rstrip", "single_word"}) {
        if (entry.value(flag, false)) {
          return absl::UnimplementedError(
              absl::StrCat("added token ", entry.dump(), ": ", flag, "=true is not supported"));
        }
      }
      AddedToken token{entry.at("id").get<int32_t>(), entry.at("content").get<std::string>(),
                       entry.value("special", false), entry.value("normalized", true)};
      if (token.content.empty()) {
        return absl::InvalidArgumentError("added token with empty content: " + entry.dump());
      }
      const auto index = static_cast<int32_t>(vocab.tokens_.size());
      (token.normalized ? vocab.normalized_trie_ : vocab.raw_trie_).Insert(token.content, index);
      vocab.by_id_[token.id] = vocab.tokens_.size();
      vocab.by_content_[token.content] = token.id;
      vocab.tokens_.push_back(std::move(token));
    }
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("added_tokens: ", e.what()));
  }
  return vocab;
}

void AddedVocabulary::SplitWith(const Trie& trie, std::string_view text, size_t begin, size_t end,
                                bool allow_special, std::vector<Segment>* out) const {
  const std::string_view window = text.substr(0, end);
  size_t plain_start = begin;
  size_t pos = begin;
  while (pos < end) {
    size_t length = 0;
    const int32_t token = trie.first_byte[static_cast<uint8_t>(text[pos])]
                              ? trie.LongestAt(window, pos, &length)
                              : -1;
    if (token < 0) {
      ++pos;
      continue;
    }
    if (!allow_special && tokens_[token].special) {
      // Matched but not allowed: the whole match stays ordinary text, and matching resumes
      // after it, as in tokenizers.
      pos += length;
      continue;
    }
    if (pos > plain_start) out->push_back({plain_start, pos, -1});
    out->push_back({pos, pos + length, tokens_[token].id});
    pos += length;
    plain_start = pos;
  }
  if (end > plain_start) out->push_back({plain_start, end, -1});
}

void AddedVocabulary::Split(std::string_view text, bool allow_special,
                            std::vector<Segment>* segments) const {
  segments->clear();
  if (tokens_.empty()) {
    if (!text.empty()) segments->push_back({0, text.size(), -1});
    return;
  }
  std::vector<Segment> first_pass;
  SplitWith(raw_trie_, text, 0, text.size(), allow_special, &first_pass);
  for (const Segment& segment : first_pass) {
    if (segment.id >= 0) {
      segments->push_back(segment);
    } else {
      SplitWith(normalized_trie_, text, segment.begin, segment.end, allow_special, segments);
    }
  }
}

const AddedToken* AddedVocabulary::Find(int32_t id) const {
  auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : &tokens_[it->second];
}

std::optional<int32_t> AddedVocabulary::TokenToId(std::string_view content) const {
  auto it = by_content_.find(AbslView(content));
  if (it == by_content_.end()) return std::nullopt;
  return it->second;
}

}  // namespace pdserve::text
