#include "remat/caching_allocator.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <charconv>
#include <istream>
#include <limits>
#include <ostream>
#include <sstream>
#include <string>

namespace remat::memory {

namespace {

// PyTorch's constants (CUDACachingAllocator.cpp).
constexpr int64_t kMinBlockSize = 512;
constexpr int64_t kSmallSize = int64_t{1} << 20;
constexpr int64_t kSmallBuffer = int64_t{2} << 20;
constexpr int64_t kMinLargeAlloc = int64_t{10} << 20;
constexpr int64_t kLargeBuffer = int64_t{20} << 20;
constexpr int64_t kRoundLarge = int64_t{2} << 20;
// PyTorch refuses requests of 1 EiB or more as out of memory; the bound also keeps the
// model's address arithmetic far from overflow.
constexpr int64_t kMaxRequest = int64_t{1} << 60;
// Pages of address space an expandable segment reserves. PyTorch reserves 1 1/8 of the
// device's memory; the model has no device, so it reserves more than any device holds.
constexpr int64_t kExpandablePages = int64_t{1} << 20;
constexpr int64_t kNoBlock = -1;

int64_t round_up(int64_t n, int64_t unit) { return (n + unit - 1) / unit * unit; }

}  // namespace

CachingAllocatorModel::CachingAllocatorModel(AllocatorRules rules) : rules_(rules) {}

void CachingAllocatorModel::malloc(int64_t id, int64_t bytes, int stream) {
  TORCH_CHECK(bytes >= 0, "Allocation ", id, " asks for ", bytes, " bytes: a request cannot be negative.");
  TORCH_CHECK(bytes < kMaxRequest, "Allocation ", id, " asks for ", bytes,
              " bytes: PyTorch refuses 1 EiB or more as out of memory.");
  TORCH_CHECK(!live_.count(id), "Allocation ", id, " is already live: free it before allocating under its id again.");
  if (bytes == 0) {  // PyTorch hands out a null pointer without touching its pools
    live_.emplace(id, kNoBlock);
    return;
  }
  const int64_t size = round_up(std::max(bytes, kMinBlockSize), kMinBlockSize);
  const Pool pool = size <= kSmallSize ? Pool::small : Pool::large;
  std::optional<int64_t> address = best_fit(pool, stream, size);
  if (!address) {
    address = rules_.expandable_segments ? grow_segment(pool, stream, size) : new_segment(pool, stream, size);
  }
  hand_out(*address, size);
  live_.emplace(id, *address);
  note_peaks();
}

void CachingAllocatorModel::free(int64_t id) {
  const auto it = live_.find(id);
  TORCH_CHECK(it != live_.end(), "Free of allocation ", id,
              ", which is not live: it was never allocated or is already freed.");
  const int64_t address = it->second;
  live_.erase(it);
  if (address == kNoBlock) return;
  Block& block = blocks_.at(address);
  allocated_ -= block.size;
  block.state = State::free;
  settle(address);
}

void CachingAllocatorModel::apply(const AllocatorEvent& e) {
  if (e.kind == AllocatorEvent::Kind::malloc) {
    malloc(e.id, e.bytes, e.stream);
  } else {
    free(e.id);
  }
}

void CachingAllocatorModel::empty_cache() {
  // Collected first: releasing and unmapping reshape the free index.
  std::vector<int64_t> free_blocks;
  for (const auto& pool : free_) {
    for (const auto& [stream, size, address] : pool) free_blocks.push_back(address);
  }
  for (int64_t address : free_blocks) {
    if (rules_.expandable_segments) {
      unmap_free_pages(address);
    } else {
      release_if_whole(address);
    }
  }
}

void CachingAllocatorModel::reset_peaks() {
  peak_allocated_ = allocated_;
  peak_reserved_ = reserved_;
}

int64_t CachingAllocatorModel::block_bytes(int64_t id) const {
  const auto it = live_.find(id);
  TORCH_CHECK(it != live_.end(), "Allocation ", id, " is not live, so it has no block.");
  return it->second == kNoBlock ? 0 : blocks_.at(it->second).size;
}

std::optional<int64_t> CachingAllocatorModel::best_fit(Pool pool, int stream, int64_t size) const {
  const auto& blocks = free_[static_cast<int>(pool)];
  auto it = blocks.lower_bound({stream, size, std::numeric_limits<int64_t>::min()});
  if (it == blocks.end() || std::get<0>(*it) != stream) return std::nullopt;
  if (rules_.expandable_segments) {
    // PyTorch ranks a block that borders unmapped space by the size it could grow to, so
    // the free end of a segment is taken only when no free block inside it fits.
    for (auto next = std::next(it); next != blocks.end() && std::get<0>(*next) == stream &&
                                    growable_size(std::get<2>(*next)) < growable_size(std::get<2>(*it));
         ++next) {
      it = next;
    }
  }
  return std::get<2>(*it);
}

int64_t CachingAllocatorModel::new_segment(Pool pool, int stream, int64_t size) {
  const int64_t bytes = pool == Pool::small     ? kSmallBuffer
                        : size < kMinLargeAlloc ? kLargeBuffer
                                                : round_up(size, kRoundLarge);
  const int64_t address = next_address_;
  next_address_ += bytes;
  const Block block{bytes, address, stream, pool, State::free};
  blocks_.emplace(address, block);
  index(address, block);
  reserved_ += bytes;
  return address;
}

int64_t CachingAllocatorModel::grow_segment(Pool pool, int stream, int64_t size) {
  int64_t start = expandable_start(pool, stream, size);
  if (blocks_.at(start).state == State::unmapped) start = map_pages(start, std::min(blocks_.at(start).size, size));
  // The run from `start` alternates free and unmapped ranges (neighbours of one state
  // merge); map the unmapped ones in turn until the free block at `start` holds `size`.
  while (blocks_.at(start).size < size) {
    const auto next = next_in_segment(blocks_.find(start));
    TORCH_INTERNAL_ASSERT(next != blocks_.end() && next->second.state == State::unmapped);
    start = map_pages(next->first, std::min(size - blocks_.at(start).size, next->second.size));
  }
  return start;
}

int64_t CachingAllocatorModel::expandable_start(Pool pool, int stream, int64_t size) {
  // The lowest unmapped range (with the free block before it) from which free and
  // unmapped space holds `size`: normally the end of the stream's one segment, but
  // empty_cache() can leave holes inside it, which PyTorch fills first.
  const auto& unmapped = unmapped_[static_cast<int>(pool)];
  for (auto it = unmapped.lower_bound({stream, std::numeric_limits<int64_t>::min()});
       it != unmapped.end() && it->first == stream; ++it) {
    Blocks::const_iterator start = blocks_.find(it->second);
    const auto prev = prev_in_segment(start);
    if (prev != blocks_.end() && prev->second.state == State::free) start = prev;
    int64_t room = 0;
    for (auto b = start; b != blocks_.end() && room < size && b->second.state != State::allocated;
         b = next_in_segment(b)) {
      room += b->second.size;
    }
    if (room >= size) return start->first;
  }
  const int64_t page = pool == Pool::small ? kSmallBuffer : kLargeBuffer;
  const int64_t address = next_address_;
  next_address_ += page * kExpandablePages;
  const Block block{page * kExpandablePages, address, stream, pool, State::unmapped};
  blocks_.emplace(address, block);
  index(address, block);
  return address;
}

int64_t CachingAllocatorModel::map_pages(int64_t address, int64_t bytes) {
  Block& block = blocks_.at(address);
  unindex(address, block);
  // Unmapped ranges start on a page and span whole pages, so rounding `bytes` up to
  // pages stays inside the range.
  const int64_t mapped = round_up(bytes, block.pool == Pool::small ? kSmallBuffer : kLargeBuffer);
  if (mapped < block.size) {
    Block rest = block;
    rest.size = block.size - mapped;
    blocks_.emplace(address + mapped, rest);
    index(address + mapped, rest);
  }
  block.size = mapped;
  block.state = State::free;
  reserved_ += mapped;
  return settle(address);
}

void CachingAllocatorModel::hand_out(int64_t address, int64_t size) {
  Block& block = blocks_.at(address);
  unindex(address, block);
  const int64_t rest = block.size - size;
  // Splitting a large block only for a sliver would leave unusable fragments; expandable
  // segments split like the small pool because their free ends can grow.
  const bool split =
      (block.pool == Pool::small || rules_.expandable_segments) ? rest >= kMinBlockSize : rest > kSmallSize;
  if (split) {
    Block remainder = block;
    remainder.size = rest;
    block.size = size;
    blocks_.emplace(address + size, remainder);
    index(address + size, remainder);
  }
  block.state = State::allocated;
  allocated_ += block.size;
}

void CachingAllocatorModel::release_if_whole(int64_t address) {
  const auto it = blocks_.find(address);
  if (prev_in_segment(it) != blocks_.end() || next_in_segment(it) != blocks_.end()) return;
  unindex(address, it->second);
  reserved_ -= it->second.size;
  blocks_.erase(it);
}

void CachingAllocatorModel::unmap_free_pages(int64_t address) {
  const Block block = blocks_.at(address);
  const int64_t page = block.pool == Pool::small ? kSmallBuffer : kLargeBuffer;
  const int64_t end = address + block.size;
  const int64_t first_page = block.segment + round_up(address - block.segment, page);
  const int64_t last_page = block.segment + (end - block.segment) / page * page;
  if (first_page >= last_page) return;
  unindex(address, block);
  blocks_.erase(address);
  for (auto [from, to] : {std::pair{address, first_page}, std::pair{last_page, end}}) {
    if (from == to) continue;
    Block part = block;
    part.size = to - from;
    blocks_.emplace(from, part);
    index(from, part);
  }
  Block hole = block;
  hole.size = last_page - first_page;
  hole.state = State::unmapped;
  blocks_.emplace(first_page, hole);
  reserved_ -= hole.size;
  const auto merged = blocks_.find(settle(first_page));
  // A segment unmapped from end to end goes back to the driver whole.
  if (prev_in_segment(merged) == blocks_.end() && next_in_segment(merged) == blocks_.end()) {
    unindex(merged->first, merged->second);
    blocks_.erase(merged);
  }
}

int64_t CachingAllocatorModel::settle(int64_t address) {
  // Merges the block at `address` (not indexed) with its neighbours of the same state and
  // indexes the result; returns its address.
  auto it = blocks_.find(address);
  const State state = it->second.state;
  if (const auto next = next_in_segment(it); next != blocks_.end() && next->second.state == state) {
    unindex(next->first, next->second);
    it->second.size += next->second.size;
    blocks_.erase(next);
  }
  if (const auto prev = prev_in_segment(it); prev != blocks_.end() && prev->second.state == state) {
    unindex(prev->first, prev->second);
    const int64_t size = it->second.size;
    blocks_.erase(it);
    it = blocks_.find(prev->first);
    it->second.size += size;
  }
  index(it->first, it->second);
  return it->first;
}

int64_t CachingAllocatorModel::growable_size(int64_t address) const {
  const auto it = blocks_.find(address);
  const auto next = next_in_segment(it);
  const bool borders_unmapped = next != blocks_.end() && next->second.state == State::unmapped;
  return it->second.size + (borders_unmapped ? next->second.size : 0);
}

CachingAllocatorModel::Blocks::const_iterator CachingAllocatorModel::prev_in_segment(Blocks::const_iterator it) const {
  if (it == blocks_.begin()) return blocks_.end();
  const auto prev = std::prev(it);
  return prev->second.segment == it->second.segment ? prev : blocks_.end();
}

CachingAllocatorModel::Blocks::const_iterator CachingAllocatorModel::next_in_segment(Blocks::const_iterator it) const {
  const auto next = std::next(it);
  return next != blocks_.end() && next->second.segment == it->second.segment ? next : blocks_.end();
}

void CachingAllocatorModel::index(int64_t address, const Block& block) {
  const int pool = static_cast<int>(block.pool);
  if (block.state == State::free) free_[pool].insert({block.stream, block.size, address});
  if (block.state == State::unmapped) unmapped_[pool].insert({block.stream, address});
}

void CachingAllocatorModel::unindex(int64_t address, const Block& block) {
  const int pool = static_cast<int>(block.pool);
  if (block.state == State::free) free_[pool].erase({block.stream, block.size, address});
  if (block.state == State::unmapped) unmapped_[pool].erase({block.stream, address});
}

void CachingAllocatorModel::note_peaks() {
  peak_allocated_ = std::max(peak_allocated_, allocated_);
  peak_reserved_ = std::max(peak_reserved_, reserved_);
}

std::vector<AllocatorState> replay(const std::vector<AllocatorEvent>& events, AllocatorRules rules) {
  CachingAllocatorModel model(rules);
  std::vector<AllocatorState> states;
  states.reserve(events.size());
  for (const AllocatorEvent& e : events) {
    model.apply(e);
    states.push_back(model.state());
  }
  return states;
}

int64_t cublas_workspace_bytes(int sm_major, int sm_minor) {
  // ":4096:2:16:8": two 4 MiB chunks and eight 16 KiB ones.
  const int64_t ampere_and_older = int64_t{4096} * 1024 * 2 + int64_t{16} * 1024 * 8;
  return sm_major >= 9 && sm_major <= 12 ? int64_t{32} << 20 : ampere_and_older;
}

void write_allocation_trace(std::ostream& out, const std::vector<AllocationTraceEntry>& entries) {
  out << "# remat allocation trace: one event a line, then the allocator's bytes after it\n"
      << "# kind id bytes stream allocated reserved\n";
  for (const auto& [e, state] : entries) {
    out << (e.kind == AllocatorEvent::Kind::malloc ? "malloc" : "free") << ' ' << e.id << ' ' << e.bytes << ' '
        << e.stream << ' ' << state.allocated << ' ' << state.reserved << '\n';
  }
}

namespace {

template <typename Int>
Int parse_field(const std::string& text, int line, const char* field) {
  Int value{};
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  TORCH_CHECK(error == std::errc() && end == text.data() + text.size(), "Allocation trace line ", line,
              ": expected an integer for ", field, ", found `", text, "`.");
  return value;
}

}  // namespace

std::vector<AllocationTraceEntry> read_allocation_trace(std::istream& in) {
  std::vector<AllocationTraceEntry> entries;
  std::string text;
  for (int line = 1; std::getline(in, text); ++line) {
    std::istringstream fields_in(text);
    std::vector<std::string> fields;
    for (std::string field; fields_in >> field;) fields.push_back(field);
    if (fields.empty() || fields[0][0] == '#') continue;
    TORCH_CHECK(fields.size() == 6, "Allocation trace line ", line,
                ": expected 6 fields (kind id bytes stream allocated reserved), found ", fields.size(), ".");
    TORCH_CHECK(fields[0] == "malloc" || fields[0] == "free", "Allocation trace line ", line,
                ": expected `malloc` or `free` as the kind, found `", fields[0], "`.");
    AllocationTraceEntry entry;
    AllocatorEvent& e = entry.event;
    e.kind = fields[0] == "malloc" ? AllocatorEvent::Kind::malloc : AllocatorEvent::Kind::free;
    e.id = parse_field<int64_t>(fields[1], line, "the id");
    e.bytes = parse_field<int64_t>(fields[2], line, "the bytes");
    e.stream = parse_field<int>(fields[3], line, "the stream");
    entry.state.allocated = parse_field<int64_t>(fields[4], line, "the allocated bytes");
    entry.state.reserved = parse_field<int64_t>(fields[5], line, "the reserved bytes");
    TORCH_CHECK(e.bytes >= 0, "Allocation trace line ", line, ": expected bytes of 0 or more, found ", e.bytes, ".");
    TORCH_CHECK(e.kind == AllocatorEvent::Kind::malloc || e.bytes == 0, "Allocation trace line ", line,
                ": expected 0 bytes for a free, found ", e.bytes, ".");
    TORCH_CHECK(entry.state.allocated >= 0 && entry.state.reserved >= 0, "Allocation trace line ", line,
                ": expected allocated and reserved bytes of 0 or more, found ", entry.state.allocated, " and ",
                entry.state.reserved, ".");
    entries.push_back(entry);
  }
  return entries;
}

}  // namespace remat::memory
