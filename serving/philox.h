// Philox-4x32-10, the counter-based random number generator of Salmon, Moraes, Dror and Shaw,
// "Parallel random numbers: as easy as 1, 2, 3" (SC 2011), section 4.2 and table 2.
//
// A counter-based generator is a pure function of (counter, key): the n-th random value of a stream
// needs no state from the previous n-1 values. pdserve keys every sampling decision by
// (seed, choice, position), so the token drawn for a request never depends on which other requests
// share its batch, on call order, or on which process (prefill or decode worker) draws it.
// Thread-safe: the functions are pure.
#pragma once

#include <array>
#include <cstdint>

namespace pdserve::serving {

using PhiloxCounter = std::array<uint32_t, 4>;
using PhiloxKey = std::array<uint32_t, 2>;

// One Philox-4x32 block with 10 rounds: 128 random bits for `counter` under `key`. Matches the
// Random123 reference (tests/kat_vectors, "philox4x32 10" lines).
PhiloxCounter Philox4x32(PhiloxCounter counter, PhiloxKey key);

// A double uniform in [0, 1) with 53 random bits, from words 0 and 1 of one Philox block.
double PhiloxUniform(PhiloxCounter counter, PhiloxKey key);

}  // namespace pdserve::serving
