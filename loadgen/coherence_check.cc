#include "loadgen/coherence_check.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "loadgen/runner.h"

namespace pdserve::loadgen {
namespace {

using json = nlohmann::json;

bool IsWordByte(unsigned char c) { return absl::ascii_isalnum(c) || c >= 0x80; }

// The "words" tokenization of the header comment.
std::vector<std::string> WordTokens(const std::string& text) {
  std::vector<std::string> out;
  size_t i = 0;
  while (i < text.size()) {
    const unsigned char c = text[i];
    if (absl::ascii_isspace(c)) {
      ++i;
    } else if (IsWordByte(c)) {
      size_t j = i;
      while (j < text.size() && IsWordByte(text[j])) ++j;
      out.push_back(text.substr(i, j - i));
      i = j;
    } else {
      out.push_back(text.substr(i, 1));
      ++i;
    }
  }
  return out;
}

std::vector<int32_t> Intern(const std::vector<std::string>& tokens) {
  std::map<std::string, int32_t> ids;
  std::vector<int32_t> out;
  out.reserve(tokens.size());
  for (const std::string& t : tokens) {
    out.push_back(ids.emplace(t, static_cast<int32_t>(ids.size())).first->second);
  }
  return out;
}

double Distinct2(const std::vector<int32_t>& ids) {
  if (ids.size() < 2) return 1;
  std::set<std::pair<int32_t, int32_t>> bigrams;
  for (size_t i = 1; i < ids.size(); ++i) bigrams.emplace(ids[i - 1], ids[i]);
  return static_cast<double>(bigrams.size()) / static_cast<double>(ids.size() - 1);
}

json ToJson(const SampleCheck& s) {
  json j = {{"greedy", s.greedy},
            {"pass", s.pass},
            {"reasons", s.reasons},
            {"tokenization", s.tokenization},
            {"content_bytes", s.content_bytes},
            {"tokens", s.tokens},
            {"max_repeat",
             {{"ngram", s.max_repeat.ngram},
              {"repeats", s.max_repeat.repeats},
              {"span_tokens", s.max_repeat.span_tokens}}},
            {"distinct2", s.distinct2},
            {"empty", s.empty},
            {"whitespace_only", s.whitespace_only},
            {"text", s.text}};
  if (!s.request_error.empty()) {
    // A failed request has no output to measure: null, not the defaults.
    j["request_error"] = s.request_error;
    for (const char* key : {"tokenization", "tokens", "max_repeat", "distinct2"}) j[key] = nullptr;
  }
  return j;
}

}  // namespace

absl::Status ApplyThresholdOverrides(const json& o, CheckThresholds* t) {
  if (!o.is_object()) return absl::InvalidArgumentError("\"thresholds\" must be an object");
  for (const auto& [key, value] : o.items()) {
    auto bad = [&key = key](const char* type) {
      return absl::InvalidArgumentError(absl::StrCat("threshold \"", key, "\" must be ", type));
    };
    if (key == "greedy_must_pass") {
      if (!value.is_boolean()) return bad("a boolean");
      t->greedy_must_pass = value.get<bool>();
    } else if (key == "min_distinct2" || key == "max_failing_fraction") {
      if (!value.is_number() || value.get<double>() < 0 || value.get<double>() > 1) {
        return bad("a number in [0, 1]");
      }
      (key == "min_distinct2" ? t->min_distinct2 : t->max_failing_fraction) = value.get<double>();
    } else if (key == "min_content_bytes" || key == "max_ngram" || key == "max_repeats" ||
               key == "min_span_tokens") {
      if (!value.is_number_integer() || value.get<int64_t>() < 0) return bad("an integer >= 0");
      const int64_t v = value.get<int64_t>();
      if (key == "min_content_bytes") t->min_content_bytes = v;
      if (key == "max_ngram") t->max_ngram = static_cast<int>(std::max<int64_t>(v, 1));
      if (key == "max_repeats") t->max_repeats = static_cast<int>(v);
      if (key == "min_span_tokens") t->min_span_tokens = static_cast<int>(v);
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown threshold \"", key, "\""));
    }
  }
  return absl::OkStatus();
}

SampleCheck AnalyzeSample(const RequestSample& sample, const CheckThresholds& t,
                          const std::optional<std::string>& expect) {
  SampleCheck c;
  c.text = sample.text;
  c.content_bytes = static_cast<int64_t>(sample.text.size());
  if (!sample.ok()) {
    c.request_error = sample.error_kind;
    const json body = json::parse(sample.error_detail, nullptr, /*allow_exceptions=*/false);
    if (body.is_object() && body.contains("error") && body["error"].is_object()) {
      const json& error = body["error"];
      if (error.contains("code") && error["code"].is_string()) {
        c.request_error_code = error["code"].get<std::string>();
      }
      if (error.contains("message") && error["message"].is_string()) {
        c.request_error_message = error["message"].get<std::string>();
      }
    }
    c.reasons.push_back(absl::StrCat("request failed: ", sample.error_kind, " ",
                                     sample.error_detail.substr(0, 200)));
    return c;
  }
  const bool use_logprobs = !sample.token_texts.empty();
  c.tokenization = use_logprobs ? "logprobs" : "words";
  const std::vector<int32_t> ids =
      Intern(use_logprobs ? sample.token_texts : WordTokens(sample.text));
  guards::DegenerationDetector detector({.max_ngram = t.max_ngram,
                                         .min_repeats = t.max_repeats,
                                         .min_span_tokens = t.min_span_tokens});
  for (int32_t id : ids) detector.Push(id);
  detector.PushText(sample.text);
  c.tokens = static_cast<int64_t>(ids.size());
  c.max_repeat = detector.LongestRun();
  // One copy and a token is no repeat (text whose token recurs once max_ngram later reads
  // "32-gram x1"): only two or more back-to-back copies are reported.
  if (c.max_repeat.repeats < 2 && !detector.Repetitive()) c.max_repeat = {};
  c.distinct2 = Distinct2(ids);
  c.empty = detector.Empty();
  c.whitespace_only = detector.WhitespaceOnly();
  if (c.empty) c.reasons.push_back("empty content");
  if (c.whitespace_only) c.reasons.push_back("whitespace-only content");
  if (!c.empty && c.content_bytes < t.min_content_bytes) {
    c.reasons.push_back(
        absl::StrCat("content ", c.content_bytes, " bytes < ", t.min_content_bytes));
  }
  if (detector.Repetitive()) {
    c.reasons.push_back(absl::StrCat("a ", c.max_repeat.ngram, "-gram repeated ",
                                     c.max_repeat.repeats, " times (", c.max_repeat.span_tokens,
                                     " tokens)"));
  }
  if (c.distinct2 < t.min_distinct2) {
    c.reasons.push_back(absl::StrFormat("distinct-2 %.3f < %.3f", c.distinct2, t.min_distinct2));
  }
  if (expect && sample.text.find(*expect) == std::string::npos) {
    c.reasons.push_back(absl::StrCat("does not contain \"", *expect, "\""));
  }
  c.pass = c.reasons.empty();
  return c;
}

absl::StatusOr<CheckReport> JudgePrompts(const std::vector<PromptItem>& prompts,
                                         const std::vector<std::vector<RequestSample>>& samples,
                                         const std::vector<std::optional<RequestSample>>& greedy,
                                         const CheckThresholds& defaults) {
  CheckReport report;
  report.pass = true;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const PromptItem& item = prompts[i];
    CheckThresholds t = defaults;
    std::optional<std::string> expect;
    if (item.extra.is_object()) {
      if (auto o = item.extra.find("thresholds"); o != item.extra.end()) {
        absl::Status s = ApplyThresholdOverrides(*o, &t);
        if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat(item.id, ": ", s.message()));
      }
      if (auto e = item.extra.find("expect"); e != item.extra.end() && e->is_string()) {
        expect = e->get<std::string>();
      }
    }
    PromptCheck p;
    p.id = item.id;
    int failing = 0;
    for (const RequestSample& s : samples[i]) {
      p.samples.push_back(AnalyzeSample(s, t, expect));
      if (!p.samples.back().pass) ++failing;
    }
    const double allowed = t.max_failing_fraction * static_cast<double>(p.samples.size());
    if (failing > allowed) {
      p.reasons.push_back(absl::StrCat(failing, " of ", p.samples.size(), " samples fail"));
    }
    if (i < greedy.size() && greedy[i]) {
      p.greedy = AnalyzeSample(*greedy[i], t, expect);
      p.greedy->greedy = true;
      if (!p.greedy->pass && t.greedy_must_pass) p.reasons.push_back("greedy control fails");
    }
    p.pass = p.reasons.empty();
    report.pass = report.pass && p.pass;
    report.prompts.push_back(std::move(p));
  }
  return report;
}

absl::StatusOr<CheckReport> RunCheck(const std::vector<PromptItem>& prompts,
                                     const CheckOptions& o) {
  if (o.samples < 1) return absl::InvalidArgumentError("--samples must be >= 1");
  // JSON has no NaN or infinity: such a value would go out as null, the server's default.
  if (o.temperature && !(*o.temperature >= 0 && std::isfinite(*o.temperature))) {
    return absl::InvalidArgumentError(
        absl::StrCat("--temperature must be a finite number >= 0, got ", *o.temperature));
  }
  if (prompts.empty()) return absl::InvalidArgumentError("no prompts");
  if (o.api == Api::kCompletions) {
    // /v1/completions applies no chat template: chat messages flattened to text are not what
    // the model was trained on (the bundled model answers such text with EOS at once), so the
    // check would judge the prompt, not the server.
    std::vector<std::string> chat;
    for (const PromptItem& item : prompts) {
      if (item.messages.is_array() && item.token_ids.empty()) chat.push_back(item.id);
    }
    if (!chat.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--api completions sends raw text (/v1/completions applies no chat template), and ",
          chat.size(), " of ", prompts.size(), " prompts are chat messages (",
          absl::StrJoin(chat, ", "), "): use --api chat, or a prompt file of \"prompt\" lines"));
    }
  }
  const int per_prompt = o.samples + (o.greedy_control ? 1 : 0);
  RunOptions run;
  run.url = o.url;
  run.max_concurrency = std::max<int64_t>(o.concurrency, 1);
  run.request_timeout_s = o.request_timeout_s;
  for (const PromptItem& item : prompts) {
    BodyOptions body{.api = o.api,
                     .model = o.model,
                     .default_max_tokens = o.default_max_tokens,
                     .temperature = o.temperature,
                     .logprobs = o.logprobs};
    for (int k = 0; k < o.samples; ++k) {
      if (o.seed) body.seed = *o.seed + k;
      run.requests.push_back({ApiPath(o.api), RequestBody(item, body)});
    }
    if (o.greedy_control) {
      body.temperature = 0.0;
      body.seed.reset();
      run.requests.push_back({ApiPath(o.api), RequestBody(item, body)});
    }
  }
  run.num_requests = static_cast<int64_t>(run.requests.size());
  PDSERVE_ASSIGN_OR_RETURN(RunResult result, Run(run));
  std::vector<std::vector<RequestSample>> samples(prompts.size());
  std::vector<std::optional<RequestSample>> greedy(prompts.size());
  for (size_t r = 0; r < result.samples.size(); ++r) {
    const size_t prompt = r / per_prompt;
    if (static_cast<int>(r % per_prompt) < o.samples) {
      samples[prompt].push_back(std::move(result.samples[r]));
    } else {
      greedy[prompt] = std::move(result.samples[r]);
    }
  }
  return JudgePrompts(prompts, samples, greedy, o.thresholds);
}

json ToJson(const CheckReport& report) {
  json prompts = json::array();
  for (const PromptCheck& p : report.prompts) {
    json samples = json::array();
    for (const SampleCheck& s : p.samples) samples.push_back(ToJson(s));
    prompts.push_back({{"id", p.id},
                       {"pass", p.pass},
                       {"reasons", p.reasons},
                       {"samples", samples},
                       {"greedy", p.greedy ? ToJson(*p.greedy) : json(nullptr)}});
  }
  return {{"pass", report.pass}, {"prompts", prompts}};
}

std::string ToTable(const CheckReport& report) {
  std::string out =
      absl::StrFormat("%-24s %-6s %8s %10s %14s %9s %7s %-6s\n", "prompt", "result", "ok/K",
                      "min bytes", "worst repeat", "min dist2", "greedy", "tokens");
  for (const PromptCheck& p : report.prompts) {
    int ok = 0;
    // Over the samples whose request succeeded; "-" where there is none (nothing to measure).
    int measured = 0;
    int64_t min_bytes = INT64_MAX;
    double min_d2 = 1;
    guards::RepeatRun worst;
    std::string tokenization;
    for (const SampleCheck& s : p.samples) {
      ok += s.pass ? 1 : 0;
      if (!s.request_error.empty()) continue;
      if (measured++ == 0) tokenization = s.tokenization;
      min_bytes = std::min(min_bytes, s.content_bytes);
      min_d2 = std::min(min_d2, s.distinct2);
      if (s.max_repeat.span_tokens > worst.span_tokens) worst = s.max_repeat;
    }
    const std::string none = "-";
    out += absl::StrFormat(
        "%-24s %-6s %8s %10s %14s %9s %7s %-6s\n", p.id.substr(0, 24), p.pass ? "PASS" : "FAIL",
        absl::StrCat(ok, "/", p.samples.size()), measured == 0 ? none : absl::StrCat(min_bytes),
        worst.repeats == 0 ? none : absl::StrCat(worst.ngram, "-gram x", worst.repeats),
        measured == 0 ? none : absl::StrFormat("%.3f", min_d2),
        !p.greedy ? "-" : (p.greedy->pass ? "pass" : "fail"), measured == 0 ? none : tokenization);
    for (const std::string& why : p.reasons) out += absl::StrCat("    ", why, "\n");
    for (const SampleCheck& s : p.samples) {
      if (s.pass) continue;
      out += absl::StrCat("    first failing sample: ", absl::StrJoin(s.reasons, "; "), "\n");
      break;
    }
  }
  out += report.pass ? "PASS\n" : "FAIL\n";
  return out;
}

std::string ContextLengthSummary(const CheckReport& report) {
  std::vector<std::string> ids;
  std::string message;
  for (const PromptCheck& p : report.prompts) {
    bool refused = false;
    auto look = [&](const SampleCheck& s) {
      if (s.request_error_code != "context_length_exceeded") return;
      refused = true;
      if (message.empty()) message = s.request_error_message;
    };
    for (const SampleCheck& s : p.samples) look(s);
    if (p.greedy) look(*p.greedy);
    if (refused) ids.push_back(p.id);
  }
  if (ids.empty()) return "";
  return absl::StrCat(ids.size(), " of ", report.prompts.size(),
                      " prompts do not fit the model's context (HTTP 400 context_length_exceeded: ",
                      absl::StrJoin(ids, ", "), "); the server says: \"", message, "\"");
}

}  // namespace pdserve::loadgen
