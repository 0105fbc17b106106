// Encoding a text's parts on threads: the one pattern behind encoding lines
// (src/data/tokenizer.cpp) and documents (src/data/corpus.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

namespace remat::data {

/// Fills one part's ids and the starts of its units (lines, documents), each start an
/// index into that part's ids.
using EncodePart = std::function<void(size_t part, std::vector<int32_t>& ids, std::vector<int64_t>& starts)>;

/// Runs `encode` for parts 0 to `parts` - 1, each on a thread of its own (part 0 on the
/// caller's), and joins their ids in order; `starts` receives every part's starts, moved
/// to index the joined ids. When parts throw, the first part's exception is rethrown once
/// all have ended.
std::vector<int32_t> encode_parts(size_t parts, const EncodePart& encode, std::vector<int64_t>& starts);

}  // namespace remat::data
