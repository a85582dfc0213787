// A test service's Generation whose Cancel() counts once into the service's `cancelled` and sets
// a stop flag the service's producing thread polls. Shared by the HTTP server tests.
//
// Thread-safety: Cancel() from any thread (the flag and the counter are atomics).
#pragma once

#include <atomic>
#include <memory>

#include "frontend/http_server.h"

namespace pdserve::frontend::testing {

// `Service` has `std::atomic<int> cancelled`; it outlives the generation.
template <typename Service>
struct CancellableGeneration : Generation {
  explicit CancellableGeneration(Service* s) : service(s) {}
  ~CancellableGeneration() override { Cancel(); }
  void Cancel() override {
    if (!stop->exchange(true)) service->cancelled++;
  }
  Service* service;
  std::shared_ptr<std::atomic<bool>> stop = std::make_shared<std::atomic<bool>>(false);
};

}  // namespace pdserve::frontend::testing
