#include "worker/wire.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"

namespace pdserve::worker {

absl::StatusOr<serving::SamplingParams> SamplingFromProto(
    const pdserve::worker::v1::SamplingParams& proto, int64_t vocab_size) {
  if (proto.choice() >= static_cast<uint32_t>(serving::kMaxChoices)) {
    return absl::InvalidArgumentError(
        absl::StrCat("choice must be in [0, ", serving::kMaxChoices, "), got ", proto.choice()));
  }
  if (proto.choice() + ChoiceCount(proto) > serving::kMaxChoices) {
    return absl::InvalidArgumentError(absl::StrCat("choice (", proto.choice(), ") + choice_count (",
                                                   proto.choice_count(), ") exceeds ",
                                                   serving::kMaxChoices, " choices"));
  }
  serving::SamplingParams params;
  params.temperature = proto.temperature();
  params.top_p = proto.top_p() == 0.0f ? 1.0 : proto.top_p();
  params.top_k = proto.top_k();
  params.min_p = proto.min_p();
  params.repetition_penalty = proto.repetition_penalty() == 0.0f ? 1.0 : proto.repetition_penalty();
  params.presence_penalty = proto.presence_penalty();
  params.frequency_penalty = proto.frequency_penalty();
  for (const auto& [token, bias] : proto.logit_bias()) params.logit_bias[token] = bias;
  if (proto.has_seed()) params.seed = proto.seed();
  params.stop_token_ids.assign(proto.stop_token_ids().begin(), proto.stop_token_ids().end());
  params.max_tokens = proto.max_tokens();
  params.min_tokens = proto.min_tokens();
  params.n = static_cast<int32_t>(proto.choice() + ChoiceCount(proto));
  if (proto.has_logprobs()) params.logprobs = proto.logprobs();
  params.ignore_eos = proto.ignore_eos();
  params.json_schema = proto.json_schema();
  params.tool_call_grammar = proto.tool_call_grammar();
  absl::Status valid = serving::ValidateSamplingParams(params, vocab_size);
  if (!valid.ok()) return valid;
  return params;
}

uint32_t ChoiceCount(const pdserve::worker::v1::SamplingParams& proto) {
  return std::max<uint32_t>(1, proto.choice_count());
}

std::string SeedRequestId(uint64_t request_id) { return absl::StrCat(request_id); }

pdserve::worker::v1::SampledToken SampledTokenToProto(const serving::SampledToken& token) {
  pdserve::worker::v1::SampledToken out;
  out.set_token_id(token.token);
  out.set_logprob(token.logprob);
  for (const serving::TokenLogprob& top : token.top_logprobs) {
    pdserve::worker::v1::TokenLogprob* alt = out.add_top_logprobs();
    alt->set_token_id(top.token);
    alt->set_logprob(top.logprob);
  }
  return out;
}

pdserve::worker::v1::UcxProtocols UcxProtocolsToProto(kv::UcxProtocols protocols) {
  return protocols == kv::UcxProtocols::kV2 ? pdserve::worker::v1::UCX_PROTOCOLS_V2
                                            : pdserve::worker::v1::UCX_PROTOCOLS_V1;
}

const char* UcxProtocolsProtoName(pdserve::worker::v1::UcxProtocols protocols) {
  switch (protocols) {
    case pdserve::worker::v1::UCX_PROTOCOLS_V1:
      return "v1";
    case pdserve::worker::v1::UCX_PROTOCOLS_V2:
      return "v2";
    default:
      return "unstated";
  }
}

void SetPoolPages(const serving::PagePool& pool, pdserve::worker::v1::StatsResponse* stats) {
  int64_t total = 0;
  int64_t free = 0;
  for (int32_t k = 0; k < pool.num_kinds(); ++k) {
    total += pool.pages_total(k);
    free += pool.pages_free(k);
  }
  stats->set_pages_total(total);
  stats->set_pages_free(free);
}

}  // namespace pdserve::worker
