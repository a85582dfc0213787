#include "engine/config.h"

namespace pdserve::engine {

const char* LayerTypeName(LayerType t) {
  switch (t) {
    case LayerType::kSlidingAttention:
      return "sliding_attention";
    case LayerType::kCompressedSparseAttention:
      return "compressed_sparse_attention";
    case LayerType::kHeavilyCompressedAttention:
      return "heavily_compressed_attention";
  }
  return "unknown";
}

}  // namespace pdserve::engine
