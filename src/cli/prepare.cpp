#include "cli/prepare.h"

#include <fmt/format.h>

#include <cstdio>
#include <memory>

#include "remat/data.h"

namespace remat::cli {

void add_prepare_command(CLI::App& app) {
  auto options = std::make_shared<data::PrepareOptions>();
  auto text = std::make_shared<std::string>();
  CLI::App* cmd = app.add_subcommand(
      "prepare",
      "Tokenize a corpus: train a BPE tokenizer, write train/val token files and meta.json "
      "(the King James Bible from Debian's bible-kjv unless --text is given)");
  cmd->add_option("--text", *text, "UTF-8 text file to use instead of the King James Bible");
  cmd->add_option("--out", options->out_dir, "corpus directory to write")->capture_default_str();
  cmd->add_option("--vocab", options->vocab_size, "tokenizer vocabulary size (>= 260)")
      ->capture_default_str();
  cmd->add_option("--val-fraction", options->val_fraction, "fraction of tokens for validation")
      ->capture_default_str();
  cmd->add_option("--val-blocks", options->val_blocks,
                  "number of validation stretches spread through the text")
      ->capture_default_str();
  cmd->add_option("--seed", options->seed, "seed of the tokenizer's text subsampling")
      ->capture_default_str();
  cmd->add_flag("--force", options->force, "rebuild even if the directory is up to date");
  cmd->callback([options, text] {
    if (!text->empty()) options->text_file = *text;
    data::CorpusInfo info;
    try {
      info = data::prepare_corpus(*options, [](const std::string& line) {
        std::printf("%s\n", line.c_str());
        std::fflush(stdout);
      });
    } catch (const std::exception& e) {
      std::fprintf(stderr, "remat prepare: %s\n", e.what());
      throw CLI::RuntimeError(1);
    }
    fmt::print("corpus     {}{}\n", info.dir, info.cached ? " (cached)" : "");
    fmt::print("source     {}\n", info.source);
    fmt::print("text       {} bytes, sha256 {}\n", info.text_bytes, info.text_sha256);
    fmt::print("tokenizer  {}-piece BPE, {}\n", info.vocab_size, info.tokenizer_path());
    fmt::print("tokens     {} train + {} val ({}), {:.2f} bytes/token\n", info.train_tokens,
               info.val_tokens, info.token_bytes == 2 ? "uint16" : "uint32",
               info.bytes_per_token());
    fmt::print(
        "entropy    {:.4f} nats/token (unigram, train): validation loss must fall well below\n",
        info.train_unigram_entropy);
  });
}

}  // namespace remat::cli
