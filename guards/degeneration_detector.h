// Online detector of degenerate generations: a repeated n-gram running to the token limit, or
// content that is empty or whitespace only (the failure modes of docs/guards.md).
//
// Repeats: for every period n in 1..max_ngram the detector keeps how many consecutive tokens
// have equalled the token n places earlier. A periodic stretch of `span` tokens with period n
// is `span / n` back-to-back copies of one n-gram. Push() costs O(max_ngram) time and the
// detector O(max_ngram) memory, i.e. O(1) per token for a fixed max_ngram (32 by default).
//
// Not thread-safe: one detector per request choice, driven by the thread that decodes it.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

namespace pdserve::guards {

struct DegenerationThresholds {
  int max_ngram = 32;        // longest period looked for, in tokens
  int min_repeats = 8;       // an n-gram repeated this many times in a row ...
  int min_span_tokens = 24;  // ... over at least this many tokens is degenerate
};

// One periodic stretch: `repeats` back-to-back copies of an `ngram`-token sequence covering
// `span_tokens` tokens (span_tokens may exceed ngram * repeats by a partial copy).
struct RepeatRun {
  int ngram = 0;
  int repeats = 0;
  int64_t span_tokens = 0;
};

class DegenerationDetector {
 public:
  explicit DegenerationDetector(DegenerationThresholds thresholds = {});

  // Feeds the next generated token id.
  void Push(int32_t token);
  // Feeds the next piece of decoded text (UTF-8), for the empty / whitespace-only checks.
  void PushText(std::string_view text);

  // The longest periodic stretch ending at the last token, and the longest seen so far.
  RepeatRun CurrentRun() const;
  const RepeatRun& LongestRun() const { return longest_; }
  // True once any periodic stretch (any period up to max_ngram, at any point so far) has met both
  // thresholds; latched: it stays true whatever follows.
  bool Repetitive() const;
  // True when text has been fed and every character of it is whitespace (Unicode White_Space).
  bool WhitespaceOnly() const { return saw_text_ && !saw_visible_; }
  // True when no text, or only empty pieces, have been fed.
  bool Empty() const { return !saw_text_; }
  bool Degenerate() const { return Repetitive() || WhitespaceOnly(); }
  int64_t tokens() const { return count_; }

 private:
  DegenerationThresholds thresholds_;
  std::vector<int32_t> ring_;   // last max_ngram tokens, ring_[i % max_ngram] = token i
  std::vector<int64_t> match_;  // match_[n]: consecutive tokens equal to the one n back
  int64_t count_ = 0;
  RepeatRun longest_;
  bool repetitive_ = false;
  bool saw_text_ = false;
  bool saw_visible_ = false;
  uint32_t pending_codepoint_ = 0;  // UTF-8 decoding across PushText() calls
  int pending_bytes_ = 0;
};

}  // namespace pdserve::guards
