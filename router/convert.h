// Conversions between the serving types and the pdserve.worker.v1 messages.
// Pure functions; thread-safe.
#pragma once

#include "pdserve/worker/v1/worker.pb.h"
#include "serving/sampling_params.h"

namespace pdserve::router {

// The worker's SamplingParams for choice `choice` of a request with `params`. Every field is
// set explicitly (seed included when `params.seed` is set); n is not sent (one worker request
// per choice).
worker::v1::SamplingParams ToProto(const serving::SamplingParams& params, int choice);

}  // namespace pdserve::router
