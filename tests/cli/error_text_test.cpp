// What the CLI prints for an error: the allocator's refusal as a sentence, and no message
// repeating megabytes of input.
#include "cli/commands.h"

#include "util/temp_dir.h"

#include <gtest/gtest.h>

#include <filesystem>

#include <string>

namespace {

using remat::cli::error_text;
using remat::cli::filesystem_text;

TEST(ErrorText, TheAllocatorsRefusalBecomesASentence) {
  const std::string c10 =
      "[enforce fail at alloc_cpu.cpp:75] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate "
      "274877906944 bytes. Error code 12 (Cannot allocate memory)";
  const std::string text = error_text(c10);
  EXPECT_EQ(text.rfind("This machine could not allocate 274877906944 bytes for one tensor (", 0), 0u) << text;
  EXPECT_NE(text.find("): the model, batch or sequence is too large for its memory; lower model.d_model"),
            std::string::npos)
      << text;
  EXPECT_EQ(text.find("enforce fail"), std::string::npos) << text;
}

TEST(ErrorText, TheCudaAllocatorsRefusalBecomesASentence) {
  // LibTorch 2.x's wording, then 1.13's.
  const std::string current =
      "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB of which 1.23 GiB is "
      "free. Of the allocated memory 75.10 GiB is allocated by PyTorch, and 1.50 GiB is reserved by PyTorch but "
      "unallocated.";
  const std::string old =
      "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 79.15 GiB total capacity; 77.01 GiB already "
      "allocated; 9.69 MiB free; 78.20 GiB reserved in total by PyTorch)";
  for (const auto& [message, request] :
       {std::pair{current, "Tried to allocate 2.00 GiB"}, std::pair{old, "Tried to allocate 20.00 MiB"}}) {
    const std::string text = error_text(message);
    EXPECT_EQ(text.rfind(std::string("The GPU ran out of memory (") + request + "): ", 0), 0u) << text;
    EXPECT_NE(text.find("ac.budget"), std::string::npos) << text;
    EXPECT_NE(text.find("run.expandable_segments=true"), std::string::npos) << text;
  }
}

// Whatever text a file put in a message, the terminal gets no control character but the
// message's own line breaks.
TEST(ErrorText, EscapesControlCharacters) {
  EXPECT_EQ(error_text("Unknown name 'x\x1b[2J\rforged'\nsecond line"),
            "Unknown name 'x\\x1b[2J\\rforged'\nsecond line");
}

// A symbolic-link loop as model.safetensors printed std::filesystem's own text
// ("filesystem error: status: Too many levels of symbolic links [...]").
TEST(ErrorText, TheFilesystemsRefusalBecomesASentence) {
  const remat::testing::TempDir dir;
  const std::filesystem::path loop = dir.path() / "model.safetensors";
  std::filesystem::create_symlink(loop, loop);
  try {
    (void)std::filesystem::status(loop);
    ADD_FAILURE() << "a loop of links was followed";
  } catch (const std::filesystem::filesystem_error& e) {
    EXPECT_EQ(filesystem_text(e), "Cannot use " + loop.string() +
                                      " (Too many levels of symbolic links): it is a loop of symbolic links (a link "
                                      "that leads back to itself); point it at a real file or remove it.");
  }
}

TEST(ErrorText, ALongMessageKeepsItsStartAndEnd) {
  const std::string shortish = "model.d_ff must be at most 524288, got 1048576.";
  EXPECT_EQ(error_text(shortish), shortish);
  const std::string huge = "Override '" + std::string(100000, 'x') + "' is not of the form key=value.";
  const std::string text = error_text(huge);
  EXPECT_LT(text.size(), 2100u);
  EXPECT_EQ(text.rfind("Override 'xxx", 0), 0u);
  EXPECT_NE(text.find(" bytes left out ...] "), std::string::npos) << text.substr(0, 200);
  EXPECT_EQ(text.substr(text.size() - 30), huge.substr(huge.size() - 30));
}

}  // namespace
