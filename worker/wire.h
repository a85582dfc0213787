// Conversions between pdserve.worker.v1 messages and serving's values, shared by the prefill and
// decode workers (so both derive the same random stream from the same sampling fields).
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvtransfer/ucx/ucx.h"
#include "pdserve/worker/v1/worker.pb.h"
#include "serving/page_pool.h"
#include "serving/sampler.h"
#include "serving/sampling_params.h"

namespace pdserve::worker {

// The request's sampling parameters for its choices `proto.choice()` .. choice + ChoiceCount - 1:
// n is choice + ChoiceCount, so each choice's stream is keyed (seed, choice, position) exactly as
// choice `choice` of a colocated request (docs/serving.md). proto3 cannot mark top_p and
// repetition_penalty unset; their zero (out of range for both) is read as 1, "off". Errors:
// InvalidArgument from ValidateSamplingParams, or for a choice >= kMaxChoices (or choice +
// choice_count above it) or max_tokens < 1.
absl::StatusOr<serving::SamplingParams> SamplingFromProto(
    const pdserve::worker::v1::SamplingParams& proto, int64_t vocab_size);

// The request id string the seed is derived from when the request carries none: the decimal
// request id (xxh3-64 of it; serving::EffectiveSeed).
std::string SeedRequestId(uint64_t request_id);

// How many choices a worker request covers (SamplingParams.choice_count; absent or 0 means 1).
uint32_t ChoiceCount(const pdserve::worker::v1::SamplingParams& proto);

pdserve::worker::v1::SampledToken SampledTokenToProto(const serving::SampledToken& token);

// The ticket's statement of a transport's UCX protocols (TransferTicket.ucx_protocols), and a
// statement's name for messages: "v1", "v2", or "unstated" (UNSPECIFIED or an unknown value).
pdserve::worker::v1::UcxProtocols UcxProtocolsToProto(kv::UcxProtocols protocols);
const char* UcxProtocolsProtoName(pdserve::worker::v1::UcxProtocols protocols);

// Sets stats' pages_total and pages_free over every page kind of `pool`.
void SetPoolPages(const serving::PagePool& pool, pdserve::worker::v1::StatsResponse* stats);

}  // namespace pdserve::worker
