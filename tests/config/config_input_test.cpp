// Config files and values a user or an attacker controls: nothing crashes, waits for ever
// or repeats megabytes of input; every refusal is a sentence.
#include "util/temp_dir.h"
#include "remat/config.h"
#include "remat/model.h"
#include "util/error_of.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <fstream>
#include <string>

namespace remat {
namespace {

std::string error_of(const std::function<void()>& f) { return remat::testing::error_of<std::exception>(f); }

std::string write(const remat::testing::TempDir& dir, const std::string& name, const std::string& text) {
  const std::string path = dir / name;
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

std::string repeated(const std::string& part, int n, const std::string& separator) {
  std::string out;
  for (int i = 0; i < n; ++i) out += (i ? separator : "") + part;
  return out;
}

// 100,000 dotted key parts crashed toml++ with a stack overflow (SIGSEGV), as did deeply
// nested arrays and inline tables; they are refused before it parses.
TEST(ConfigInput, DeeplyDottedOrNestedTomlIsRefusedBeforeParsing) {
  const remat::testing::TempDir dir;
  const std::string dotted = write(dir, "dotted.toml", repeated("a", 100000, ".") + " = 1\n");
  EXPECT_EQ(error_of([&] { load_config(dotted, {}); }),
            "Cannot read config " + dotted +
                ": line 1 has a key of more than 32 dotted parts; remat's keys have two "
                "or three parts (train.lr, model.preset), so this is not a remat config.");
  const std::string header = write(dir, "header.toml", "# a comment.with.dots\n[" + repeated("t", 40, ".") + "]\n");
  EXPECT_NE(error_of([&] { load_config(header, {}); }).find("line 2 has a key of more than 32 dotted parts"),
            std::string::npos);
  for (const auto& [name, text] :
       {std::pair<std::string, std::string>{"arrays.toml", "a = " + std::string(100000, '[')},
        {"tables.toml", "a = " + repeated("{b = ", 100000, "")}}) {
    const std::string path = write(dir, name, text);
    EXPECT_EQ(error_of([&] { load_config(path, {}); }),
              "Cannot read config " + path +
                  ": line 1 nests arrays or tables more than 32 deep; remat's keys have "
                  "two or three parts (train.lr, model.preset), so this is not a remat config.");
  }
  // Dots, brackets and quotes inside strings and comments are text, not structure.
  const std::string fine =
      write(dir, "fine.toml",
            "# " + repeated("x", 50, ".") + "\n[run]\nprompt = \"" + repeated("a", 50, ".") +
                "[{'\\\"\"\n\"name\" = 'x.y'\n[model]\npreset = '''tiny\n" + repeated("g", 40, ".") + "'''\n");
  // Read whole: what is refused is the preset's line break, a value's control character.
  EXPECT_NE(error_of([&] {
              load_config(fine, {});
            }).find("model.preset in " + fine + " holds a control character at offset 4: 'tiny\\ng.g."),
            std::string::npos);
}

TEST(ConfigInput, AConfigThatIsNotARegularFileIsRefusedWithoutWaiting) {
  const remat::testing::TempDir dir;
  const std::string fifo = dir / "config.fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_EQ(error_of([&] { load_config(fifo, {}); }),
            "Cannot read the config " + fifo +
                ": it is a FIFO (named pipe), not a regular file; remat reads only "
                "regular files (a FIFO or device could make it wait or read for ever): give the path of a file.");
  EXPECT_EQ(error_of([&] { load_config(dir.path().string(), {}); }).find("it is a directory, not a regular file"),
            std::string("Cannot read the config " + dir.path().string() + ": ").size());
  const std::string huge = write(dir, "huge.toml", "# " + std::string(2 << 20, 'x') + "\n");
  EXPECT_EQ(error_of([&] { load_config(huge, {}); }),
            "Cannot read the config " + huge + ": it holds 2097155 bytes, more than the 1048576 such a file can hold.");
}

// A refusal quotes at most a couple of hundred bytes of what it refuses.
TEST(ConfigInput, MessagesQuoteAtMostAFewHundredBytesOfTheInput) {
  const remat::testing::TempDir dir;
  const std::string value(500000, '7');
  const std::string file = write(dir, "long.toml", "[train]\nlr = \"" + value + "x\"\n");
  for (const auto& call : std::vector<std::function<void()>>{
           [&] { load_config(file, {}); }, [&] { load_config("", {"train.steps=" + value + "x"}); },
           [&] { load_config("", {"model.arch=" + value}); }, [&] { load_config("", {"run.device=" + value}); },
           [&] { load_config("", {value + "=1"}); }, [&] { load_config("", {value}); },
           [&] { load_config("", {"run.name=" + value}); }, [&] { load_config("", {"model.preset=" + value}); }}) {
    const std::string error = error_of(call);
    EXPECT_FALSE(error.empty());
    EXPECT_LT(error.size(), 600u) << error.substr(0, 1000);
  }
}

TEST(ConfigInput, ModelDimensionsHaveUpperBoundsAboveEveryPreset) {
  for (const std::string& preset : preset_names()) {
    EXPECT_EQ(error_of([&] { load_config("", {"model.preset=" + preset, "train.seq=16"}); }), "") << preset;
  }
  EXPECT_EQ(error_of([&] {
              load_config("", {"model.d_model=262144", "model.n_head=4", "model.n_kv_head=4"});
            }),
            "model.d_model must be from 1 to 131072, got 262144; 131072 is eight times Llama 3 405B's 16384; for "
            "example 768 (GPT-2), 4096 (Llama 3 8B).");
  EXPECT_EQ(error_of([&] { load_config("", {"model.d_ff=1048576"}); }),
            "model.d_ff must be from 1 to 524288, got 1048576; 524288 is about ten times Llama 3 405B's 53248; for "
            "example 3072 (GPT-2), 14336 (Llama 3 8B).");
  EXPECT_EQ(error_of([&] {
              load_config("", {"model.n_head=2048", "model.n_kv_head=2048", "model.d_model=4096"});
            }),
            "model.n_head must be from 1 to 1024 heads, got 2048; 1024 is eight times Llama 3 405B's 128; for "
            "example 12 (GPT-2), 32 (Llama 3 8B).");
  EXPECT_NE(error_of([&] {
              load_config("", {"model.n_layer=1024", "model.d_model=131072", "model.n_head=128", "model.n_kv_head=128",
                               "model.d_ff=524288"});
            }).find("more than remat trains or plans (2^42)"),
            std::string::npos);
}

TEST(ConfigInput, ARunNameLongerThanADirectoryNameIsRefused) {
  EXPECT_EQ(error_of([&] { load_config("", {"run.name=" + std::string(256, 'n')}); }),
            "run.name is 256 bytes long; a run directory's name holds at most 200 (file systems allow 255, and remat "
            "may add a suffix): give a shorter name.");
  EXPECT_EQ(error_of([&] { load_config("", {"run.name=" + std::string(200, 'n')}); }), "");
}

}  // namespace
}  // namespace remat
