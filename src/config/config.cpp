// Loading a config: a TOML file and overrides set through the key table (keys.cpp), then
// validate_config (validate.cpp).
#include "remat/config.h"

#include "config/changed_keys.h"

#include "util/atomic_file.h"
#include "util/utf8.h"

#include <fmt/format.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <toml++/toml.h>

#include <algorithm>
#include <map>
#include <stdexcept>
#include <string_view>
#include <utility>
#include <vector>

namespace remat {
namespace {

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument(msg); }

// A config value a person reads (config.toml, plan.txt, messages) and remat prints: refused
// with a control character (but a prompt's line breaks and tabs), from a file or an override.
void check_printable(const std::string& key, const std::string& value, const std::string& origin) {
  const size_t at = util::find_control(value, key == "run.prompt");
  if (at == std::string::npos) return;
  fail(
      fmt::format("{}{} holds a control character at offset {}: '{}'; config values are printed and written "
                  "into config.toml, plan.txt and logs: remove it (it is usually a stray line break or escape in a "
                  "file or a shell variable).",
                  util::printable(key), origin, at, util::printable(value)));
}

// model.init names a Hugging Face model where a config.json is in its folder (or beside
// its weights file): that shape replaces the preset's, and the tokenizer there becomes
// data.tokenizer's default, as a preset would give them; explicit keys still win.
void apply_init(Config& c, const std::string& init) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const bool folder = fs::is_directory(init, ec);
  const fs::path dir = folder ? fs::path(init) : fs::path(init).parent_path();
  const fs::path config = (dir.empty() ? fs::path(".") : dir) / "config.json";
  if (!fs::exists(config, ec)) {
    if (!folder) return;  // weights alone (remat's own): the shape is the preset's and the keys'
    fail(
        fmt::format("model.init = '{}' is a folder without a config.json; give a Hugging Face model's folder "
                    "(config.json and model.safetensors) or a .safetensors file.",
                    util::printable(init)));
  }
  const std::string preset = c.model.preset;
  c.model = hf_model_config(config.string(), c.model);
  c.model.preset = preset;
  for (const char* name : {"tokenizer.json", "tokenizer.model"}) {
    if (fs::exists(config.parent_path() / name, ec)) {
      c.data.tokenizer = config.parent_path().string();
      break;
    }
  }
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

const ConfigKey& find_key(const std::string& name, const std::string& where) {
  const auto& keys = config_keys();
  for (const auto& k : keys) {
    if (k.name == name) return k;
  }
  // The edit distance costs the product of the lengths: a key this long is no typo.
  if (name.size() > 100) {
    fail(fmt::format("Unknown config key '{}'{}; `remat train --help-config` lists every key.", util::printable(name),
                     where));
  }
  // Suggest the closest key, also matching a bare field name ("lr" -> "train.lr").
  const ConfigKey* best = nullptr;
  size_t best_d = SIZE_MAX;
  for (const auto& k : keys) {
    const std::string field = k.name.substr(k.name.find('.') + 1);
    size_t d = std::min(edit_distance(name, k.name), edit_distance(name, field));
    if (d < best_d) {
      best_d = d;
      best = &k;
    }
  }
  std::string msg = fmt::format("Unknown config key '{}'{}", util::printable(name), where);
  if (best != nullptr && best_d <= std::max<size_t>(3, name.size() / 3)) {
    msg += fmt::format("; did you mean '{}'?", best->name);
  } else {
    msg += "; `remat train --help-config` lists every key.";
  }
  fail(msg);
}

// A config is a few kilobytes; a megabyte is no config remat wrote or a person would.
constexpr int64_t kMaxConfigBytes = int64_t{1} << 20;

// toml++ makes a table per part of a dotted key and parses nested arrays and inline tables
// by recursion, so a key of 30,000 parts overflows the stack (SIGSEGV) before it can refuse
// it. remat's keys have two or three parts, so more than kMaxKeyParts, or brackets nested
// deeper than kMaxNesting, are refused before toml++ parses. Strings and comments are
// skipped: their dots and brackets are text.
void check_toml_nesting(const std::string& text, const std::string& path) {
  constexpr int kMaxKeyParts = 32, kMaxNesting = 32;
  int dots = 0, depth = 0;
  size_t line = 1;
  const auto refuse = [&](const std::string& what) {
    fail(
        fmt::format("Cannot read config {}: line {} {}; remat's keys have two or three parts (train.lr, "
                    "model.preset), so this is not a remat config.",
                    path, line, what));
  };
  for (size_t i = 0; i < text.size(); ++i) {
    const char ch = text[i];
    if (ch == '\n') {
      ++line;
      dots = 0;
    } else if (ch == '#') {
      const size_t end = text.find('\n', i);
      i = (end == std::string::npos ? text.size() : end) - 1;
    } else if (ch == '"' || ch == '\'') {
      const std::string triple(3, ch);
      size_t end;
      if (text.compare(i, 3, triple) == 0) {
        end = text.find(triple, i + 3);
        end = end == std::string::npos ? text.size() : end + 2;
      } else {
        end = i + 1;
        while (end < text.size() && text[end] != ch && text[end] != '\n') end += ch == '"' && text[end] == '\\' ? 2 : 1;
        if (end < text.size() && text[end] == '\n') --end;  // an unclosed string: toml++ says so
      }
      end = std::min(end, text.size() - 1);
      line += static_cast<size_t>(std::count(text.begin() + static_cast<std::ptrdiff_t>(i),
                                             text.begin() + static_cast<std::ptrdiff_t>(end) + 1, '\n'));
      i = end;
    } else if (ch == '.') {
      if (++dots >= kMaxKeyParts) refuse(fmt::format("has a key of more than {} dotted parts", kMaxKeyParts));
    } else if (ch == '[' || ch == '{') {
      dots = 0;
      if (++depth > kMaxNesting) refuse(fmt::format("nests arrays or tables more than {} deep", kMaxNesting));
    } else if (ch == ']' || ch == '}') {
      dots = 0;
      depth = std::max(0, depth - 1);
    } else if (ch == '=' || ch == ',') {
      dots = 0;
    }
  }
}

// TOML file -> ordered (key, value-as-text) pairs, tables flattened to dotted names.
void flatten(const toml::table& t, const std::string& prefix, const std::string& path,
             std::vector<std::pair<std::string, std::string>>& out) {
  for (const auto& [k, node] : t) {
    const std::string name = prefix.empty() ? std::string(k.str()) : prefix + "." + std::string(k.str());
    if (const auto* sub = node.as_table()) {
      flatten(*sub, name, path, out);
    } else if (auto s = node.value_exact<std::string>()) {
      out.emplace_back(name, *s);
    } else if (auto b = node.value_exact<bool>()) {
      out.emplace_back(name, *b ? "true" : "false");
    } else if (auto i = node.value_exact<int64_t>()) {
      out.emplace_back(name, std::to_string(*i));
    } else if (auto d = node.value_exact<double>()) {
      out.emplace_back(name, fmt::format("{}", *d));
    } else if (const auto* arr = node.as_array()) {
      // A list key: an array of scalars becomes the comma-joined string an override gives.
      std::string joined;
      for (size_t i = 0; i < arr->size(); ++i) {
        const auto& item = *arr->get(i);
        std::string text;
        if (auto is = item.value_exact<std::string>()) {
          text = *is;
        } else if (auto ii = item.value_exact<int64_t>()) {
          text = std::to_string(*ii);
        } else if (auto id = item.value_exact<double>()) {
          text = fmt::format("{}", *id);
        } else if (auto ib = item.value_exact<bool>()) {
          text = *ib ? "true" : "false";
        } else {
          fail(fmt::format("{}: '{}' must be an array of strings, numbers or booleans.", path, name));
        }
        joined += (i ? "," : "") + text;
      }
      out.emplace_back(name, joined);
    } else {
      fail(fmt::format("{}: '{}' must be a string, number, boolean or array of them.", path, name));
    }
  }
}

}  // namespace

c10::Device device_of(const std::string& name) {
  if (name == "cpu") return c10::Device(c10::kCPU);
  const std::string index = name.size() > 5 ? name.substr(5) : "";
  const bool digits = index.size() < 4 && index.find_first_not_of("0123456789") == std::string::npos;
  // "cuda" stays without an index (the process's GPU), as the user wrote it.
  if (name == "cuda") return c10::Device(c10::kCUDA);
  if (name.rfind("cuda:", 0) == 0 && !index.empty() && digits) {
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(std::stoi(index)));
  }
  fail(fmt::format("run.device must be cpu or cuda[:N], got '{}'.", util::printable(name)));
}

at::ScalarType dtype_of(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  fail(fmt::format("run.dtype must be float32 or bfloat16, got '{}'.", util::printable(name)));
}

Config load_config(const std::string& toml_path, const std::vector<std::string>& overrides) {
  std::vector<std::pair<std::string, std::string>> settings;
  std::vector<std::string> origins;
  if (!toml_path.empty()) {
    // Read here rather than by toml++: a FIFO or device is refused instead of waited on.
    const std::string text = util::read_file(toml_path, "the config", kMaxConfigBytes);
    check_toml_nesting(text, toml_path);
    toml::table table;
    try {
      table = toml::parse(text, toml_path);
    } catch (const toml::parse_error& e) {
      const auto& src = e.source();
      fail(fmt::format("Cannot read config {}: {} (line {}, column {}).", toml_path, std::string(e.description()),
                       src.begin.line, src.begin.column));
    }
    flatten(table, "", toml_path, settings);
    origins.assign(settings.size(), " in " + toml_path);
  }
  for (const auto& o : overrides) {
    const auto eq = o.find('=');
    if (eq == std::string::npos || eq == 0) {
      fail(fmt::format("Override '{}' is not of the form key=value (e.g. train.lr=1e-3).", util::printable(o)));
    }
    // A TOML file is UTF-8 by its grammar (toml++ refuses other bytes); an override is not,
    // and its value would land in the run's config.toml, which could not be read back.
    const size_t bad = util::find_invalid_utf8(o);
    if (bad != std::string::npos) {
      fail(
          fmt::format("Override '{}' is not UTF-8 text (byte {:#04x} at offset {}); config values are UTF-8, as in a "
                      "TOML file, since a run records them in its config.toml: write it in UTF-8.",
                      util::printable(o), static_cast<unsigned char>(o[bad]), bad));
    }
    settings.emplace_back(o.substr(0, eq), o.substr(eq + 1));
    origins.emplace_back(" (command-line override)");
  }

  for (size_t i = 0; i < settings.size(); ++i) check_printable(settings[i].first, settings[i].second, origins[i]);
  Config c;
  // The preset replaces the whole model shape, so it goes first; explicit model keys
  // then adjust it, whichever order they were written in.
  for (const auto& [k, v] : settings) {
    if (k == "model.preset") c.model = model_preset(v);
  }
  for (const auto& [k, v] : settings) {
    if (k == "model.init") apply_init(c, v);
  }
  for (size_t i = 0; i < settings.size(); ++i) {
    const auto& [k, v] = settings[i];
    if (k == "model.preset") continue;
    find_key(k, origins[i]).set(c, v);
  }
  resolve_zero_stage(
      c, std::any_of(settings.begin(), settings.end(), [](const auto& kv) { return kv.first == "parallel.zero"; }));
  resolve_reshard(c, std::any_of(settings.begin(), settings.end(),
                                 [](const auto& kv) { return kv.first == "parallel.reshard_after_forward"; }));
  c.model.vocab_size = padded_vocab_size(c, c.model.vocab_size);
  // The real stages are the ones per-stage policies count (block:N, ratio:R, ColossalAI's lists).
  if (c.parallel.pp > 1 && c.ac.stages == 1) c.ac.stages = c.parallel.pp;
  validate_config(c);
  return c;
}

void check_path(const std::string& what, const std::string& path) {
  const size_t at = util::find_control(path);
  if (at == std::string::npos) return;
  fail(
      fmt::format("{} = '{}' holds a control character at offset {}; paths must be printable (they are written into "
                  "plot scripts, logs and tables): remove it, it is usually a stray line break in a config file or a "
                  "shell variable.",
                  what, util::printable(path), at));
}

std::string config_to_toml(const Config& c) {
  std::string out = "# remat resolved configuration\n";
  std::string section;
  for (const auto& k : config_keys()) {
    const auto dot = k.name.find('.');
    const std::string sec = k.name.substr(0, dot);
    if (sec != section) {
      out += fmt::format("\n[{}]\n", sec);
      section = sec;
    }
    const std::string value = k.get(c);
    if (value.empty()) {
      out += fmt::format("# {} = (unset)\n", k.name.substr(dot + 1));
    } else {
      out += fmt::format("{} = {}\n", k.name.substr(dot + 1), value);
    }
  }
  return out;
}

namespace {

// Each key of a config_to_toml text with its value, in the text's order.
std::vector<std::pair<std::string, std::string>> toml_values(const std::string& text) {
  std::vector<std::pair<std::string, std::string>> values;
  std::string section;
  size_t begin = 0;
  while (begin < text.size()) {
    const size_t end = std::min(text.find('\n', begin), text.size());
    std::string_view line(text.data() + begin, end - begin);
    begin = end + 1;
    if (line.size() > 2 && line.front() == '[' && line.back() == ']') {
      section = std::string(line.substr(1, line.size() - 2));
      continue;
    }
    const bool unset = line.rfind("# ", 0) == 0 && line.size() > 10 && line.substr(line.size() - 10) == " = (unset)";
    if (unset) line = line.substr(2);
    const size_t eq = line.find(" = ");
    if (eq == std::string_view::npos || line.front() == '#') continue;
    values.emplace_back(section + "." + std::string(line.substr(0, eq)), std::string(line.substr(eq + 3)));
  }
  return values;
}

}  // namespace

std::vector<std::string> changed_keys(const std::string& before, const std::string& after,
                                      const std::vector<std::string>& ignored) {
  std::map<std::string, std::string> old;
  for (auto& [key, value] : toml_values(before)) old.emplace(key, std::move(value));
  std::vector<std::string> changes;
  for (const auto& [key, value] : toml_values(after)) {
    if (std::find(ignored.begin(), ignored.end(), key) != ignored.end()) continue;
    const auto it = old.find(key);
    const std::string was = it == old.end() ? "(unset)" : it->second;
    if (was != value) changes.push_back(fmt::format("{} = {} -> {}", key, was, value));
  }
  return changes;
}

}  // namespace remat
