#include "data/byte_level_bpe.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <fmt/format.h>
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <nlohmann/json.hpp>
#include <optional>
#include <queue>
#include <stdexcept>
#include <unordered_map>

#include "util/utf8.h"

namespace remat::data {

namespace {

using nlohmann::json;

// GPT-2's pre-tokenizer expression, which a ByteLevel pre-tokenizer with use_regex applies.
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
// How the begin and end of text are spelled where no tokenizer_config.json says.
constexpr std::array<const char*, 2> kBosNames = {"<|begin_of_text|>", "<|endoftext|>"};
constexpr std::array<const char*, 2> kEosNames = {"<|end_of_text|>", "<|endoftext|>"};

// The UTF-8 of `c`, below U+0800 (as the table's characters are).
std::string utf8_of(char32_t c) {
  if (c < 0x80) return std::string(1, static_cast<char>(c));
  return {static_cast<char>(0xC0 | (c >> 6)), static_cast<char>(0x80 | (c & 0x3F))};
}

// GPT-2's byte-to-character table: the printable Latin-1 bytes stand for themselves, the
// others for U+0100 on, in byte order, so that every byte is a visible character.
struct ByteChars {
  std::array<std::string, 256> of_byte;
  std::unordered_map<std::string, unsigned char> to_byte;
  ByteChars() {
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      of_byte[static_cast<size_t>(b)] = utf8_of(printable ? static_cast<char32_t>(b) : next++);
      to_byte.emplace(of_byte[static_cast<size_t>(b)], static_cast<unsigned char>(b));
    }
  }
};

const ByteChars& byte_chars() {
  static const ByteChars table;
  return table;
}

// A regular expression compiled once (JIT where PCRE2 has it), matched by any thread.
class Regex {
 public:
  Regex(const std::string& pattern, const std::string& path) {
    int error = 0;
    PCRE2_SIZE offset = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP, &error,
                          &offset, nullptr);
    if (code_ == nullptr) {
      throw std::runtime_error(
          fmt::format("The tokenizer {} has a regular expression that PCRE2 cannot compile ({} "
                      "at offset {}): {}.",
                      util::printable(path), message(error), offset, util::printable(pattern)));
    }
    jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Calls piece(begin, end) for every match and every gap between them, in order, as a
  // Split with the isolated behaviour does; empty matches make no piece.
  template <class Piece>
  void split(std::string_view text, size_t base, Piece&& piece) const {
    const std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> data(
        pcre2_match_data_create_from_pattern(code_, nullptr), &pcre2_match_data_free);
    const std::unique_ptr<pcre2_match_context, decltype(&pcre2_match_context_free)> context(
        pcre2_match_context_create(nullptr), &pcre2_match_context_free);
    // A whitespace run of a megabyte backtracks deeper than the JIT's default 32 KiB stack.
    const std::unique_ptr<pcre2_jit_stack, decltype(&pcre2_jit_stack_free)> stack(
        jit_ ? pcre2_jit_stack_create(32 << 10, 64 << 20, nullptr) : nullptr, &pcre2_jit_stack_free);
    if (!data || !context || (jit_ && !stack)) throw std::bad_alloc();
    if (stack) pcre2_jit_stack_assign(context.get(), nullptr, stack.get());
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    size_t from = 0, done = 0;
    while (from < text.size()) {
      const int rc = pcre2_match(code_, subject, text.size(), from, PCRE2_NO_UTF_CHECK, data.get(), context.get());
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        throw std::runtime_error(fmt::format(
            "The tokenizer's regular expression failed on the text at byte {}: {}; break that part of the text up, "
            "or use a tokenizer with a simpler expression.",
            base + from, message(rc)));
      }
      const PCRE2_SIZE* span = pcre2_get_ovector_pointer(data.get());
      if (span[1] == span[0]) {  // step over one character
        from = span[0] + 1;
        while (from < text.size() && (static_cast<unsigned char>(text[from]) & 0xC0) == 0x80) ++from;
        continue;
      }
      if (span[0] > done) piece(done, span[0]);
      piece(span[0], span[1]);
      done = from = span[1];
    }
    if (done < text.size()) piece(done, text.size());
  }

 private:
  static std::string message(int code) {
    std::array<PCRE2_UCHAR, 256> buffer{};
    pcre2_get_error_message(code, buffer.data(), buffer.size());
    return reinterpret_cast<const char*>(buffer.data());
  }
  pcre2_code* code_ = nullptr;
  bool jit_ = false;
};

struct AddedToken {
  std::string content;
  int32_t id = 0;
};

// Added tokens matched leftmost-longest, found by their first byte.
class AddedSet {
 public:
  void add(AddedToken token) { tokens_.push_back(std::move(token)); }
  void index() {
    std::stable_sort(tokens_.begin(), tokens_.end(),
                     [](const AddedToken& a, const AddedToken& b) { return a.content.size() > b.content.size(); });
    for (size_t k = 0; k < tokens_.size(); ++k) {
      by_first_[static_cast<unsigned char>(tokens_[k].content[0])].push_back(k);
    }
  }
  bool empty() const { return tokens_.empty(); }
  // The leftmost match in text[from, end), longest there: its offset and token, or none.
  std::optional<std::pair<size_t, const AddedToken*>> find(std::string_view text, size_t from, size_t end) const {
    for (size_t i = from; i < end; ++i) {
      for (size_t k : by_first_[static_cast<unsigned char>(text[i])]) {
        const std::string& c = tokens_[k].content;
        if (c.size() <= end - i && text.compare(i, c.size(), c) == 0) return std::make_pair(i, &tokens_[k]);
      }
    }
    return std::nullopt;
  }

 private:
  std::vector<AddedToken> tokens_;
  std::array<std::vector<size_t>, 256> by_first_;
};

struct Merge {
  int32_t rank = 0;
  int32_t id = 0;
};

uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

}  // namespace

struct ByteLevelBpe::Impl {
  std::unordered_map<std::string, int32_t> vocab;  // the model's, byte-level text -> id
  std::unordered_map<std::string, int32_t> added_ids;
  std::unordered_map<uint64_t, Merge> merges;
  std::array<int32_t, 256> byte_id{};
  bool ignore_merges = false;
  std::optional<Regex> split;                // a Split's expression, else ByteLevel's own
  std::optional<std::string> split_literal;  // a Split on a string
  AddedSet raw_added, normalized_added;      // matched before and after normalisation
  std::vector<std::string> bytes;            // what each id decodes to

  void read_layout(const nlohmann::json& root, const std::string& path);
  void read_split(const nlohmann::json& step, const std::string& path);
  std::vector<std::string> read_vocab(const nlohmann::json& root, const std::string& path);
  void read_merges(const nlohmann::json& root, const std::string& path);
  void read_decoding(const std::vector<std::string>& tokens);

  void pre_tokenize(std::string_view text, size_t base, std::vector<int32_t>& ids, std::vector<int64_t>* starts,
                    std::unordered_map<std::string, std::vector<int32_t>>& cache) const;
  void encode_word(std::string_view word, size_t base, std::vector<int32_t>& ids, std::vector<int64_t>* starts,
                   std::unordered_map<std::string, std::vector<int32_t>>& cache) const;
  std::vector<int32_t> merge(std::string_view word) const;
};

namespace {

[[noreturn]] void refuse(const std::string& path, const std::string& what) {
  throw std::runtime_error(fmt::format("The tokenizer {} {}.", util::printable(path), what));
}

const json& member(const json& object, const char* key, const std::string& path) {
  if (!object.is_object() || !object.contains(key)) refuse(path, fmt::format("lacks \"{}\"", key));
  return object.at(key);
}

// A ByteLevel pre-tokenizer's settings that remat follows: no prefix space.
bool byte_level_regex(const json& pre, const std::string& path) {
  if (pre.value("add_prefix_space", false)) {
    refuse(path,
           "adds a prefix space before the text; remat reads byte-level tokenizers without one, as GPT-2's "
           "and Llama 3's are");
  }
  return pre.value("use_regex", true);
}

// The token `value` names in tokenizer_config.json: a string, or an object with "content".
std::optional<std::string> config_token(const json& config, const char* key) {
  if (!config.is_object() || !config.contains(key)) return std::nullopt;
  const json& value = config.at(key);
  if (value.is_string()) return value.get<std::string>();
  if (value.is_object() && value.contains("content") && value.at("content").is_string()) {
    return value.at("content").get<std::string>();
  }
  return std::nullopt;
}

// The id of the token tokenizer_config.json names as `key`, else of the first of `names`
// the tokenizer has, else -1.
int special_id(const ByteLevelBpe& bpe, const json& config, const char* key, const std::array<const char*, 2>& names,
               const std::string& path) {
  if (const auto named = config_token(config, key)) {
    const int id = bpe.token_to_id(*named);
    if (id < 0) {
      refuse(path,
             fmt::format("has no token {}, which its tokenizer_config.json names as {}", util::printable(*named), key));
    }
    return id;
  }
  for (const char* name : names) {
    if (bpe.token_to_id(name) >= 0) return bpe.token_to_id(name);
  }
  return -1;
}

}  // namespace

ByteLevelBpe::ByteLevelBpe(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ByteLevelBpe::~ByteLevelBpe() = default;

void ByteLevelBpe::Impl::read_layout(const json& root, const std::string& path) {
  const json& model = member(root, "model", path);
  if (model.value("type", std::string("BPE")) != "BPE") {
    refuse(path, fmt::format("is a {} model; remat reads BPE tokenizers (byte-level, as GPT-2's and Llama 3's) and "
                             "SentencePiece models (tokenizer.model)",
                             util::printable(model.at("type").dump())));
  }
  for (const char* unsupported : {"dropout", "continuing_subword_prefix", "end_of_word_suffix", "unk_token"}) {
    if (model.contains(unsupported) && !model.at(unsupported).is_null()) {
      refuse(path, fmt::format("sets the BPE model's {}, which byte-level BPE as remat reads it has not", unsupported));
    }
  }
  if (model.value("byte_fallback", false)) {
    refuse(path, "uses byte fallback (a SentencePiece-style BPE); give that model's tokenizer.model instead");
  }
  ignore_merges = model.value("ignore_merges", false);
  if (root.contains("normalizer") && !root.at("normalizer").is_null()) {
    refuse(path,
           "normalises its text first; remat reads byte-level tokenizers without a normalizer, as GPT-2's "
           "and Llama 3's are");
  }
  const json& decoder = member(root, "decoder", path);
  if (!decoder.is_object() || decoder.value("type", "") != "ByteLevel") {
    refuse(path, "decodes other than ByteLevel; remat reads byte-level tokenizers");
  }
  const json& pre = member(root, "pre_tokenizer", path);
  const std::string type = pre.is_object() ? pre.value("type", "") : "";
  const json* steps = pre.is_object() && pre.contains("pretokenizers") ? &pre.at("pretokenizers") : nullptr;
  if (type == "ByteLevel") {
    if (!byte_level_regex(pre, path)) refuse(path, "has a ByteLevel pre-tokenizer without a regular expression alone");
    split.emplace(kGpt2Pattern, path);
  } else if (type == "Sequence" && steps->is_array() && steps->size() == 2 &&
             (*steps)[0].value("type", "") == "Split" && (*steps)[1].value("type", "") == "ByteLevel") {
    if (byte_level_regex((*steps)[1], path)) {
      refuse(path, "splits its text twice (a Split, then ByteLevel's own expression); remat reads one split");
    }
    read_split((*steps)[0], path);
  } else {
    refuse(path, fmt::format("has a {} pre-tokenizer; remat reads ByteLevel (GPT-2's) or a Split then ByteLevel "
                             "(Llama 3's)",
                             util::printable(type.empty() ? pre.dump() : type)));
  }
}

void ByteLevelBpe::Impl::read_split(const json& step, const std::string& path) {
  if (step.value("behavior", "") != "Isolated" || step.value("invert", false)) {
    refuse(path, "has a Split pre-tokenizer other than isolated, not inverted; remat reads that one (Llama 3's)");
  }
  const json& spec = member(step, "pattern", path);
  if (spec.contains("Regex") && spec.at("Regex").is_string()) {
    split.emplace(spec.at("Regex").get<std::string>(), path);
  } else if (spec.contains("String") && spec.at("String").is_string() && !spec.at("String").empty()) {
    split_literal = spec.at("String").get<std::string>();
  } else {
    refuse(path, "has a Split pattern that is neither a regular expression nor a non-empty string");
  }
}

std::vector<std::string> ByteLevelBpe::Impl::read_vocab(const json& root, const std::string& path) {
  const json& vocab_json = member(member(root, "model", path), "vocab", path);
  if (!vocab_json.is_object() || vocab_json.empty()) refuse(path, "has no vocabulary");
  const json no_added = json::array();
  const json& added = root.contains("added_tokens") ? root.at("added_tokens") : no_added;
  if (!added.is_array()) refuse(path, "has added tokens that are not a list");
  // Ids run from 0 to below the number of tokens listed, each one token's.
  const auto listed = static_cast<int64_t>(vocab_json.size() + added.size());
  std::vector<std::string> tokens;
  auto place = [&](const std::string& token, const json& id_value) {
    if (!id_value.is_number_integer() || id_value.get<int64_t>() < 0 || id_value.get<int64_t>() >= listed) {
      refuse(path, fmt::format("gives the token {} the id {}, not one from 0 to {} (below the tokens it lists)",
                               util::printable(token), util::printable(id_value.dump()), listed - 1));
    }
    const auto id = static_cast<size_t>(id_value.get<int64_t>());
    if (id >= tokens.size()) tokens.resize(id + 1);
    if (!tokens[id].empty() && tokens[id] != token) refuse(path, fmt::format("gives the id {} to two tokens", id));
    tokens[id] = token;
    return static_cast<int32_t>(id);
  };
  for (const auto& [token, id_value] : vocab_json.items()) vocab.emplace(token, place(token, id_value));
  for (const json& t : added) {
    const json& content = member(t, "content", path);
    if (!content.is_string() || content.empty()) refuse(path, "has an added token without text");
    const std::string c = content.get<std::string>();
    for (const char* flag : {"single_word", "lstrip", "rstrip"}) {
      if (t.value(flag, false)) {
        refuse(path,
               fmt::format("has the added token {} with {} set, which remat does not read", util::printable(c), flag));
      }
    }
    const int32_t id = place(c, member(t, "id", path));
    added_ids.emplace(c, id);
    // `tokenizers` matches special tokens before normalisation by default, others after.
    (t.value("normalized", !t.value("special", false)) ? normalized_added : raw_added).add({c, id});
  }
  raw_added.index();
  normalized_added.index();
  return tokens;
}

void ByteLevelBpe::Impl::read_merges(const json& root, const std::string& path) {
  const ByteChars& chars = byte_chars();
  for (size_t b = 0; b < 256; ++b) {
    const auto it = vocab.find(chars.of_byte[b]);
    if (it == vocab.end()) {
      refuse(path,
             fmt::format("lacks the byte-level character of byte 0x{:02X}, so some text would have no tokens", b));
    }
    byte_id[b] = it->second;
  }
  const json& list = member(member(root, "model", path), "merges", path);
  if (!list.is_array()) refuse(path, "has merges that are not a list");
  int32_t rank = 0;
  for (const json& m : list) {
    std::string a, b;
    if (m.is_string() && m.get<std::string>().find(' ') != std::string::npos) {
      const std::string both = m.get<std::string>();
      a = both.substr(0, both.find(' '));
      b = both.substr(both.find(' ') + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      a = m[0].get<std::string>();
      b = m[1].get<std::string>();
    } else {
      refuse(path,
             fmt::format("has merge {} as {}, neither \"a b\" nor [\"a\", \"b\"]", rank, util::printable(m.dump())));
    }
    const auto left = vocab.find(a), right = vocab.find(b), joined = vocab.find(a + b);
    if (left == vocab.end() || right == vocab.end() || joined == vocab.end()) {
      refuse(path, fmt::format("has merge {} ({} + {}) of tokens not all in its vocabulary", rank, util::printable(a),
                               util::printable(b)));
    }
    // A pair listed twice keeps its first (best) rank.
    merges.emplace(pair_key(left->second, right->second), Merge{rank, joined->second});
    ++rank;
  }
}

void ByteLevelBpe::Impl::read_decoding(const std::vector<std::string>& tokens) {
  // A token's characters' bytes, or its own UTF-8 where one of them is not a byte-level
  // character (an added token's), as `tokenizers`' ByteLevel decoder does.
  const ByteChars& chars = byte_chars();
  bytes.resize(tokens.size());
  for (size_t id = 0; id < tokens.size(); ++id) {
    std::string out;
    bool all_bytes = true;
    for (size_t i = 0; i < tokens[id].size() && all_bytes;) {
      size_t n = 1;
      while (i + n < tokens[id].size() && (static_cast<unsigned char>(tokens[id][i + n]) & 0xC0) == 0x80) ++n;
      const auto it = chars.to_byte.find(tokens[id].substr(i, n));
      all_bytes = it != chars.to_byte.end();
      if (all_bytes) out += static_cast<char>(it->second);
      i += n;
    }
    bytes[id] = all_bytes ? out : tokens[id];
  }
}

std::shared_ptr<const ByteLevelBpe> ByteLevelBpe::parse(std::string_view text, std::string_view config_text,
                                                        const std::string& path) {
  json root, config;
  try {
    root = json::parse(text);
  } catch (const json::exception& e) {
    refuse(path, fmt::format("is not valid JSON ({})", e.what()));
  }
  try {
    if (!config_text.empty()) config = json::parse(config_text);
  } catch (const json::exception& e) {
    refuse(path, fmt::format("has a tokenizer_config.json beside it that is not valid JSON ({})", e.what()));
  }
  auto impl = std::make_unique<Impl>();
  std::vector<std::string> tokens;
  try {
    impl->read_layout(root, path);
    tokens = impl->read_vocab(root, path);
    impl->read_merges(root, path);
    impl->read_decoding(tokens);
  } catch (const json::exception& e) {
    refuse(path, fmt::format("is not a tokenizer.json remat reads ({})", e.what()));
  }
  std::shared_ptr<ByteLevelBpe> bpe(new ByteLevelBpe(std::move(impl)));
  bpe->tokens_ = std::move(tokens);
  bpe->bos_ = special_id(*bpe, config, "bos_token", kBosNames, path);
  bpe->eos_ = special_id(*bpe, config, "eos_token", kEosNames, path);
  return bpe;
}

int ByteLevelBpe::token_to_id(std::string_view token) const {
  const std::string key(token);
  if (const auto added = impl_->added_ids.find(key); added != impl_->added_ids.end()) return added->second;
  const auto it = impl_->vocab.find(key);
  return it == impl_->vocab.end() ? -1 : it->second;
}

std::vector<int32_t> ByteLevelBpe::Impl::merge(std::string_view word) const {
  // Symbols in a linked list; the best-ranked adjacent pair merges first, the leftmost
  // among equals, as `tokenizers` merges a word.
  struct Symbol {
    int32_t id;
    int prev, next;
    bool alive;
  };
  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  for (size_t i = 0; i < word.size(); ++i) {
    symbols.push_back({byte_id[static_cast<unsigned char>(word[i])], static_cast<int>(i) - 1,
                       i + 1 < word.size() ? static_cast<int>(i) + 1 : -1, true});
  }
  struct Candidate {
    int32_t rank;
    int left;
    int32_t right_id;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
  auto consider = [&](int left) {
    if (left < 0 || symbols[static_cast<size_t>(left)].next < 0) return;
    const Symbol& a = symbols[static_cast<size_t>(left)];
    const int32_t b = symbols[static_cast<size_t>(a.next)].id;
    const auto it = merges.find(pair_key(a.id, b));
    if (it != merges.end()) queue.push({it->second.rank, left, b});
  };
  for (int i = 0; i + 1 < static_cast<int>(symbols.size()); ++i) consider(i);
  while (!queue.empty()) {
    const Candidate c = queue.top();
    queue.pop();
    Symbol& a = symbols[static_cast<size_t>(c.left)];
    // Stale when either side has merged since.
    if (!a.alive || a.next < 0 || symbols[static_cast<size_t>(a.next)].id != c.right_id) continue;
    const auto it = merges.find(pair_key(a.id, c.right_id));
    if (it == merges.end() || it->second.rank != c.rank) continue;
    Symbol& b = symbols[static_cast<size_t>(a.next)];
    a.id = it->second.id;
    b.alive = false;
    a.next = b.next;
    if (b.next >= 0) symbols[static_cast<size_t>(b.next)].prev = c.left;
    consider(a.prev);
    consider(c.left);
  }
  std::vector<int32_t> ids;
  for (int i = symbols.empty() ? -1 : 0; i >= 0; i = symbols[static_cast<size_t>(i)].next) {
    ids.push_back(symbols[static_cast<size_t>(i)].id);
  }
  return ids;
}

void ByteLevelBpe::Impl::encode_word(std::string_view word, size_t base, std::vector<int32_t>& ids,
                                     std::vector<int64_t>* starts,
                                     std::unordered_map<std::string, std::vector<int32_t>>& cache) const {
  auto [it, fresh] = cache.try_emplace(std::string(word));
  if (fresh) {
    if (ignore_merges) {
      std::string chars;
      for (const char c : word) chars += byte_chars().of_byte[static_cast<unsigned char>(c)];
      const auto whole = vocab.find(chars);
      if (whole != vocab.end()) it->second = {whole->second};
    }
    if (it->second.empty()) it->second = merge(word);
  }
  size_t at = base;
  for (const int32_t id : it->second) {
    ids.push_back(id);
    if (starts != nullptr) starts->push_back(static_cast<int64_t>(at));
    at += bytes[static_cast<size_t>(id)].size();
  }
}

void ByteLevelBpe::Impl::pre_tokenize(std::string_view text, size_t base, std::vector<int32_t>& ids,
                                      std::vector<int64_t>* starts,
                                      std::unordered_map<std::string, std::vector<int32_t>>& cache) const {
  auto word = [&](size_t b, size_t e) { encode_word(text.substr(b, e - b), base + b, ids, starts, cache); };
  if (split) {
    split->split(text, base, word);
    return;
  }
  size_t done = 0;
  for (size_t at = text.find(*split_literal); at != std::string_view::npos; at = text.find(*split_literal, done)) {
    if (at > done) word(done, at);
    word(at, at + split_literal->size());
    done = at + split_literal->size();
  }
  if (done < text.size()) word(done, text.size());
}

std::vector<int32_t> ByteLevelBpe::encode(std::string_view input, std::vector<int64_t>* starts) const {
  std::string replaced;
  if (util::find_invalid_utf8(input) != std::string_view::npos) {
    replaced = util::replace_invalid_utf8(input);
    input = replaced;
  }
  std::vector<int32_t> ids;
  if (starts != nullptr) starts->clear();
  std::unordered_map<std::string, std::vector<int32_t>> cache;
  // The added tokens matched on the raw text first, then those matched after normalisation
  // on what is left between them; the rest is pre-tokenized and merged.
  auto added_then = [&](const AddedSet& set, size_t from, size_t end, const auto& rest) {
    while (from < end) {
      const auto found = set.empty() ? std::nullopt : set.find(input, from, end);
      const size_t stop = found ? found->first : end;
      if (stop > from) rest(from, stop);
      if (!found) break;
      ids.push_back(found->second->id);
      if (starts != nullptr) starts->push_back(static_cast<int64_t>(found->first));
      from = found->first + found->second->content.size();
    }
  };
  added_then(impl_->raw_added, 0, input.size(), [&](size_t b, size_t e) {
    added_then(impl_->normalized_added, b, e,
               [&](size_t b2, size_t e2) { impl_->pre_tokenize(input.substr(b2, e2 - b2), b2, ids, starts, cache); });
  });
  return ids;
}

std::string ByteLevelBpe::decode(const int32_t* ids, size_t count) const {
  std::string out;
  for (size_t k = 0; k < count; ++k) {
    if (ids[k] < 0 || ids[k] >= vocab_size() || tokens_[static_cast<size_t>(ids[k])].empty()) {
      throw std::out_of_range(
          fmt::format("The token id {} is not one of the tokenizer's {} ids.", ids[k], vocab_size()));
    }
    out += impl_->bytes[static_cast<size_t>(ids[k])];
  }
  return out;
}

}  // namespace remat::data
