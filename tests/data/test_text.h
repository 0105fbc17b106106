// Small deterministic English-like text for data tests: fast to train on, varied enough
// for a few hundred BPE pieces.
#pragma once

#include <cstdint>
#include <string>

namespace remat::testing {

/// `lines` lines of 6-14 words drawn from a fixed word list by a fixed LCG.
inline std::string make_text(int lines, uint64_t seed = 1) {
  static const char* const words[] = {
      "the",  "and",     "of",      "to",       "in",       "that",       "shall",    "he",       "unto",     "for",
      "his",  "a",       "they",    "be",       "is",       "him",        "not",      "them",     "with",     "all",
      "thou", "thy",     "was",     "which",    "king",     "people",     "house",    "children", "land",     "said",
      "came", "went",    "before",  "upon",     "against",  "according",  "gathered", "brought",  "mountain", "river",
      "city", "morning", "evening", "servants", "brethren", "wilderness", "covenant", "garden",   "water",    "bread",
      "fire", "stone",   "silver",  "golden",   "twelve",   "forty",      "seven"};
  constexpr uint64_t num_words = sizeof(words) / sizeof(words[0]);
  uint64_t state = seed * 6364136223846793005ULL + 1442695040888963407ULL;
  auto next = [&state](uint64_t n) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (state >> 33) % n;
  };
  std::string text;
  for (int line = 0; line < lines; ++line) {
    const uint64_t count = 6 + next(9);
    for (uint64_t w = 0; w < count; ++w) {
      std::string word = words[next(num_words)];
      if (w == 0) word[0] = static_cast<char>(word[0] - 'a' + 'A');
      text += word;
      if (w + 1 < count) text += next(6) == 0 ? ", " : " ";
    }
    text += next(4) == 0 ? ";\n" : ".\n";
  }
  return text;
}

}  // namespace remat::testing
