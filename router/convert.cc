#include "router/convert.h"

namespace pdserve::router {

worker::v1::SamplingParams ToProto(const serving::SamplingParams& params, int choice) {
  worker::v1::SamplingParams out;
  out.set_temperature(static_cast<float>(params.temperature));
  out.set_top_p(static_cast<float>(params.top_p));
  out.set_top_k(params.top_k);
  out.set_min_p(static_cast<float>(params.min_p));
  if (params.seed) out.set_seed(*params.seed);
  out.set_max_tokens(params.max_tokens);
  out.set_min_tokens(params.min_tokens);
  for (int32_t id : params.stop_token_ids) out.add_stop_token_ids(id);
  out.set_presence_penalty(static_cast<float>(params.presence_penalty));
  out.set_frequency_penalty(static_cast<float>(params.frequency_penalty));
  out.set_repetition_penalty(static_cast<float>(params.repetition_penalty));
  for (const auto& [id, bias] : params.logit_bias) {
    (*out.mutable_logit_bias())[id] = static_cast<float>(bias);
  }
  out.set_choice(static_cast<uint32_t>(choice));
  if (params.logprobs) out.set_logprobs(*params.logprobs);
  out.set_ignore_eos(params.ignore_eos);
  out.set_json_schema(params.json_schema);
  out.set_tool_call_grammar(params.tool_call_grammar);
  return out;
}

}  // namespace pdserve::router
