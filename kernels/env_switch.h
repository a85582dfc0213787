// Environment switches: the PDSERVE_* variables that change how a process runs without a rebuild
// (A/B and tuning knobs; the list, with each switch's accepted values: docs/engine-gpu.md,
// "Environment switches"). A switch accepts a fixed set of texts, or a whole number within bounds,
// or a list of whole numbers; unset or empty it takes its default. A text it does not accept is
// ignored (the default applies, or for a number past a bound, the bound), and the first such
// reading of that switch in the process warns, naming the switch, the text, what is accepted and
// what the process does instead: a typo is never taken silently.
//
// Header-only plain C++17 inside kernels/: the CUDA kernels read switches too and build on their
// own with CUDA and GoogleTest only (kernels/cuda/CMakeLists.txt, nvcc's C++17), so this one
// parser serves every folder. Warnings go to stderr until a process routes them to its log
// (SetSwitchWarningSink; common/env_switch_log.h does it for the pdserve binary).
//
// Thread-safety: every function may be called from any thread.
#pragma once

#include <atomic>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

namespace pdserve::kernels {

// One accepted text of a switch and the value it stands for.
template <typename T>
struct SwitchChoice {
  const char* text;
  T value;
};

// What a switch's text gave: the value to use and, when the text was not taken as written, the
// warning that says so (empty otherwise).
template <typename T>
struct SwitchReading {
  T value;
  std::string warning;
};

// Where a switch's warning goes; called at most once per switch and process.
using SwitchWarningSink = void (*)(const std::string& message);

inline void WriteSwitchWarningToStderr(const std::string& message) {
  std::fprintf(stderr, "pdserve: warning: %s\n", message.c_str());
}

inline std::atomic<SwitchWarningSink>& SwitchWarningSinkSlot() {
  static std::atomic<SwitchWarningSink> sink{&WriteSwitchWarningToStderr};
  return sink;
}

// Sends every later switch warning of the process to `sink` (not null).
inline void SetSwitchWarningSink(SwitchWarningSink sink) { SwitchWarningSinkSlot().store(sink); }

// Hands `warning` to the sink unless it is empty or `name` has warned before in this process.
inline void WarnSwitchOnce(const char* name, const std::string& warning) {
  if (warning.empty()) return;
  static std::mutex mu;
  static std::set<std::string> warned;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!warned.insert(std::string(name)).second) return;
  }
  SwitchWarningSinkSlot().load()(warning);
}

// The text of `name` in the environment; null when it is unset or empty (both mean the default).
inline const char* SwitchText(const char* name) {
  const char* text = std::getenv(name);
  return text != nullptr && *text != '\0' ? text : nullptr;
}

// "NAME='text' is not accepted (accepted: `accepted`); ignored, using `instead`".
inline std::string SwitchWarning(std::string_view name, std::string_view text,
                                 std::string_view accepted, std::string_view instead) {
  std::string out(name);
  out.append("='").append(text).append("' is not accepted (accepted: ").append(accepted);
  out.append("); ignored, using ").append(instead);
  return out;
}

// The choices' texts, ", "-separated.
template <typename T, size_t N>
std::string SwitchChoiceList(const SwitchChoice<T> (&choices)[N]) {
  std::string out;
  for (const SwitchChoice<T>& c : choices) out.append(out.empty() ? "" : ", ").append(c.text);
  return out;
}

// The choice whose text equals `text` exactly (case included); nullopt for none.
template <typename T, size_t N>
std::optional<T> FindSwitchChoice(std::string_view text, const SwitchChoice<T> (&choices)[N]) {
  for (const SwitchChoice<T>& c : choices) {
    if (text == c.text) return c.value;
  }
  return std::nullopt;
}

// A whole number: optional ASCII whitespace around it, an optional sign, decimal digits only;
// nullopt for anything else or past int64_t.
inline std::optional<int64_t> ParseWholeNumber(std::string_view text) {
  constexpr std::string_view kSpace = " \t\n\v\f\r";
  const size_t first = text.find_first_not_of(kSpace);
  if (first == std::string_view::npos) return std::nullopt;
  text = text.substr(first, text.find_last_not_of(kSpace) - first + 1);
  if (text.size() > 1 && text[0] == '+' && text[1] != '-') text.remove_prefix(1);
  int64_t value = 0;
  const std::from_chars_result parsed =
      std::from_chars(text.data(), text.data() + text.size(), value);
  if (parsed.ec != std::errc() || parsed.ptr != text.data() + text.size()) return std::nullopt;
  return value;
}

// Between min_fields and max_fields whole numbers (ParseWholeNumber's) separated by commas;
// nullopt for anything else.
inline std::optional<std::vector<int64_t>> ParseWholeNumbers(std::string_view text,
                                                             size_t min_fields, size_t max_fields) {
  std::vector<int64_t> out;
  while (true) {
    const size_t comma = text.find(',');
    const std::optional<int64_t> v = ParseWholeNumber(text.substr(0, comma));
    if (!v || out.size() == max_fields) return std::nullopt;
    out.push_back(*v);
    if (comma == std::string_view::npos) break;
    text.remove_prefix(comma + 1);
  }
  if (out.size() < min_fields) return std::nullopt;
  return out;
}

// `text` (the switch `name`'s, null or empty: unset) through `parse` (std::string_view ->
// std::optional<T>): its value when parse accepts it, else `fallback` with SwitchWarning's text
// naming `accepted` and `instead`.
template <typename T, typename Parse>
SwitchReading<T> ParseSwitchWith(const char* name, const char* text, Parse parse, T fallback,
                                 std::string_view accepted, std::string_view instead) {
  if (text == nullptr || *text == '\0') return {fallback, ""};
  if (std::optional<T> value = parse(std::string_view(text))) return {*value, ""};
  return {fallback, SwitchWarning(name, text, accepted, instead)};
}

// `text` as one of `choices` (exact match), else `fallback`; `instead` names what the fallback
// does ("the default (...)").
template <typename T, size_t N>
SwitchReading<T> ParseSwitch(const char* name, const char* text,
                             const SwitchChoice<T> (&choices)[N], T fallback,
                             std::string_view instead) {
  // Not through ParseSwitchWith: the list of choices is made only for a warning (some switches
  // are read on every call).
  if (text == nullptr || *text == '\0') return {fallback, ""};
  if (std::optional<T> value = FindSwitchChoice(text, choices)) return {*value, ""};
  return {fallback, SwitchWarning(name, text, SwitchChoiceList(choices), instead)};
}

// The texts of an on / off switch, and of one that overrides an option (nullopt: the option).
inline constexpr SwitchChoice<bool> kSwitchFlag[] = {{"0", false}, {"1", true}};
inline constexpr SwitchChoice<std::optional<bool>> kSwitchOverride[] = {{"0", false}, {"1", true}};

// `text` as a whole number (ParseWholeNumber's) in [min, max]: past a bound the bound, anything
// else `fallback`, each with a warning.
inline SwitchReading<int64_t> ParseSwitchNumber(const char* name, const char* text,
                                                int64_t fallback, int64_t min, int64_t max) {
  const std::string range = "[" + std::to_string(min) + ", " + std::to_string(max) + "]";
  SwitchReading<int64_t> reading =
      ParseSwitchWith(name, text, ParseWholeNumber, fallback, "a whole number in " + range,
                      "the default, " + std::to_string(fallback));
  if (!reading.warning.empty() || (reading.value >= min && reading.value <= max)) return reading;
  const int64_t bound = reading.value < min ? min : max;
  reading.warning = std::string(name) + "=" + std::to_string(reading.value) + " is outside " +
                    range + "; using " + std::to_string(bound);
  reading.value = bound;
  return reading;
}

// A reading's value, its warning (if any) handed to WarnSwitchOnce.
template <typename T>
T TakeSwitchReading(const char* name, SwitchReading<T> reading) {
  WarnSwitchOnce(name, reading.warning);
  return std::move(reading.value);
}

// The environment's `name` by ParseSwitch, ParseSwitchNumber and ParseSwitchWith, warning once
// per process and switch.
template <typename T, size_t N>
T ReadSwitch(const char* name, const SwitchChoice<T> (&choices)[N], T fallback,
             std::string_view instead) {
  return TakeSwitchReading(name, ParseSwitch(name, SwitchText(name), choices, fallback, instead));
}
inline bool ReadSwitchFlag(const char* name, bool fallback, std::string_view instead) {
  return ReadSwitch(name, kSwitchFlag, fallback, instead);
}
inline std::optional<bool> ReadSwitchOverride(const char* name, std::string_view instead) {
  return ReadSwitch(name, kSwitchOverride, std::optional<bool>(), instead);
}
inline int64_t ReadSwitchNumber(const char* name, int64_t fallback, int64_t min, int64_t max) {
  return TakeSwitchReading(name, ParseSwitchNumber(name, SwitchText(name), fallback, min, max));
}
template <typename T, typename Parse>
T ReadSwitchWith(const char* name, Parse parse, T fallback, std::string_view accepted,
                 std::string_view instead) {
  return TakeSwitchReading(
      name, ParseSwitchWith(name, SwitchText(name), parse, fallback, accepted, instead));
}

}  // namespace pdserve::kernels
