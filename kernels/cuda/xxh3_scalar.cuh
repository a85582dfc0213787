// XXH3-64 with seed 0 and the default secret, one thread, host and device: the function
// libxxhash's XXH3_64bits computes. Written from the public specification (xxHash's
// doc/xxhash_spec.md, "XXH3 Algorithm Description"), not from its code. The page kernel
// (xxh3.cuh) uses the short and medium forms (<= 240 bytes) and the finalization from here; its
// long form is a block-parallel reformulation of Xxh3Long below. The GPU tests compare both with
// libxxhash where xxhash.h is present, else with Xxh3Scalar on the host (which the same tests
// compare with libxxhash on machines that have it).
//
// Reads are little-endian and unaligned-safe (byte by byte when an address is not 8-aligned), so
// any start address works. Compiles as plain C++ too (the host tests include it without nvcc).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace pdserve::kernels::cuda::xxh3 {

inline constexpr uint64_t kPrime32_1 = 0x9E3779B1ull;
inline constexpr uint64_t kPrime32_2 = 0x85EBCA77ull;
inline constexpr uint64_t kPrime32_3 = 0xC2B2AE3Dull;
inline constexpr uint64_t kPrime64_1 = 0x9E3779B185EBCA87ull;
inline constexpr uint64_t kPrime64_2 = 0xC2B2AE3D27D4EB4Full;
inline constexpr uint64_t kPrime64_3 = 0x165667B19E3779F9ull;
inline constexpr uint64_t kPrime64_4 = 0x85EBCA77C2B2AE63ull;
inline constexpr uint64_t kPrime64_5 = 0x27D4EB2F165667C5ull;
inline constexpr uint64_t kPrimeMx1 = 0x165667919E3779F9ull;
inline constexpr uint64_t kPrimeMx2 = 0x9FB21C651E98DF25ull;

inline constexpr int kSecretBytes = 192;
inline constexpr int kStripeBytes = 64;
inline constexpr int kStripesPerBlock = (kSecretBytes - 64) / 8;     // 16
inline constexpr int kBlockBytes = kStripeBytes * kStripesPerBlock;  // 1024
inline constexpr int kMidSizeMax = 240;
// Secret offsets of the long form: the scramble's 64 bytes, the last stripe's, the final merge's.
inline constexpr int kScrambleOffset = kSecretBytes - 64;
inline constexpr int kLastStripeOffset = kSecretBytes - 71;
inline constexpr int kMergeOffset = 11;

// The specification's default secret.
struct alignas(8) Secret {
  uint8_t bytes[kSecretBytes];
};
inline constexpr Secret kDefaultSecret = {{
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
}};

__host__ __device__ inline uint64_t Load64(const uint8_t* p) {
#ifdef __CUDA_ARCH__
  if ((reinterpret_cast<uintptr_t>(p) & 7) == 0) return *reinterpret_cast<const uint64_t*>(p);
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
#else
  uint64_t v;  // little-endian hosts only (x86-64, aarch64)
  std::memcpy(&v, p, sizeof(v));
  return v;
#endif
}

__host__ __device__ inline uint32_t Load32(const uint8_t* p) {
#ifdef __CUDA_ARCH__
  if ((reinterpret_cast<uintptr_t>(p) & 3) == 0) return *reinterpret_cast<const uint32_t*>(p);
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
#else
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
#endif
}

// (a * b) as 128 bits, folded: low half xor high half.
__host__ __device__ inline uint64_t MulFold64(uint64_t a, uint64_t b) {
#ifdef __CUDA_ARCH__
  return (a * b) ^ __umul64hi(a, b);
#else
  __extension__ typedef unsigned __int128 U128;  // GCC / Clang: the full 64 x 64 product
  const U128 m = static_cast<U128>(a) * b;
  return static_cast<uint64_t>(m) ^ static_cast<uint64_t>(m >> 64);
#endif
}

__host__ __device__ inline uint64_t Rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

__host__ __device__ inline uint64_t Bswap64(uint64_t x) {
  uint64_t r = 0;
  for (int i = 0; i < 8; ++i) r = (r << 8) | ((x >> (8 * i)) & 0xFF);
  return r;
}

__host__ __device__ inline uint64_t Avalanche(uint64_t x) {
  x ^= x >> 37;
  x *= kPrimeMx1;
  return x ^ (x >> 32);
}

__host__ __device__ inline uint64_t AvalancheXxh64(uint64_t x) {
  x ^= x >> 33;
  x *= kPrime64_2;
  x ^= x >> 29;
  x *= kPrime64_3;
  return x ^ (x >> 32);
}

// 16 bytes of input against 16 bytes of secret (seed 0).
__host__ __device__ inline uint64_t Mix16(const uint8_t* in, const uint8_t* secret) {
  return MulFold64(Load64(in) ^ Load64(secret), Load64(in + 8) ^ Load64(secret + 8));
}

// Inputs of 0 to 16 bytes.
__host__ __device__ inline uint64_t Xxh3Short(const uint8_t* in, uint64_t len, const uint8_t* s) {
  if (len == 0) return AvalancheXxh64(Load64(s + 56) ^ Load64(s + 64));
  if (len <= 3) {
    const uint32_t combined =
        static_cast<uint32_t>(in[len - 1]) | (static_cast<uint32_t>(len) << 8) |
        (static_cast<uint32_t>(in[0]) << 16) | (static_cast<uint32_t>(in[len >> 1]) << 24);
    return AvalancheXxh64(static_cast<uint64_t>(Load32(s) ^ Load32(s + 4)) ^ combined);
  }
  if (len <= 8) {
    const uint64_t combined =
        static_cast<uint64_t>(Load32(in + len - 4)) | (static_cast<uint64_t>(Load32(in)) << 32);
    uint64_t v = (Load64(s + 8) ^ Load64(s + 16)) ^ combined;
    v ^= Rotl64(v, 49) ^ Rotl64(v, 24);
    v *= kPrimeMx2;
    v ^= (v >> 35) + len;
    v *= kPrimeMx2;
    return v ^ (v >> 28);
  }
  const uint64_t low = (Load64(s + 24) ^ Load64(s + 32)) ^ Load64(in);
  const uint64_t high = (Load64(s + 40) ^ Load64(s + 48)) ^ Load64(in + len - 8);
  return Avalanche(len + Bswap64(low) + high + MulFold64(low, high));
}

// Inputs of 17 to 240 bytes.
__host__ __device__ inline uint64_t Xxh3Medium(const uint8_t* in, uint64_t len, const uint8_t* s) {
  uint64_t acc = len * kPrime64_1;
  if (len <= 128) {
    const int64_t rounds = static_cast<int64_t>((len - 1) >> 5) + 1;
    for (int64_t i = rounds - 1; i >= 0; --i) {
      acc += Mix16(in + 16 * i, s + 32 * i);
      acc += Mix16(in + len - 16 * i - 16, s + 32 * i + 16);
    }
    return Avalanche(acc);
  }
  const uint64_t chunks = len >> 4;
  for (uint64_t i = 0; i < 8; ++i) acc += Mix16(in + 16 * i, s + 16 * i);
  acc = Avalanche(acc);
  for (uint64_t i = 8; i < chunks; ++i) acc += Mix16(in + 16 * i, s + (i - 8) * 16 + 3);
  acc += Mix16(in + len - 16, s + 119);
  return Avalanche(acc);
}

// The long form's accumulators before the first stripe.
__host__ __device__ inline void InitLongAcc(uint64_t (&acc)[8]) {
  acc[0] = kPrime32_3;
  acc[1] = kPrime64_1;
  acc[2] = kPrime64_2;
  acc[3] = kPrime64_3;
  acc[4] = kPrime64_4;
  acc[5] = kPrime32_2;
  acc[6] = kPrime64_5;
  acc[7] = kPrime32_1;
}

// One stripe into the eight accumulators.
__host__ __device__ inline void Accumulate(uint64_t (&acc)[8], const uint8_t* stripe,
                                           const uint8_t* secret) {
  for (int i = 0; i < 8; ++i) {
    const uint64_t word = Load64(stripe + 8 * i);
    const uint64_t v = word ^ Load64(secret + 8 * i);
    acc[i ^ 1] += word;
    acc[i] += (v & 0xFFFFFFFFull) * (v >> 32);
  }
}

// One lane's scramble at the end of a full block.
__host__ __device__ inline uint64_t Scramble(uint64_t acc, uint64_t secret_word) {
  acc ^= acc >> 47;
  acc ^= secret_word;
  return acc * kPrime32_1;
}

__host__ __device__ inline uint64_t FinalMerge(const uint64_t (&acc)[8], uint64_t len,
                                               const uint8_t* s) {
  uint64_t result = len * kPrime64_1;
  for (int i = 0; i < 4; ++i) {
    result += MulFold64(acc[2 * i] ^ Load64(s + kMergeOffset + 16 * i),
                        acc[2 * i + 1] ^ Load64(s + kMergeOffset + 16 * i + 8));
  }
  return Avalanche(result);
}

// Inputs over 240 bytes, one stripe after another (the specification's order).
__host__ __device__ inline uint64_t Xxh3Long(const uint8_t* in, uint64_t len, const uint8_t* s) {
  uint64_t acc[8];
  InitLongAcc(acc);
  const uint64_t full_blocks = (len - 1) / kBlockBytes;
  for (uint64_t b = 0; b < full_blocks; ++b) {
    for (int n = 0; n < kStripesPerBlock; ++n) {
      Accumulate(acc, in + b * kBlockBytes + n * kStripeBytes, s + 8 * n);
    }
    for (int i = 0; i < 8; ++i) acc[i] = Scramble(acc[i], Load64(s + kScrambleOffset + 8 * i));
  }
  const uint64_t last = full_blocks * kBlockBytes;
  const uint64_t last_stripes = (len - last - 1) / kStripeBytes;
  for (uint64_t n = 0; n < last_stripes; ++n) {
    Accumulate(acc, in + last + n * kStripeBytes, s + 8 * n);
  }
  Accumulate(acc, in + len - kStripeBytes, s + kLastStripeOffset);
  return FinalMerge(acc, len, s);
}

// XXH3_64bits(in, len) with the given 192-byte default secret (kDefaultSecret.bytes, or a copy
// of it in the memory space the caller prefers).
__host__ __device__ inline uint64_t Xxh3Scalar(const uint8_t* in, uint64_t len, const uint8_t* s) {
  if (len <= 16) return Xxh3Short(in, len, s);
  if (len <= kMidSizeMax) return Xxh3Medium(in, len, s);
  return Xxh3Long(in, len, s);
}

}  // namespace pdserve::kernels::cuda::xxh3
