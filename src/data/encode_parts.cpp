#include "data/encode_parts.h"

#include <exception>
#include <thread>

namespace remat::data {

std::vector<int32_t> encode_parts(size_t parts, const EncodePart& encode, std::vector<int64_t>& starts) {
  std::vector<std::vector<int32_t>> ids(parts);
  std::vector<std::vector<int64_t>> part_starts(parts);
  std::vector<std::exception_ptr> errors(parts);
  const auto work = [&](size_t part) {
    try {
      encode(part, ids[part], part_starts[part]);
    } catch (...) {
      errors[part] = std::current_exception();
    }
  };
  std::vector<std::thread> pool;
  for (size_t part = 1; part < parts; ++part) pool.emplace_back(work, part);
  if (parts > 0) work(0);
  for (auto& t : pool) t.join();
  for (const auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  std::vector<int32_t> all;
  starts.clear();
  for (size_t part = 0; part < parts; ++part) {
    const auto offset = static_cast<int64_t>(all.size());
    for (int64_t s : part_starts[part]) starts.push_back(offset + s);
    all.insert(all.end(), ids[part].begin(), ids[part].end());
  }
  return all;
}

}  // namespace remat::data
