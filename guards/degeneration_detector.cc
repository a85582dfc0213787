#include "guards/degeneration_detector.h"

#include <algorithm>

namespace pdserve::guards {
namespace {

// Unicode White_Space property (PropList.txt).
bool IsWhiteSpace(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

}  // namespace

DegenerationDetector::DegenerationDetector(DegenerationThresholds thresholds)
    : thresholds_(thresholds),
      ring_(static_cast<size_t>(std::max(thresholds.max_ngram, 1)), 0),
      match_(static_cast<size_t>(std::max(thresholds.max_ngram, 1)) + 1, 0) {}

void DegenerationDetector::Push(int32_t token) {
  const int64_t max_n = static_cast<int64_t>(ring_.size());
  for (int64_t n = 1; n <= max_n; ++n) {
    const bool equal = count_ >= n && ring_[static_cast<size_t>((count_ - n) % max_n)] == token;
    int64_t& matched = match_[static_cast<size_t>(n)];
    matched = equal ? matched + 1 : 0;
    // Latched over every period, not only the longest stretch: a later, longer stretch with
    // fewer repeats must not hide a loop already seen.
    const int64_t span = matched + n;
    if (matched > 0 && span / n >= thresholds_.min_repeats &&
        span >= thresholds_.min_span_tokens) {
      repetitive_ = true;
    }
  }
  ring_[static_cast<size_t>(count_ % max_n)] = token;
  ++count_;
  const RepeatRun run = CurrentRun();
  if (run.span_tokens > longest_.span_tokens ||
      (run.span_tokens == longest_.span_tokens && run.repeats > longest_.repeats)) {
    longest_ = run;
  }
}

RepeatRun DegenerationDetector::CurrentRun() const {
  RepeatRun best;
  for (size_t n = 1; n < match_.size(); ++n) {
    if (match_[n] == 0) continue;
    const int64_t span = match_[n] + static_cast<int64_t>(n);
    const int repeats = static_cast<int>(span / static_cast<int64_t>(n));
    // Prefer the longer stretch; on equal spans the shorter period (more repeats).
    if (span > best.span_tokens || (span == best.span_tokens && repeats > best.repeats)) {
      best = {static_cast<int>(n), repeats, span};
    }
  }
  return best;
}

bool DegenerationDetector::Repetitive() const { return repetitive_; }

void DegenerationDetector::PushText(std::string_view text) {
  if (text.empty()) return;
  saw_text_ = true;
  for (unsigned char c : text) {
    if (pending_bytes_ == 0) {
      if (c < 0x80) {
        if (!IsWhiteSpace(c)) saw_visible_ = true;
        continue;
      }
      pending_bytes_ = c >= 0xF0 ? 3 : c >= 0xE0 ? 2 : c >= 0xC0 ? 1 : 0;
      pending_codepoint_ = c & (c >= 0xF0 ? 0x07 : c >= 0xE0 ? 0x0F : 0x1F);
      if (pending_bytes_ == 0) saw_visible_ = true;  // stray continuation byte: not whitespace
      continue;
    }
    pending_codepoint_ = (pending_codepoint_ << 6) | (c & 0x3F);
    if (--pending_bytes_ == 0 && !IsWhiteSpace(pending_codepoint_)) saw_visible_ = true;
  }
}

}  // namespace pdserve::guards
