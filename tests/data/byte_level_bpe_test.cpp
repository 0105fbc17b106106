#include "data/byte_level_bpe.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "util/atomic_file.h"
#include "util/error_of.h"
#include "util/paths.h"
#include "util/utf8.h"

namespace remat::data {
namespace {

using nlohmann::json;

const std::string kDir = std::string(remat::testing::kSourceDir) + "/tests/data/hf_tokenizers/";

std::shared_ptr<const ByteLevelBpe> load(const std::string& name) {
  const std::string config = kDir + name + "/tokenizer_config.json";
  return ByteLevelBpe::parse(util::read_file(kDir + name + "/tokenizer.json"),
                             std::filesystem::exists(config) ? util::read_file(config) : "", name);
}

std::string from_hex(const std::string& hex) {
  std::string bytes;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) bytes += static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16));
  return bytes;
}

// goldens.json is what Hugging Face's `tokenizers` gives for the same files and texts
// (tests/data/hf_tokenizers/make_goldens.py, checked again in the LibTorch 2.x lane):
// every id, and the decoded text after its lossy UTF-8 conversion.
TEST(ByteLevelBpe, EncodesAndDecodesAsHuggingFacesTokenizersDoes) {
  const json goldens = json::parse(util::read_file(kDir + "goldens.json"));
  const std::map<std::string, std::shared_ptr<const ByteLevelBpe>> tokenizers = {{"gpt2", load("gpt2")},
                                                                                 {"llama3", load("llama3")}};
  ASSERT_EQ(goldens.at("cases").size(), 50u);
  for (const json& c : goldens.at("cases")) {
    const ByteLevelBpe& bpe = *tokenizers.at(c.at("tokenizer").get<std::string>());
    const std::string text = from_hex(c.at("hex").get<std::string>());
    SCOPED_TRACE(c.at("tokenizer").get<std::string>() + ": " + util::printable(text, 60));
    std::vector<int64_t> starts;
    const std::vector<int32_t> ids = bpe.encode(text, &starts);
    EXPECT_EQ(ids, c.at("ids").get<std::vector<int32_t>>());
    const std::string decoded = bpe.decode(ids.data(), ids.size());
    EXPECT_EQ(util::replace_invalid_utf8(decoded), c.at("decoded").get<std::string>());
    if (util::find_invalid_utf8(text) != std::string::npos) continue;
    // Valid text round-trips exactly, and each token sits at its start.
    EXPECT_EQ(decoded, text);
    ASSERT_EQ(starts.size(), ids.size());
    for (size_t k = 0; k < ids.size(); ++k) {
      const size_t end = k + 1 < ids.size() ? static_cast<size_t>(starts[k + 1]) : text.size();
      ASSERT_EQ(bpe.decode(&ids[k], 1), text.substr(static_cast<size_t>(starts[k]), end - starts[k])) << k;
    }
  }
}

TEST(ByteLevelBpe, FindsTheBeginAndEndOfTextByConfigOrByName) {
  const auto gpt2 = load("gpt2"), llama3 = load("llama3");
  EXPECT_EQ(gpt2->bos_id(), gpt2->token_to_id("<|endoftext|>"));
  EXPECT_EQ(gpt2->eos_id(), gpt2->token_to_id("<|endoftext|>"));
  EXPECT_EQ(llama3->bos_id(), llama3->token_to_id("<|begin_of_text|>"));
  EXPECT_EQ(llama3->eos_id(), llama3->token_to_id("<|end_of_text|>"));
  EXPECT_NE(llama3->bos_id(), llama3->eos_id());
  EXPECT_EQ(llama3->token(llama3->eos_id()), "<|end_of_text|>");
  // The config decides over the names: here an end of text no name fallback would pick.
  const auto configured = ByteLevelBpe::parse(util::read_file(kDir + "llama3/tokenizer.json"),
                                              R"({"eos_token": {"content": "<|reserved_special_token_0|>"}})", "t");
  EXPECT_EQ(configured->eos_id(), configured->token_to_id("<|reserved_special_token_0|>"));
  EXPECT_EQ(configured->bos_id(), configured->token_to_id("<|begin_of_text|>"));
  EXPECT_EQ(gpt2->token_to_id("no such token"), -1);
  EXPECT_EQ(gpt2->vocab_size(), 545);
}

// A megabyte of whitespace is one pre-token that backtracks deep and one word of a million
// symbols to merge: it must encode, in bounded time, and come back whole.
TEST(ByteLevelBpe, EncodesAMegabyteOfWhitespace) {
  const auto bpe = load("llama3");
  const std::string text = "a" + std::string(size_t{1} << 20, ' ') + "b";
  const std::vector<int32_t> ids = bpe->encode(text);
  EXPECT_EQ(bpe->decode(ids.data(), ids.size()), text);
}

std::string refusal(json tokenizer) {
  return testing::error_of<std::runtime_error>([&] { ByteLevelBpe::parse(tokenizer.dump(), "", "t.json"); });
}

TEST(ByteLevelBpe, RefusesWhatItDoesNotReadWithASentence) {
  const json gpt2 = json::parse(util::read_file(kDir + "gpt2/tokenizer.json"));
  EXPECT_EQ(testing::error_of<std::runtime_error>([] {
              ByteLevelBpe::parse("{\"model\": ", "", "t.json");
            }).rfind("The tokenizer t.json is not valid JSON (", 0),
            0u);
  json t = gpt2;
  t["normalizer"] = json{{"type", "NFC"}};
  EXPECT_EQ(refusal(t),
            "The tokenizer t.json normalises its text first; remat reads byte-level tokenizers without a normalizer, "
            "as GPT-2's and Llama 3's are.");
  t = gpt2;
  t["model"]["vocab"].erase("Ġ");
  EXPECT_EQ(refusal(t),
            "The tokenizer t.json lacks the byte-level character of byte 0x20, so some text would have "
            "no tokens.");
  t = gpt2;
  t["model"]["merges"].push_back(json::array({"Ġ", "zzz"}));
  EXPECT_EQ(refusal(t), "The tokenizer t.json has merge 288 (Ġ + zzz) of tokens not all in its vocabulary.");
  t = gpt2;
  t["model"]["type"] = "WordPiece";
  EXPECT_EQ(refusal(t).rfind("The tokenizer t.json is a \"WordPiece\" model; remat reads BPE tokenizers", 0), 0u);
  t = gpt2;
  t["pre_tokenizer"]["add_prefix_space"] = true;
  EXPECT_EQ(refusal(t).rfind("The tokenizer t.json adds a prefix space", 0), 0u);
  t = gpt2;
  t["added_tokens"][0]["id"] = 100000;
  EXPECT_EQ(refusal(t),
            "The tokenizer t.json gives the token <|endoftext|> the id 100000, not one from 0 to 545 "
            "(below the tokens it lists).");
  t = gpt2;
  t["model"]["merges"] = 7;
  EXPECT_EQ(refusal(t), "The tokenizer t.json has merges that are not a list.");
  t = gpt2;
  t["pre_tokenizer"] = json{{"type", "Split"}, {"pattern", {{"Regex", "("}}}};
  EXPECT_EQ(refusal(t).rfind("The tokenizer t.json has a Split pre-tokenizer; remat reads ByteLevel", 0), 0u);
}

TEST(ByteLevelBpe, RefusesARegularExpressionPcreCannotCompile) {
  json t = json::parse(util::read_file(kDir + "llama3/tokenizer.json"));
  t["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed";
  EXPECT_EQ(refusal(t).rfind("The tokenizer t.json has a regular expression that PCRE2 cannot compile (", 0), 0u);
}

}  // namespace
}  // namespace remat::data
