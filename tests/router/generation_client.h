// A blocking client call of the router's gRPC front (pdserve.v1.Generation) for the tests.
#pragma once

#include <vector>

#include "grpcpp/grpcpp.h"
#include "pdserve/v1/generate.grpc.pb.h"

namespace pdserve::router::testing {

// Runs one Generate call on `stub` to its end: appends every response to `out`, returns the
// call's status.
inline grpc::Status GenerateAll(pdserve::v1::Generation::Stub& stub,
                                const pdserve::v1::GenerateRequest& request,
                                std::vector<pdserve::v1::GenerateResponse>* out) {
  grpc::ClientContext context;
  auto reader = stub.Generate(&context, request);
  pdserve::v1::GenerateResponse response;
  while (reader->Read(&response)) out->push_back(response);
  return reader->Finish();
}

}  // namespace pdserve::router::testing
