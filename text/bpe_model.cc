#include "text/bpe_model.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "text/byte_level.h"
#include "text/string_view_compat.h"

namespace pdserve::text {
namespace {

using nlohmann::json;

absl::Status CheckSupported(const json& model) {
  if (model.value("type", "BPE") != "BPE") {
    return absl::UnimplementedError(absl::StrCat("model type '", model.value("type", ""), "'"));
  }
  for (const char* key :
       {"dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix"}) {
    if (model.contains(key) && !model[key].is_null()) {
      return absl::UnimplementedError(absl::StrCat("BPE option '", key, "' is not supported"));
    }
  }
  if (model.value("byte_fallback", false)) {
    return absl::UnimplementedError("BPE option 'byte_fallback' is not supported");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::pair<std::string, std::string>> ParseMerge(const json& merge) {
  if (merge.is_array() && merge.size() == 2) {
    return std::make_pair(merge[0].get<std::string>(), merge[1].get<std::string>());
  }
  if (merge.is_string()) {
    const std::string text = merge.get<std::string>();
    const size_t space = text.find(' ');
    if (space != std::string::npos && text.find(' ', space + 1) == std::string::npos) {
      return std::make_pair(text.substr(0, space), text.substr(space + 1));
    }
  }
  return absl::InvalidArgumentError("BPE merge is neither \"a b\" nor [\"a\", \"b\"]: " +
                                    merge.dump());
}

}  // namespace

absl::StatusOr<std::unique_ptr<BpeModel>> BpeModel::FromJson(const json& model) {
  if (absl::Status s = CheckSupported(model); !s.ok()) return s;
  auto bpe = std::unique_ptr<BpeModel>(new BpeModel());
  try {
    bpe->ignore_merges_ = model.value("ignore_merges", false);
    for (const auto& [token, id_json] : model.at("vocab").items()) {
      const int32_t id = id_json.get<int32_t>();
      if (id < 0) return absl::InvalidArgumentError("BPE vocab: negative id for " + token);
      if (static_cast<size_t>(id) >= bpe->id_to_token_.size()) {
        bpe->id_to_token_.resize(id + 1);
        bpe->id_present_.resize(id + 1);
      }
      bpe->id_to_token_[id] = token;
      bpe->id_present_[id] = true;
      bpe->token_to_id_[token] = id;
    }
    int32_t rank = 0;
    for (const json& merge : model.at("merges")) {
      auto parts = ParseMerge(merge);
      if (!parts.ok()) return parts.status();
      const auto left = bpe->TokenToId(parts->first);
      const auto right = bpe->TokenToId(parts->second);
      const auto result = bpe->TokenToId(parts->first + parts->second);
      if (!left || !right || !result) {
        return absl::InvalidArgumentError("BPE merge refers to tokens not in vocab: " +
                                          merge.dump());
      }
      // A repeated pair keeps its last rank, as tokenizers' collect() into a HashMap does.
      bpe->merges_.insert_or_assign(PairKey(*left, *right), MergeRule{rank, *result});
      ++rank;
    }
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("BPE model: ", e.what()));
  }
  for (int b = 0; b < 256; ++b) {
    const auto id = bpe->TokenToId(ByteLevelChar(static_cast<uint8_t>(b)));
    if (!id) return absl::InvalidArgumentError(absl::StrCat("BPE vocab lacks byte ", b));
    bpe->byte_ids_[b] = *id;
  }
  return bpe;
}

std::optional<std::string_view> BpeModel::IdToToken(int32_t id) const {
  if (id < 0 || id >= id_limit() || !id_present_[id]) return std::nullopt;
  return id_to_token_[id];
}

std::optional<int32_t> BpeModel::TokenToId(std::string_view token) const {
  auto it = token_to_id_.find(AbslView(token));
  if (it == token_to_id_.end()) return std::nullopt;
  return it->second;
}

void BpeModel::Encode(std::string_view piece, std::vector<int32_t>* ids) const {
  if (piece.size() == 1) {
    ids->push_back(byte_ids_[static_cast<uint8_t>(piece[0])]);
    return;
  }
  if (ignore_merges_) {
    if (auto id = TokenToId(ByteLevelEncode(piece))) {
      ids->push_back(*id);
      return;
    }
  }
  const bool cacheable = piece.size() <= kMaxCachedPieceBytes;
  if (cacheable) {
    absl::MutexLock lock(&cache_mutex_);
    auto it = cache_.find(AbslView(piece));
    if (it != cache_.end()) {
      ids->insert(ids->end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = ids->size();
  MergePiece(piece, ids);
  if (cacheable) {
    absl::MutexLock lock(&cache_mutex_);
    if (cache_.size() < kMaxCacheEntries) {
      cache_.try_emplace(std::string(piece), ids->begin() + first, ids->end());
    }
  }
}

void BpeModel::MergePiece(std::string_view piece, std::vector<int32_t>* ids) const {
  // Symbols form a doubly linked list over the piece's bytes; a min-heap holds candidate merges
  // ordered by (rank, position). Stale candidates are skipped when popped, as in tokenizers.
  struct Candidate {
    int32_t rank;
    int32_t pos;
    int32_t result;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  const int32_t n = static_cast<int32_t>(piece.size());
  std::vector<int32_t> symbol(n), prev(n), next(n);
  for (int32_t i = 0; i < n; ++i) {
    symbol[i] = byte_ids_[static_cast<uint8_t>(piece[i])];
    prev[i] = i - 1;
    next[i] = i + 1 < n ? i + 1 : -1;
  }
  std::vector<Candidate> heap;
  auto push = [&](int32_t pos) {
    if (pos < 0 || next[pos] < 0) return;
    auto it = merges_.find(PairKey(symbol[pos], symbol[next[pos]]));
    if (it == merges_.end()) return;
    heap.push_back({it->second.rank, pos, it->second.result});
    std::push_heap(heap.begin(), heap.end(), std::greater<>());
  };
  for (int32_t i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<>());
    const Candidate top = heap.back();
    heap.pop_back();
    const int32_t right = next[top.pos];
    if (symbol[top.pos] < 0 || right < 0) continue;
    auto it = merges_.find(PairKey(symbol[top.pos], symbol[right]));
    if (it == merges_.end() || it->second.result != top.result) continue;
    symbol[top.pos] = top.result;
    symbol[right] = -1;
    next[top.pos] = next[right];
    if (next[right] >= 0) prev[next[right]] = top.pos;
    push(prev[top.pos]);
    push(top.pos);
  }
  for (int32_t i = 0; i >= 0; i = next[i]) ids->push_back(symbol[i]);
}

}  // namespace pdserve::text
