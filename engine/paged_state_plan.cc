#include "engine/paged_state_plan.h"

#include <algorithm>
#include <map>

#include "engine/ring_state.h"

namespace pdserve::engine {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

int64_t PagedStateBytes::Request(int64_t tokens) const {
  int64_t bytes = per_slot;
  for (const auto& [rate, page] : page_bytes) {
    bytes += CeilDiv(tokens / rate, kPagedEntries) * page;
  }
  return bytes;
}

PagedStateBytes GpuPagedStateBytes(const ModelConfig& config) {
  PagedStateBytes out;
  std::map<int64_t, int64_t> pages;
  const RingGeometry g = RingGeometryFor(config, /*max_context=*/kPagedEntries, kPagedEntries);
  for (const RingLayerGeometry& l : g.layers) {
    out.per_slot += l.window * l.head_dim * 2;
    for (const RingCompressorGeometry* c : {&l.compressor, &l.indexer}) {
      if (!c->present()) continue;
      out.per_slot += 2 * (2 * c->rate * c->width()) * 4;
      pages[c->rate] += kPagedEntries * c->dim * 2;
    }
  }
  out.page_bytes.assign(pages.begin(), pages.end());
  return out;
}

int64_t PagedPoolPages(int64_t rate, int64_t slots, int64_t max_context, int64_t state_tokens) {
  const int64_t per_slot = RingEntryCapacity(max_context, rate, kPagedEntries) / kPagedEntries;
  int64_t pool = slots * per_slot;
  if (state_tokens > 0) {
    pool = std::min(pool, CeilDiv(state_tokens / rate, kPagedEntries) + slots);
  }
  return std::max<int64_t>(pool, 1);
}

std::vector<std::pair<int64_t, int64_t>> PagedPoolKinds(const ModelConfig& config, int64_t slots,
                                                        int64_t max_context, int64_t state_tokens) {
  std::vector<std::pair<int64_t, int64_t>> kinds;
  for (const auto& [rate, page] : GpuPagedStateBytes(config).page_bytes) {
    kinds.emplace_back(rate, PagedPoolPages(rate, slots, max_context, state_tokens));
  }
  return kinds;
}

int64_t PagedRequestPages(int64_t rate, int64_t max_context, int64_t tokens) {
  const int64_t capacity = RingEntryCapacity(max_context, rate, kPagedEntries);
  return CeilDiv(std::min(std::max<int64_t>(tokens, 0) / rate, capacity), kPagedEntries);
}

int64_t AdmittedRequests(const ModelConfig& config, int64_t slots, int64_t max_context,
                         int64_t state_tokens, int64_t tokens) {
  if (tokens > max_context || tokens < 1) return 0;
  int64_t admitted = slots;
  for (const auto& [rate, pages] : PagedPoolKinds(config, slots, max_context, state_tokens)) {
    const int64_t need = PagedRequestPages(rate, max_context, tokens);
    if (need > 0) admitted = std::min(admitted, pages / need);
  }
  return admitted;
}

int64_t GpuStatePoolBytes(const ModelConfig& config, int64_t slots, int64_t max_context,
                          int64_t state_tokens, bool paged) {
  const PagedStateBytes b = GpuPagedStateBytes(config);
  int64_t bytes = (slots + 1) * b.per_slot;
  for (const auto& [rate, page] : b.page_bytes) {
    bytes += (PagedPoolPages(rate, slots, max_context, paged ? state_tokens : 0) + 1) * page;
  }
  return bytes;
}

int64_t ConcurrentRequestsThatFit(const ModelConfig& config, int64_t tokens, int64_t max_context,
                                  int64_t budget, bool paged) {
  auto fits = [&](int64_t n) {
    return GpuStatePoolBytes(config, n, max_context, paged ? n * tokens : 0, paged) <= budget;
  };
  if (!fits(1)) return 0;
  int64_t lo = 1;
  int64_t hi = 2;
  while (fits(hi) && hi < (int64_t{1} << 40)) hi *= 2;
  while (hi - lo > 1) {  // fits(lo), !fits(hi)
    const int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

}  // namespace pdserve::engine
