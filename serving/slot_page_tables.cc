#include "serving/slot_page_tables.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace pdserve::serving {

absl::StatusOr<std::unique_ptr<SlotPageTables>> SlotPageTables::Create(
    SlotPageTablesOptions options) {
  if (options.slots <= 0 || options.page_entries <= 0 || options.kinds.empty()) {
    return absl::InvalidArgumentError(
        "SlotPageTables: needs slots > 0, page_entries > 0 and at least one kind");
  }
  PagePoolOptions pool_options;
  pool_options.host_memory = false;
  for (const SlotPageKind& k : options.kinds) {
    if (k.rate < 1 || k.entry_capacity < 0 || k.entry_capacity % options.page_entries != 0 ||
        (!options.fixed && k.pool_pages < 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat("SlotPageTables: kind '", k.name, "' needs rate >= 1, an entry capacity ",
                       "that is a multiple of ", options.page_entries, " and pool pages >= 1"));
    }
    pool_options.kinds.push_back({k.name, std::max<int64_t>(k.pool_pages, 1), 1, 4});
  }
  std::unique_ptr<PagePool> pool;
  if (!options.fixed) {
    absl::StatusOr<std::unique_ptr<PagePool>> made = PagePool::Create(std::move(pool_options));
    if (!made.ok()) return made.status();
    pool = std::move(*made);
  }
  return std::unique_ptr<SlotPageTables>(new SlotPageTables(std::move(options), std::move(pool)));
}

SlotPageTables::SlotPageTables(SlotPageTablesOptions options, std::unique_ptr<PagePool> pool)
    : options_(std::move(options)), pool_(std::move(pool)) {
  const auto slots = static_cast<size_t>(options_.slots);
  const size_t kinds = options_.kinds.size();
  handles_.assign(slots, std::vector<std::vector<PageHandle>>(kinds));
  fixed_held_.assign(slots * kinds, 0);
  for (size_t k = 0; k < kinds; ++k) {
    const int64_t width = stride(static_cast<int64_t>(k));
    rows_.emplace_back((slots + 1) * static_cast<size_t>(width), 0);
    if (!options_.fixed) continue;
    for (int64_t s = 0; s < options_.slots; ++s) {
      for (int64_t i = 0; i < width; ++i) {
        rows_[k][static_cast<size_t>(s * width + i)] = static_cast<int32_t>(1 + s * width + i);
      }
    }
  }
  for (size_t s = 0; s < slots; ++s) owners_.push_back(next_owner_++);
  dirty_.assign(slots + 1, 1);
}

int64_t SlotPageTables::stride(int64_t k) const {
  return kind(k).entry_capacity / options_.page_entries;
}

int64_t SlotPageTables::device_pages(int64_t k) const {
  return (options_.fixed ? options_.slots * stride(k) : kind(k).pool_pages) + 1;
}

int64_t SlotPageTables::PagesAt(int64_t k, int64_t position) const {
  const int64_t entries =
      std::min(std::max<int64_t>(position, 0) / kind(k).rate, kind(k).entry_capacity);
  return (entries + options_.page_entries - 1) / options_.page_entries;
}

int64_t SlotPageTables::held(int64_t k, int64_t slot) const {
  if (options_.fixed) return fixed_held_[static_cast<size_t>(slot * num_kinds() + k)];
  return static_cast<int64_t>(handles_[static_cast<size_t>(slot)][static_cast<size_t>(k)].size());
}

int64_t SlotPageTables::pages_free(int64_t k) const {
  if (!options_.fixed) return pool_->pages_free(static_cast<int32_t>(k));
  int64_t used = 0;
  for (int64_t s = 0; s < options_.slots; ++s) used += held(k, s);
  return options_.slots * stride(k) - used;
}

absl::Status SlotPageTables::CheckSlot(int64_t slot) const {
  if (slot >= 0 && slot < options_.slots) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("SlotPageTables: slot ", slot, " outside [0, ", options_.slots, ")"));
}

std::span<const int32_t> SlotPageTables::Row(int64_t k, int64_t slot) const {
  const auto width = static_cast<size_t>(stride(k));
  return std::span<const int32_t>(rows_[static_cast<size_t>(k)])
      .subspan(static_cast<size_t>(slot) * width, width);
}

int32_t* SlotPageTables::MutableRow(int64_t k, int64_t slot) {
  return rows_[static_cast<size_t>(k)].data() + slot * stride(k);
}

bool SlotPageTables::CanGrow(std::span<const std::pair<int64_t, int64_t>> targets) const {
  std::vector<int64_t> want(options_.kinds.size(), 0);
  for (const auto& [slot, position] : targets) {
    if (!CheckSlot(slot).ok()) return false;
    for (int64_t k = 0; k < num_kinds(); ++k) {
      want[static_cast<size_t>(k)] += std::max<int64_t>(0, PagesAt(k, position) - held(k, slot));
    }
  }
  for (int64_t k = 0; k < num_kinds(); ++k) {
    if (want[static_cast<size_t>(k)] > pages_free(k)) return false;
  }
  return true;
}

absl::Status SlotPageTables::Grow(std::span<const std::pair<int64_t, int64_t>> targets) {
  std::vector<char> seen(static_cast<size_t>(options_.slots), 0);
  for (const auto& [slot, position] : targets) {
    if (absl::Status ok = CheckSlot(slot); !ok.ok()) return ok;
    if (seen[static_cast<size_t>(slot)]++) {
      return absl::InvalidArgumentError(absl::StrCat("SlotPageTables: slot ", slot, " repeated"));
    }
  }
  if (!CanGrow(targets)) {
    std::string free;
    for (int64_t k = 0; k < num_kinds(); ++k) {
      absl::StrAppend(&free, k == 0 ? "" : ", ", kind(k).name, " ", pages_free(k));
    }
    return absl::ResourceExhaustedError(absl::StrCat("state page pool exhausted: ", targets.size(),
                                                     " request(s) to grow, free "
                                                     "pages: ",
                                                     free));
  }
  for (const auto& [slot, position] : targets) {
    PageDemand demand(options_.kinds.size(), 0);
    bool any = false;
    for (int64_t k = 0; k < num_kinds(); ++k) {
      demand[static_cast<size_t>(k)] = std::max<int64_t>(0, PagesAt(k, position) - held(k, slot));
      any = any || demand[static_cast<size_t>(k)] > 0;
    }
    if (!any) continue;
    dirty_[static_cast<size_t>(slot)] = 1;
    if (options_.fixed) {
      for (int64_t k = 0; k < num_kinds(); ++k) {
        fixed_held_[static_cast<size_t>(slot * num_kinds() + k)] += demand[static_cast<size_t>(k)];
      }
      continue;
    }
    // Cannot fail after CanGrow on this single-threaded owner of the pool.
    absl::StatusOr<PageTable> table = pool_->Extend(owner(slot), demand);
    if (!table.ok()) return table.status();
    auto& mine = handles_[static_cast<size_t>(slot)];
    for (int64_t k = 0; k < num_kinds(); ++k) {
      const std::vector<PageHandle>& all = table->pages[static_cast<size_t>(k)];
      auto& held_k = mine[static_cast<size_t>(k)];
      int32_t* row = MutableRow(k, slot);
      for (size_t i = held_k.size(); i < all.size(); ++i) {
        held_k.push_back(all[i]);
        row[i] = all[i].page + 1;
      }
    }
  }
  return absl::OkStatus();
}

absl::Status SlotPageTables::Release(int64_t slot) {
  if (absl::Status ok = CheckSlot(slot); !ok.ok()) return ok;
  dirty_[static_cast<size_t>(slot)] = 1;
  if (options_.fixed) {
    for (int64_t k = 0; k < num_kinds(); ++k) {
      fixed_held_[static_cast<size_t>(slot * num_kinds() + k)] = 0;
    }
    owners_[static_cast<size_t>(slot)] = next_owner_++;
    return absl::OkStatus();
  }
  for (int64_t k = 0; k < num_kinds(); ++k) {
    handles_[static_cast<size_t>(slot)][static_cast<size_t>(k)].clear();
    std::fill_n(MutableRow(k, slot), stride(k), 0);
  }
  const RequestId old = owner(slot);
  owners_[static_cast<size_t>(slot)] = next_owner_++;
  // The allocator's own table, so a tampered record (a test fault) cannot block the free.
  absl::StatusOr<PageTable> table = pool_->Table(old);
  if (!table.ok()) return absl::OkStatus();  // held nothing
  return pool_->Free(*table);
}

std::vector<int64_t> SlotPageTables::TakeDirty() {
  std::vector<int64_t> out;
  for (size_t s = 0; s < dirty_.size(); ++s) {
    if (dirty_[s]) out.push_back(static_cast<int64_t>(s));
    dirty_[s] = 0;
  }
  return out;
}

absl::Status SlotPageTables::Verify(int64_t slot) const {
  if (absl::Status ok = CheckSlot(slot); !ok.ok()) return ok;
  if (options_.fixed) return absl::OkStatus();
  for (int64_t k = 0; k < num_kinds(); ++k) {
    const auto& handles = handles_[static_cast<size_t>(slot)][static_cast<size_t>(k)];
    std::span<const int32_t> row = Row(k, slot);
    for (size_t i = 0; i < row.size(); ++i) {
      const int32_t want = i < handles.size() ? handles[i].page + 1 : 0;
      if (row[i] != want) {
        return absl::FailedPreconditionError(
            absl::StrCat("slot ", slot, " ", kind(k).name, " page-table entry ", i,
                         " names device page ", row[i], " where slot's allocation is ", want));
      }
      if (i >= handles.size()) continue;
      if (absl::Status ok = pool_->Check(owner(slot), handles[i]); !ok.ok()) {
        return absl::FailedPreconditionError(
            absl::StrCat("slot ", slot, " ", kind(k).name, " page ", i, ": ", ok.message()));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status SlotPageTables::InjectForeignPageForTest(int64_t victim, int64_t donor) {
  if (absl::Status ok = CheckSlot(victim); !ok.ok()) return ok;
  if (absl::Status ok = CheckSlot(donor); !ok.ok()) return ok;
  if (options_.fixed || victim == donor) {
    return absl::FailedPreconditionError("InjectForeignPageForTest: needs paged mode, two slots");
  }
  for (int64_t k = 0; k < num_kinds(); ++k) {
    auto& mine = handles_[static_cast<size_t>(victim)][static_cast<size_t>(k)];
    const auto& theirs = handles_[static_cast<size_t>(donor)][static_cast<size_t>(k)];
    if (mine.empty() || theirs.empty()) continue;
    mine[0] = theirs[0];
    MutableRow(k, victim)[0] = theirs[0].page + 1;
    dirty_[static_cast<size_t>(victim)] = 1;
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(
      "InjectForeignPageForTest: the two slots hold no page of a common kind");
}

}  // namespace pdserve::serving
