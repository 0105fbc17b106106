// Feeds a prepared corpus's meta.json to load_corpus_info (what `remat train` reads of a
// corpus directory; `remat prepare` reads the same file to decide whether its cache is
// current): the input is meta.json, beside a tokenizer.model and a train.bin and val.bin
// of 8 bytes each, so that the size checks after the parsing run too.
// A finding: anything but a std::runtime_error sentence out of it (a crash, a sanitizer
// report, a hang, runaway memory).
#include <cstdint>
#include <exception>
#include <string>

#include "harness.h"
#include "remat/data.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const remat::fuzz::TempDir dir("corpus-meta");
  const std::string eight(8, '\0');
  const auto* bytes = reinterpret_cast<const uint8_t*>(eight.data());
  const remat::fuzz::TempFile tokenizer(dir.path() + "/tokenizer.model", bytes, eight.size());
  const remat::fuzz::TempFile train(dir.path() + "/train.bin", bytes, eight.size());
  const remat::fuzz::TempFile val(dir.path() + "/val.bin", bytes, eight.size());
  const remat::fuzz::TempFile meta(dir.path() + "/meta.json", data, size);
  try {
    remat::data::load_corpus_info(dir.path());
  } catch (const std::runtime_error&) {
    return 0;
  }
  return 0;
}
