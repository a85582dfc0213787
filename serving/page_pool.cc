#include "serving/page_pool.h"

#include <cstring>
#include <limits>
#include <new>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace pdserve::serving {
namespace {

constexpr std::align_val_t kPageAlignment{64};

std::string HandleName(const PageKind& kind, PageHandle handle) {
  return absl::StrFormat("%s page %d (epoch %d)", kind.name, handle.page, handle.epoch);
}

}  // namespace

void PagePool::AlignedDelete::operator()(std::byte* bytes) const {
  if (owned) ::operator delete[](bytes, kPageAlignment);
}

size_t PagePool::HostBytesNeeded(const PagePoolOptions& options) {
  if (!options.host_memory) return 0;
  constexpr size_t kAlign = static_cast<size_t>(kPageAlignment);
  size_t total = 0;
  for (const PageKind& spec : options.kinds) {
    if (spec.num_pages <= 0 || spec.rows_per_page <= 0 || spec.row_bytes <= 0 ||
        spec.rows_per_page > std::numeric_limits<int64_t>::max() / spec.row_bytes ||
        spec.page_bytes() > std::numeric_limits<int64_t>::max() / 2 / spec.num_pages) {
      continue;
    }
    const auto bytes = static_cast<size_t>(spec.page_bytes() * spec.num_pages);
    total += (bytes + kAlign - 1) / kAlign * kAlign;
  }
  return total;
}

absl::StatusOr<std::unique_ptr<PagePool>> PagePool::Create(PagePoolOptions options) {
  if (options.kinds.empty()) return absl::InvalidArgumentError("page pool has no page kinds");
  absl::flat_hash_set<std::string> names;
  std::vector<Kind> kinds;
  const bool external = !options.host_block.empty() && options.host_memory;
  if (external && (reinterpret_cast<uintptr_t>(options.host_block.data()) %
                           static_cast<size_t>(kPageAlignment) !=
                       0 ||
                   options.host_block.size() < HostBytesNeeded(options))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "page pool: the host block of ", options.host_block.size(),
        " bytes is unaligned or under the ", HostBytesNeeded(options), " its kinds need"));
  }
  size_t carved = 0;
  for (PageKind& spec : options.kinds) {
    if (spec.name.empty()) return absl::InvalidArgumentError("page kind has an empty name");
    if (!names.insert(spec.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("page kind '", spec.name, "' is repeated"));
    }
    if (spec.num_pages <= 0 || spec.rows_per_page <= 0 || spec.row_bytes <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "page kind '", spec.name, "' needs positive num_pages, rows_per_page and row_bytes, got ",
          spec.num_pages, ", ", spec.rows_per_page, ", ", spec.row_bytes));
    }
    if (spec.row_bytes % 4 != 0) {
      return absl::InvalidArgumentError(absl::StrCat("page kind '", spec.name, "' row_bytes ",
                                                     spec.row_bytes, " is not a multiple of 4"));
    }
    if (spec.num_pages > std::numeric_limits<int32_t>::max() ||
        spec.rows_per_page > std::numeric_limits<int64_t>::max() / spec.row_bytes ||
        spec.page_bytes() > std::numeric_limits<int64_t>::max() / spec.num_pages) {
      return absl::InvalidArgumentError(
          absl::StrCat("page kind '", spec.name, "' is too large to address"));
    }
    const auto bytes =
        options.host_memory ? static_cast<size_t>(spec.page_bytes() * spec.num_pages) : 0;
    std::byte* memory = nullptr;
    if (external) {
      memory = options.host_block.data() + carved;
      const size_t align = static_cast<size_t>(kPageAlignment);
      carved += (bytes + align - 1) / align * align;
    } else if (options.host_memory) {
      memory = static_cast<std::byte*>(::operator new[](bytes, kPageAlignment, std::nothrow));
    }
    if (options.host_memory && memory == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot allocate ", bytes, " bytes for page kind '", spec.name, "'"));
    }
    Kind kind{
        std::move(spec),
        std::unique_ptr<std::byte[], AlignedDelete>(memory, AlignedDelete{.owned = !external}),
        {},
        {}};
    kind.pages.resize(static_cast<size_t>(kind.spec.num_pages));
    for (int32_t page = 0; page < kind.spec.num_pages; ++page) kind.free_list.push_back(page);
    kinds.push_back(std::move(kind));
  }
  const bool poison = options.poison_freed && options.host_memory;
  auto pool =
      std::unique_ptr<PagePool>(new PagePool(std::move(kinds), poison, options.host_memory));
  if (pool->poison_freed_) {
    for (const Kind& kind : pool->kinds_) {
      for (int32_t page = 0; page < kind.spec.num_pages; ++page) pool->Poison(kind, page);
    }
  }
  return pool;
}

PagePool::PagePool(std::vector<Kind> kinds, bool poison_freed, bool host_memory)
    : poison_freed_(poison_freed), host_memory_(host_memory), kinds_(std::move(kinds)) {}

std::vector<std::span<std::byte>> PagePool::HostBlocks() const {
  std::vector<std::span<std::byte>> blocks;
  if (!host_memory_) return blocks;
  for (const Kind& kind : kinds_) {
    blocks.push_back(
        {kind.memory.get(), static_cast<size_t>(kind.spec.page_bytes() * kind.spec.num_pages)});
  }
  return blocks;
}

std::byte* PagePool::PageBytes(const Kind& kind, int32_t page) const {
  return kind.memory.get() +
         static_cast<size_t>(page) * static_cast<size_t>(kind.spec.page_bytes());
}

void PagePool::Poison(const Kind& kind, int32_t page) const {
  std::byte* bytes = PageBytes(kind, page);
  const auto words = static_cast<size_t>(kind.spec.page_bytes()) / sizeof(kPoisonWord);
  for (size_t i = 0; i < words; ++i) {
    std::memcpy(bytes + i * sizeof(kPoisonWord), &kPoisonWord, sizeof(kPoisonWord));
  }
}

bool PagePool::CanAllocate(const PageDemand& demand) const {
  absl::ReaderMutexLock lock(&mutex_);
  if (demand.size() != kinds_.size()) return false;
  for (size_t k = 0; k < kinds_.size(); ++k) {
    if (demand[k] < 0 || demand[k] > static_cast<int64_t>(kinds_[k].free_list.size())) {
      return false;
    }
  }
  return true;
}

absl::StatusOr<PageTable> PagePool::Allocate(RequestId owner, const PageDemand& demand) {
  return Take(owner, demand, /*grow=*/false);
}

absl::StatusOr<PageTable> PagePool::Extend(RequestId owner, const PageDemand& demand) {
  return Take(owner, demand, /*grow=*/true);
}

absl::StatusOr<PageTable> PagePool::Take(RequestId owner, const PageDemand& demand, bool grow) {
  absl::MutexLock lock(&mutex_);
  if (demand.size() != kinds_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("page demand names ", demand.size(), " kinds, the pool has ", kinds_.size()));
  }
  for (size_t k = 0; k < kinds_.size(); ++k) {
    if (demand[k] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("negative demand ", demand[k],
                                                     " for page kind '", kinds_[k].spec.name, "'"));
    }
    if (demand[k] > static_cast<int64_t>(kinds_[k].free_list.size())) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "request ", owner, " needs ", demand[k], " pages of kind '", kinds_[k].spec.name, "', ",
          kinds_[k].free_list.size(), " of ", kinds_[k].spec.num_pages, " are free"));
    }
  }
  if (!grow && tables_.contains(owner)) {
    return absl::AlreadyExistsError(absl::StrCat("request ", owner, " already holds pages"));
  }
  PageTable& table = tables_[owner];
  table.owner = owner;
  table.pages.resize(kinds_.size());
  for (size_t k = 0; k < kinds_.size(); ++k) {
    Kind& kind = kinds_[k];
    for (int64_t i = 0; i < demand[k]; ++i) {
      const int32_t page = kind.free_list.front();
      kind.free_list.pop_front();
      kind.pages[page] = Page{owner, next_epoch_++};
      table.pages[k].push_back({static_cast<int32_t>(k), page, kind.pages[page].epoch});
    }
  }
  return table;
}

absl::Status PagePool::Free(const PageTable& table) {
  absl::MutexLock lock(&mutex_);
  if (table.pages.size() != kinds_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("page table names ", table.pages.size(),
                                                   " kinds, the pool has ", kinds_.size()));
  }
  for (const auto& handles : table.pages) {
    for (const PageHandle& handle : handles) {
      if (absl::Status status = CheckLocked(table.owner, handle, "double free"); !status.ok()) {
        return status;
      }
    }
  }
  auto it = tables_.find(table.owner);
  if (it == tables_.end() || !(it->second == table)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "free of request ", table.owner, " with a table that is not its current page table"));
  }
  for (const auto& handles : table.pages) {
    for (const PageHandle& handle : handles) {
      Kind& kind = kinds_[handle.kind];
      kind.pages[handle.page] = Page{std::nullopt, next_epoch_++};
      if (poison_freed_) Poison(kind, handle.page);
      kind.free_list.push_back(handle.page);
    }
  }
  tables_.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<PageTable> PagePool::Table(RequestId owner) const {
  absl::ReaderMutexLock lock(&mutex_);
  auto it = tables_.find(owner);
  if (it == tables_.end()) {
    return absl::NotFoundError(absl::StrCat("request ", owner, " holds no pages"));
  }
  return it->second;
}

absl::Status PagePool::Check(RequestId owner, PageHandle handle) const {
  absl::ReaderMutexLock lock(&mutex_);
  return CheckLocked(owner, handle, "use after free");
}

absl::Status PagePool::CheckLocked(RequestId owner, PageHandle handle,
                                   const char* violation) const {
  if (handle.kind < 0 || handle.kind >= static_cast<int32_t>(kinds_.size())) {
    return absl::OutOfRangeError(absl::StrCat("page kind ", handle.kind, " does not exist"));
  }
  const Kind& kind = kinds_[handle.kind];
  if (handle.page < 0 || handle.page >= kind.spec.num_pages) {
    return absl::OutOfRangeError(
        absl::StrCat("page ", handle.page, " of kind '", kind.spec.name, "' does not exist"));
  }
  const Page& page = kind.pages[handle.page];
  if (page.epoch == handle.epoch && page.owner == owner) return absl::OkStatus();
  const std::string now =
      page.owner ? absl::StrCat("owned by request ", *page.owner) : std::string("free");
  return absl::FailedPreconditionError(
      absl::StrCat(violation, ": request ", owner, " holds stale ", HandleName(kind.spec, handle),
                   "; the page is now ", now, " at epoch ", page.epoch));
}

absl::StatusOr<std::span<std::byte>> PagePool::Data(RequestId owner, PageHandle handle) {
  absl::ReaderMutexLock lock(&mutex_);
  if (absl::Status status = CheckLocked(owner, handle, "use after free"); !status.ok()) {
    return status;
  }
  if (!host_memory_) {
    return absl::FailedPreconditionError("page pool keeps no host bytes (host_memory false)");
  }
  const Kind& kind = kinds_[handle.kind];
  return std::span<std::byte>(PageBytes(kind, handle.page),
                              static_cast<size_t>(kind.spec.page_bytes()));
}

int64_t PagePool::pages_free(int32_t kind) const {
  absl::ReaderMutexLock lock(&mutex_);
  return static_cast<int64_t>(kinds_[kind].free_list.size());
}

int64_t PagePool::num_owners() const {
  absl::ReaderMutexLock lock(&mutex_);
  return static_cast<int64_t>(tables_.size());
}

}  // namespace pdserve::serving
