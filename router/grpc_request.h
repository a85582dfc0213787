// A pdserve.v1 GenerateRequest read into the frontend's ApiRequest through the HTTP front's own
// parser: the request becomes the JSON body of the equivalent OpenAI request and
// frontend::ParseRequest validates it, so the gRPC front accepts, refuses (with the same
// messages) and defaults exactly what the HTTP front does. Only what the proto can express and
// JSON cannot is checked here first: non-finite numbers, chat-only fields on a text prompt, JSON
// text fields (a tool's parameters_json, response_format's schema_json) that do not parse or nest
// too deep to re-serialize.
//
// Pure functions; thread-safe.
#pragma once

#include <string>
#include <variant>

#include "frontend/api_request.h"
#include "pdserve/v1/generate.pb.h"

namespace pdserve::router {

// How many JSON levels the OpenAI body puts around the deepest JSON text field it embeds: a
// tool's parameters_json sits in {"tools": [{"function": {"parameters": ...}}]} (the body, the
// tools array, the tool, its function). response_format's schema_json sits 3 deep.
inline constexpr int kJsonTextWrapLevels = 4;

// The OpenAI JSON body equivalent to `request` (always "stream": true), or a 400 for what the
// JSON body could not carry faithfully. Sets `endpoint` (chat or completions) either way.
std::variant<std::string, frontend::ApiError> ToOpenAiJson(
    const pdserve::v1::GenerateRequest& request, frontend::Endpoint* endpoint);

// `request` read as the HTTP front reads its JSON body: the ApiRequest (front kGrpc), or the 400
// either ToOpenAiJson or frontend::ParseRequest gave. Sets `endpoint`.
frontend::ParsedRequest ParseGenerateRequest(const pdserve::v1::GenerateRequest& request,
                                             frontend::Endpoint* endpoint);

}  // namespace pdserve::router
