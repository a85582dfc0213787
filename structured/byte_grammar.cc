#include "structured/byte_grammar.h"

#include <cstring>
#include <utility>

namespace pdserve::structured {

std::string MatcherState::Key() const {
  std::string key(reinterpret_cast<const char*>(frames.data()), frames.size() * sizeof(Frame));
  key.append(reinterpret_cast<const char*>(ends.data()), ends.size() * sizeof(uint16_t));
  return key;
}

bool Utf8Lead(uint8_t byte, uint32_t* more, uint32_t* lo, uint32_t* hi) {
  *lo = 0x80;
  *hi = 0xBF;
  if (byte >= 0xC2 && byte <= 0xDF) {
    *more = 1;
  } else if (byte >= 0xE0 && byte <= 0xEF) {
    *more = 2;
    if (byte == 0xE0) *lo = 0xA0;
    if (byte == 0xED) *hi = 0x9F;
  } else if (byte >= 0xF0 && byte <= 0xF4) {
    *more = 3;
    if (byte == 0xF0) *lo = 0x90;
    if (byte == 0xF4) *hi = 0x8F;
  } else {
    return false;
  }
  return true;
}

void DeduplicateStacks(MatcherState* state) {
  if (state->ends.size() < 2) return;
  std::vector<Frame> frames;
  std::vector<uint16_t> ends;
  size_t begin = 0;
  for (uint16_t end : state->ends) {
    const size_t size = end - begin;
    bool seen = false;
    size_t other = 0;
    for (uint16_t kept_end : ends) {
      if (kept_end - other == size &&
          std::memcmp(&frames[other], &state->frames[begin], size * sizeof(Frame)) == 0) {
        seen = true;
        break;
      }
      other = kept_end;
    }
    if (!seen) {
      frames.insert(frames.end(), state->frames.begin() + static_cast<std::ptrdiff_t>(begin),
                    state->frames.begin() + static_cast<std::ptrdiff_t>(end));
      ends.push_back(static_cast<uint16_t>(frames.size()));
    }
    begin = end;
  }
  state->frames = std::move(frames);
  state->ends = std::move(ends);
}

GrammarMatcher::GrammarMatcher(std::shared_ptr<const ByteGrammar> grammar)
    : grammar_(std::move(grammar)), state_(grammar_->Start()) {}

bool GrammarMatcher::Advance(uint8_t byte) {
  if (!grammar_->Step(state_, byte, &next_)) return false;
  std::swap(state_, next_);
  return true;
}

bool GrammarMatcher::Advance(std::string_view bytes) {
  MatcherState saved = state_;
  for (char c : bytes) {
    if (!Advance(static_cast<uint8_t>(c))) {
      state_ = std::move(saved);
      return false;
    }
  }
  return true;
}

}  // namespace pdserve::structured
