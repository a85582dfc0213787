#include "text/incremental_detokenizer.h"

#include <algorithm>

#include "text/utf8.h"

namespace pdserve::text {
namespace {

// Earliest occurrence of any stop string in `text` that ends after its first `min_end` bytes: its
// position and the stop string; npos if none. Among stop strings found at the same position the
// longest is reported.
size_t FindEarliestStop(std::string_view text, const std::vector<std::string>& stops,
                        std::string* matched, size_t min_end = 0) {
  size_t best = std::string_view::npos;
  for (const std::string& stop : stops) {
    if (stop.empty()) continue;
    const size_t pos = text.find(stop, min_end >= stop.size() ? min_end - stop.size() + 1 : 0);
    if (pos == std::string_view::npos) continue;
    if (pos < best || (pos == best && stop.size() > matched->size())) {
      best = pos;
      *matched = stop;
    }
  }
  return best;
}

// Earliest position from which the rest of `text` is a proper prefix of some stop string, so a
// later token could complete a match starting there; text.size() if none.
size_t EarliestPartialStop(std::string_view text, const std::vector<std::string>& stops) {
  size_t longest = 0;
  for (const std::string& stop : stops) {
    const size_t max_len = std::min(stop.size() - (stop.empty() ? 0 : 1), text.size());
    for (size_t len = max_len; len > longest; --len) {
      if (text.substr(text.size() - len) == std::string_view(stop).substr(0, len)) {
        longest = len;
        break;
      }
    }
  }
  return text.size() - longest;
}

}  // namespace

std::string TruncateAtStop(std::string_view text, const std::vector<std::string>& stop_strings,
                           std::string* matched) {
  std::string found;
  const size_t pos = FindEarliestStop(text, stop_strings, &found);
  if (matched != nullptr) *matched = found;
  return std::string(pos == std::string_view::npos ? text : text.substr(0, pos));
}

IncrementalDetokenizer::IncrementalDetokenizer(const Tokenizer& tokenizer,
                                               DetokenizeOptions options)
    : tokenizer_(tokenizer), options_(std::move(options)) {}

absl::StatusOr<DetokenizeStep> IncrementalDetokenizer::Add(int32_t id) {
  DetokenizeStep step;
  if (stopped_) {
    step.stopped = true;
    return step;
  }
  const size_t before = bytes_.size();
  if (absl::Status s = tokenizer_.AppendTokenBytes(id, options_.skip_special_tokens, &bytes_);
      !s.ok()) {
    bytes_.resize(before);
    return s;
  }
  // Everything but an unfinished trailing sequence decodes the same whatever follows, so it is
  // final (Utf8Lossy is prefix-stable at that boundary).
  const size_t final_bytes = bytes_.size() - IncompleteUtf8Tail(bytes_);
  pending_ += Utf8Lossy(std::string_view(bytes_).substr(0, final_bytes));
  bytes_.erase(0, final_bytes);
  // Before the min_tokens-th token a stop string cannot end: what is pending is all plain text.
  if (++added_ < options_.min_tokens) stop_floor_ = pending_.size();
  Release(/*at_end=*/false, &step);
  return step;
}

DetokenizeStep IncrementalDetokenizer::Finish() { return End(/*drop_tail=*/false); }

DetokenizeStep IncrementalDetokenizer::FinishCut() { return End(/*drop_tail=*/true); }

DetokenizeStep IncrementalDetokenizer::End(bool drop_tail) {
  DetokenizeStep step;
  if (stopped_) {
    step.stopped = true;
    return step;
  }
  // Add() left only an unfinished sequence in bytes_ (IncompleteUtf8Tail).
  if (!drop_tail) pending_ += Utf8Lossy(bytes_);
  bytes_.clear();
  Release(/*at_end=*/true, &step);
  return step;
}

void IncrementalDetokenizer::Release(bool at_end, DetokenizeStep* step) {
  std::string matched;
  const size_t stop_pos = FindEarliestStop(pending_, options_.stop_strings, &matched, stop_floor_);
  // A stop string that completes later but starts earlier would win in the non-streamed text,
  // so a complete match only ends the stream when no earlier partial match is pending.
  const size_t partial =
      at_end ? pending_.size() : EarliestPartialStop(pending_, options_.stop_strings);
  if (stop_pos != std::string::npos && stop_pos <= partial) {
    step->text = pending_.substr(0, stop_pos);
    step->stopped = true;
    step->stop_string = matched;
    stopped_ = true;
    pending_.clear();
    bytes_.clear();
    return;
  }
  const size_t release = std::min(partial, stop_pos);
  step->text = pending_.substr(0, release);
  pending_.erase(0, release);
  stop_floor_ -= std::min(stop_floor_, release);
}

}  // namespace pdserve::text
