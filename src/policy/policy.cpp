#include "remat/policy.h"

#include "remat/budget.h"
#include "remat/ops/attention.h"
#include "remat/pipeline.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <functional>
#include <stdexcept>
#include <utility>
#include <vector>

namespace remat {
namespace {

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument(msg); }

std::string join(const std::vector<std::string>& parts, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) out += (i ? sep : "") + parts[i];
  return out;
}

std::string strip_spaces(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (!std::isspace(static_cast<unsigned char>(c))) out += c;
  }
  return out;
}

bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

bool is_offload(const std::string& term) { return starts_with(term, "offload:") || starts_with(term, "offload("); }

// Splits at `sep` outside brackets.
std::vector<std::string> split_top(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  int depth = 0;
  for (char c : s) {
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (c == sep && depth == 0) {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  out.push_back(cur);
  return out;
}

// A whole number with an optional sign; saturates far beyond any layer count.
std::optional<int64_t> parse_int(const std::string& text) {
  size_t i = 0;
  bool neg = false;
  if (i < text.size() && (text[i] == '-' || text[i] == '+')) neg = text[i++] == '-';
  if (i == text.size()) return std::nullopt;
  int64_t v = 0;
  for (; i < text.size(); ++i) {
    if (!std::isdigit(static_cast<unsigned char>(text[i]))) return std::nullopt;
    v = std::min<int64_t>(v * 10 + (text[i] - '0'), int64_t{1} << 40);
  }
  return neg ? -v : v;
}

std::optional<double> parse_real(const std::string& text) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  if (used != text.size() || !std::isfinite(v)) return std::nullopt;
  return v;
}

// "a, b" (an override) or the comma-joined TOML array: the entries, spaces trimmed.
std::vector<std::string> split_list(const std::string& s) {
  std::string t = strip_spaces(s);
  if (t.size() >= 2 && t.front() == '[' && t.back() == ']') t = t.substr(1, t.size() - 2);
  if (t.empty()) return {};
  return split_top(t, ',');
}

std::vector<int64_t> int_list(const std::string& key, const std::string& value) {
  std::vector<int64_t> out;
  for (const auto& e : split_list(value)) {
    const auto v = parse_int(e);
    if (!v) fail(fmt::format("{} must be a list of whole numbers (e.g. \"4,4\" or [4, 4]), got '{}'.", key, value));
    out.push_back(*v);
  }
  return out;
}

std::string list_text(const std::vector<int64_t>& v) {
  std::vector<std::string> parts;
  for (auto x : v) parts.push_back(std::to_string(x));
  return "[" + join(parts, ", ") + "]";
}

const std::vector<std::pair<std::string, std::vector<std::string>>>& op_kinds() {
  static const std::vector<std::pair<std::string, std::vector<std::string>>> ops = {
      {"matmul", {"attn.qkv", "mlp.act_in"}},
      {"attention", {"attn.proj_in"}},
      {"softmax", {"attn.probs"}},
      {"dropout", {"attn.dropout", "attn.resid", "mlp.resid"}},
      {"norm", {"attn.norm", "attn.qkv_in", "attn.gathered", "mlp.fc_in", "mlp.gathered"}},
      {"act", {"mlp.proj_in"}},
      {"add", {"mlp.norm"}},
  };
  return ops;
}

/// How the layers are split across pipeline stages.
struct StageSplit {
  std::vector<int64_t> first;  ///< first layer of each stage
  std::vector<int64_t> size;   ///< layers of each stage
  int64_t smallest() const { return *std::min_element(size.begin(), size.end()); }
};

/// A per-layer slot choice of a selective policy (the layer index matters for matmul/2).
struct Selective {
  std::string canonical;
  std::function<SlotMask(int64_t)> dropped;
};

class Parser {
 public:
  Parser(std::string origin, int64_t n_layers, StageSplit layout)
      : origin_(std::move(origin)), n_(n_layers), layout_(std::move(layout)) {}

  ActivationPlan parse(const std::string& raw) {
    const std::string s = strip_spaces(raw);
    if (s.empty()) fail(fmt::format("{}: the policy is empty; {}", origin_, valid_forms()));
    auto terms = split_top(s, '+');
    for (size_t i = 0; i + 1 < terms.size(); ++i) {
      if (is_offload(terms[i])) {
        fail(fmt::format("{}: offload:[...] is the last term of a policy (X+offload:[...]), got it before {}.", origin_,
                         terms[i + 1]));
      }
    }
    if (!is_offload(terms.back())) return recompute(s);
    const std::string term = terms.back();
    terms.pop_back();
    ActivationPlan plan = recompute(terms.empty() ? "none" : join(terms, "+"));
    offload(term, plan);
    return plan;
  }

  // "+offload:[...]": each layer (with "(S)", each layer S selects) offloads the named slots
  // (a module: its slots) that it keeps; a slot it recomputes is not kept, so not offloaded.
  void offload(const std::string& term, ActivationPlan& plan) const {
    std::vector<bool> chosen(static_cast<size_t>(n_), true);
    std::string where;  // the canonical "(S)", empty for every layer
    size_t open = 8;    // where the bracketed list starts
    if (starts_with(term, "offload(")) {
      const size_t close = term.find("):");
      const auto sel = close == std::string::npos ? std::nullopt : select(term.substr(8, close - 8), "offloads");
      if (!sel) {
        fail(
            fmt::format("{}: '{}' must be offload(S):[...] with S one of every:K, block:N or ratio:R, the layers "
                        "that offload, e.g. offload(block:2):[input].",
                        origin_, term));
      }
      chosen = sel->second;
      where = "(" + sel->first + ")";
      open = close + 2;
      if (std::none_of(chosen.begin(), chosen.end(), [](bool c) { return c; })) {
        fail(
            fmt::format("{}: {} selects no layer, so it moves nothing to host memory; select at least one, e.g. "
                        "offload(ratio:0.5):[input], or drop the offload term.",
                        origin_, "offload" + where));
      }
    }
    std::vector<std::string> valid{slot_name(Slot::input)};
    for (const auto& n : block_slots()) valid.push_back(n);
    for (const auto& m : block_modules()) valid.push_back(m.first);
    SlotMask asked;
    for (const auto& n : names(term, open, "slot or module", valid)) {
      const auto m = std::find_if(block_modules().begin(), block_modules().end(),
                                  [&](const auto& module) { return module.first == n; });
      if (m != block_modules().end()) {
        asked |= SlotMask::of_names(m->second);
      } else {
        asked.add(slot_of_name(n));
      }
    }
    bool any = false;
    for (size_t i = 0; i < plan.layers.size(); ++i) {
      if (!chosen[i]) continue;
      auto& l = plan.layers[i];
      for (const Slot slot : asked.slots()) {
        const bool kept = slot == Slot::input ? l.chunk_begin < 0 : !l.dropped.has(slot);
        if (kept) l.offloaded.add(slot);
      }
      any = any || !l.offloaded.empty();
    }
    if (!any) {
      fail(
          fmt::format("{}: {} moves nothing to host memory: the policy {} recomputes every slot it names in "
                      "{}, and a recomputed slot is not kept; offload slots the policy keeps, e.g. "
                      "full+offload:[input].",
                      origin_, term, plan.policy, where.empty() ? "every layer" : "every layer it selects"));
    }
    const std::string moved = "offload" + where + ":[" + join(asked.names(), ",") + "]";
    plan.policy = plan.policy == "none" ? moved : plan.policy + "+" + moved;
  }

 private:
  // The policy without its offload term.
  ActivationPlan recompute(const std::string& s) {
    ActivationPlan plan;
    plan.layers.assign(static_cast<size_t>(n_), LayerPlan{});
    const auto plus = split_top(s, '+');
    if (plus.size() > 2) {
      fail(
          fmt::format("{}: a composition has exactly one '+' (X+Y: the layers X selects are full, "
                      "the others follow Y), got {} terms.",
                      origin_, plus.size()));
    }
    if (plus.size() == 2) {
      const auto selected = select(plus[0]);
      const auto rest = selective(plus[1]);
      if (!selected || !rest) {
        fail(
            fmt::format("{}: in a composition X+Y, X must select layers (every:K, block:N or ratio:R) "
                        "and Y must be selective (modules:[...] or ops:[...]); got X = '{}' and Y = '{}'.",
                        origin_, plus[0], plus[1]));
      }
      for (int64_t i = 0; i < n_; ++i) {
        plan.layers[i].dropped = selected->second[i] ? SlotMask::droppable() : rest->dropped(i);
      }
      plan.policy = selected->first + "+" + rest->canonical;
      return plan;
    }
    if (s == "none") {
      plan.policy = "none";
      return plan;
    }
    if (s == "full") {
      for (auto& l : plan.layers) l.dropped = SlotMask::droppable();
      plan.policy = "full";
      return plan;
    }
    if (starts_with(s, "uniform:")) {
      const int64_t size = count(s, "uniform", "N", s.substr(8),
                                 "uniform:N recomputes chunks of N consecutive layers from each chunk's input");
      for (size_t st = 0; st < layout_.size.size(); ++st) {
        for (int64_t j = 0; j < layout_.size[st]; ++j) {
          const int64_t i = layout_.first[st] + j;
          plan.layers[i].dropped = SlotMask::droppable();
          // The chunk's first layer keeps its input like a full layer (-1); the others
          // point at it. uniform:1 is therefore the same plan as full.
          const int64_t begin = layout_.first[st] + (j / size) * size;
          plan.layers[i].chunk_begin = begin == i ? -1 : begin;
        }
      }
      plan.policy = "uniform:" + std::to_string(size);
      return plan;
    }
    if (starts_with(s, "layers:")) return layers(s);
    if (const auto sel = select(s)) {
      for (int64_t i = 0; i < n_; ++i) {
        if (sel->second[i]) plan.layers[i].dropped = SlotMask::droppable();
      }
      plan.policy = sel->first;
      return plan;
    }
    if (const auto part = selective(s)) {
      for (int64_t i = 0; i < n_; ++i) plan.layers[i].dropped = part->dropped(i);
      plan.policy = part->canonical;
      return plan;
    }
    fail(fmt::format("{}: '{}' is not a recompute policy; {}", origin_, s, valid_forms()));
  }

  static std::string valid_forms() {
    return "valid forms are none, full, every:K, uniform:N, block:N, ratio:R, modules:[...], ops:[...], "
           "layers:[...] and X+Y (X one of every:K, block:N, ratio:R; Y one of modules:[...], ops:[...]), each "
           "optionally followed by +offload:[slots or modules] (in some layers: +offload(block:N):[...]).";
  }

  std::string model_size() const {
    return layout_.size.size() == 1
               ? fmt::format("the model, which has {} layers", n_)
               : fmt::format("the smallest pipeline stage, which has {} layers", layout_.smallest());
  }

  // The whole number of every:K / uniform:N / block:N, checked against the model.
  int64_t count(const std::string& whole, const std::string& kind, const char* letter, const std::string& text,
                const std::string& meaning, const std::string& none = "use none to recompute nothing") const {
    const auto v = parse_int(text);
    if (!v) {
      fail(fmt::format("{}: {} must be a whole number ({}), got '{}'.", origin_, letter, meaning, text));
    }
    if (*v < 1) {
      fail(fmt::format("{}: {} = {} must be at least 1 ({}); {}.", origin_, letter, *v, meaning, none));
    }
    const int64_t limit = kind == "every" ? n_ : layout_.smallest();
    if (*v > limit) {
      fail(fmt::format("{}: {} = {} is larger than {}; use {} between 1 and {}.", origin_, letter, *v,
                       kind == "every" ? fmt::format("the model, which has {} layers", n_) : model_size(), letter,
                       limit));
    }
    return *v;
  }

  // every:K, block:N, ratio:R -> canonical spelling and which layers are chosen: fully
  // recomputed, or (verb "offloads") offloading.
  std::optional<std::pair<std::string, std::vector<bool>>> select(const std::string& s,
                                                                  const std::string& verb = "recomputes") const {
    std::vector<bool> full(static_cast<size_t>(n_), false);
    const std::string none =
        verb == "offloads" ? "drop the offload term to offload nothing" : "use none to recompute nothing";
    if (starts_with(s, "every:")) {
      const int64_t k =
          count(s, "every", "K", s.substr(6), "every:K " + verb + " layers K, 2K, 3K, ... counted from 1", none);
      for (int64_t i = k - 1; i < n_; i += k) full[i] = true;
      return std::make_pair("every:" + std::to_string(k), full);
    }
    if (starts_with(s, "block:")) {
      const int64_t b =
          count(s, "block", "N", s.substr(6), "block:N " + verb + " the first N layers of each pipeline stage", none);
      for (size_t st = 0; st < layout_.size.size(); ++st) {
        for (int64_t j = 0; j < b; ++j) full[layout_.first[st] + j] = true;
      }
      return std::make_pair("block:" + std::to_string(b), full);
    }
    if (starts_with(s, "ratio:")) {
      const auto r = parse_real(s.substr(6));
      if (!r || *r < 0.0 || *r > 1.0) {
        fail(
            fmt::format("{}: R = {} is not a number in [0, 1]; ratio:R {} the first ceil(R x layers) "
                        "layers of each pipeline stage, e.g. ratio:0.5 for half of them.",
                        origin_, s.substr(6), verb));
      }
      for (size_t st = 0; st < layout_.size.size(); ++st) {
        // The small slack keeps 0.3 x 10 at 3 although the product rounds to 3.0000000000000004.
        const auto take = static_cast<int64_t>(std::ceil(*r * static_cast<double>(layout_.size[st]) - 1e-9));
        for (int64_t j = 0; j < take; ++j) full[layout_.first[st] + j] = true;
      }
      return std::make_pair(fmt::format("ratio:{}", *r), full);
    }
    return std::nullopt;
  }

  // The names inside "kind:[a,b]", checked against `table`, in the table's order.
  std::vector<std::string> names(const std::string& s, size_t prefix, const std::string& what,
                                 const std::vector<std::string>& valid) const {
    if (s.size() < prefix + 2 || s[prefix] != '[' || s.back() != ']') {
      fail(fmt::format("{}: '{}' must list {}s in brackets, e.g. {}[{}].", origin_, s, what, s.substr(0, prefix),
                       valid.front()));
    }
    const std::string body = s.substr(prefix + 1, s.size() - prefix - 2);
    std::set<std::string> given;
    for (const auto& n : split_top(body, ',')) {
      if (std::find(valid.begin(), valid.end(), n) == valid.end()) {
        fail(fmt::format("{}: unknown {} '{}'; valid {}s are {}.", origin_, what, n, what, join(valid, ", ")));
      }
      given.insert(n);
    }
    std::vector<std::string> out;
    for (const auto& v : valid) {
      if (given.count(v)) out.push_back(v);
    }
    return out;
  }

  std::optional<Selective> selective(const std::string& s) const {
    if (starts_with(s, "modules:")) {
      std::vector<std::string> valid;
      for (const auto& m : block_modules()) valid.push_back(m.first);
      const auto mods = names(s, 8, "module", valid);
      SlotMask dropped;
      for (const auto& m : block_modules()) {
        if (std::find(mods.begin(), mods.end(), m.first) != mods.end()) dropped |= SlotMask::of_names(m.second);
      }
      return Selective{"modules:[" + join(mods, ",") + "]", [dropped](int64_t) { return dropped; }};
    }
    if (starts_with(s, "ops:")) {
      std::vector<std::string> valid;
      for (const auto& o : op_kinds()) {
        valid.push_back(o.first);
        if (o.first == "matmul") valid.push_back("matmul/2");
      }
      const auto ops = names(s, 4, "op kind", valid);
      const bool every_other = std::find(ops.begin(), ops.end(), "matmul/2") != ops.end();
      if (every_other && std::find(ops.begin(), ops.end(), "matmul") != ops.end()) {
        fail(
            fmt::format("{}: '{}' lists both matmul (keep every layer's matmul outputs) and matmul/2 (keep "
                        "them in every other layer); give one of them.",
                        origin_, s));
      }
      SlotMask kept_always;
      for (const auto& o : op_kinds()) {
        if (std::find(ops.begin(), ops.end(), o.first) != ops.end()) kept_always |= SlotMask::of_names(o.second);
      }
      const SlotMask matmul_slots = SlotMask::of_names(op_kinds().front().second);
      auto dropped = [kept_always, every_other, matmul_slots](int64_t layer) {
        const SlotMask kept = every_other && layer % 2 == 0 ? kept_always | matmul_slots : kept_always;
        SlotMask out;
        for (const Slot slot : SlotMask::droppable().slots()) {
          if (!kept.has(slot)) out.add(slot);
        }
        return out;
      };
      return Selective{"ops:[" + join(ops, ",") + "]", dropped};
    }
    return std::nullopt;
  }

  ActivationPlan layers(const std::string& s) const {
    if (s.size() < 9 || s[7] != '[' || s.back() != ']') {
      fail(fmt::format("{}: '{}' must list one entry per layer in brackets, e.g. layers:[full,none,modules:core_attn].",
                       origin_, s));
    }
    const auto entries = split_top(s.substr(8, s.size() - 9), ',');
    if (static_cast<int64_t>(entries.size()) != n_) {
      fail(
          fmt::format("{}: layers:[...] lists {} entries but the model has {} layers; give exactly one entry "
                      "per layer.",
                      origin_, entries.size(), n_));
    }
    ActivationPlan plan;
    plan.layers.assign(static_cast<size_t>(n_), LayerPlan{});
    std::vector<std::string> canon;
    for (int64_t i = 0; i < n_; ++i) {
      std::string e = entries[i];
      if (e == "full") {
        plan.layers[i].dropped = SlotMask::droppable();
        canon.push_back(e);
        continue;
      }
      if (e == "none") {
        canon.push_back(e);
        continue;
      }
      if (starts_with(e, "modules:") && e.size() > 8 && e[8] != '[') e = "modules:[" + e.substr(8) + "]";
      const auto part = selective(e);
      if (!part) {
        fail(
            fmt::format("{}: entry {} of layers:[...] is '{}'; an entry is full, none, modules:NAME, "
                        "modules:[...] or ops:[...].",
                        origin_, i + 1, e));
      }
      plan.layers[i].dropped = part->dropped(i);
      canon.push_back(part->canonical);
    }
    plan.policy = "layers:[" + join(canon, ",") + "]";
    return plan;
  }

  std::string origin_;
  int64_t n_;
  StageSplit layout_;
};

std::string quoted(const std::optional<std::string>& v) { return "\"" + *v + "\""; }
// ac.ac_option as written: a number bare, a word quoted.
std::string option_text(const std::optional<std::string>& v) { return parse_int(*v) ? *v : quoted(v); }
std::string boolean(bool b) { return b ? "true" : "false"; }

/// A policy asked for by one spelling: where it came from and its plan.
struct Candidate {
  std::string origin;
  ActivationPlan plan;
};

StageSplit stage_layout(const AcConfig& ac, int64_t n) {
  if (ac.stages < 1) fail(fmt::format("ac.stages must be at least 1 (pipeline stages), got {}.", ac.stages));
  if (ac.stages > n) {
    fail(fmt::format("ac.stages = {} is more pipeline stages than the model has layers ({}); use at most {}.",
                     ac.stages, n, n));
  }
  StageSplit layout;
  if (ac.num_layers_per_stage) {
    const auto sizes = int_list("ac.num_layers_per_stage", *ac.num_layers_per_stage);
    if (static_cast<int64_t>(sizes.size()) != ac.stages) {
      fail(
          fmt::format("ac.num_layers_per_stage = {} lists {} stages but ac.stages = {}; give one entry per "
                      "pipeline stage.",
                      list_text(sizes), sizes.size(), ac.stages));
    }
    int64_t sum = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      if (sizes[i] < 1) {
        fail(fmt::format("ac.num_layers_per_stage = {}: stage {} has {} layers; every stage needs at least one.",
                         list_text(sizes), i + 1, sizes[i]));
      }
      sum += sizes[i];
    }
    if (sum != n) {
      fail(
          fmt::format("ac.num_layers_per_stage = {} sums to {} layers but the model has {}; the stages must "
                      "split exactly the model's layers.",
                      list_text(sizes), sum, n));
    }
    layout.size = sizes;
  } else {
    layout.size = pipeline::even_split(n, ac.stages);  // the first stages take one more layer
  }
  int64_t first = 0;
  for (auto s : layout.size) {
    layout.first.push_back(first);
    first += s;
  }
  return layout;
}

void torchtune(const AcConfig& ac, std::vector<Candidate>& out,
               const std::function<ActivationPlan(std::string, std::string)>& compile) {
  const bool mode_or_option = ac.ac_mode || ac.ac_option;
  const std::string what = ac.ac_mode     ? "ac.ac_mode = " + quoted(ac.ac_mode)
                           : ac.ac_option ? "ac.ac_option = " + option_text(ac.ac_option)
                                          : "";
  if (!ac.enable_activation_checkpointing) {
    if (mode_or_option) {
      fail(
          fmt::format("{} is given without ac.enable_activation_checkpointing; set "
                      "ac.enable_activation_checkpointing = true with it (or use ac.policy).",
                      what));
    }
    return;
  }
  if (!*ac.enable_activation_checkpointing) {
    if (mode_or_option) {
      fail(
          fmt::format("ac.enable_activation_checkpointing = false turns recompute off, but {} asks for it: two "
                      "spellings of the same setting disagree. Set ac.enable_activation_checkpointing = true to use "
                      "it, or drop {}.",
                      what, ac.ac_mode ? "ac.ac_mode" : "ac.ac_option"));
    }
    out.push_back(
        {"ac.enable_activation_checkpointing = false", compile("none", "ac.enable_activation_checkpointing = false")});
    return;
  }
  if (!ac.ac_mode) {
    if (ac.ac_option) {
      fail(
          fmt::format("ac.ac_option = {} needs ac.ac_mode = \"selective\"; it chooses which layers or ops "
                      "selective recompute covers.",
                      option_text(ac.ac_option)));
    }
    out.push_back(
        {"ac.enable_activation_checkpointing = true", compile("full", "ac.enable_activation_checkpointing = true")});
    return;
  }
  if (*ac.ac_mode == "full") {
    if (ac.ac_option) {
      fail(
          fmt::format("ac.ac_option = {} applies only to ac.ac_mode = \"selective\"; with ac.ac_mode = \"full\" "
                      "every layer is recomputed. Drop ac.ac_option or set ac.ac_mode = \"selective\".",
                      option_text(ac.ac_option)));
    }
    out.push_back({"ac.ac_mode = \"full\"", compile("full", "ac.ac_mode = \"full\"")});
    return;
  }
  if (*ac.ac_mode != "selective") {
    fail(fmt::format("ac.ac_mode must be \"full\" or \"selective\", got {}.", quoted(ac.ac_mode)));
  }
  if (!ac.ac_option) {
    fail(
        "ac.ac_mode = \"selective\" needs ac.ac_option: a whole number K (recompute every K-th layer, every:K) "
        "or \"op\" (keep matmul and attention outputs, ops:[matmul,attention]).");
  }
  const std::string origin = "ac.ac_option = " + option_text(ac.ac_option);
  if (*ac.ac_option == "op") {
    out.push_back({origin, compile("ops:[matmul,attention]", origin)});
    return;
  }
  if (!parse_int(*ac.ac_option)) {
    fail(fmt::format("{}: ac.ac_option must be a whole number K (every K-th layer) or \"op\".", origin));
  }
  out.push_back({origin, compile("every:" + *ac.ac_option, origin)});
}

void megatron(const AcConfig& ac, std::vector<Candidate>& out,
              const std::function<ActivationPlan(std::string, std::string)>& compile) {
  std::optional<std::string> gran = ac.recompute_granularity;
  std::string gran_origin = gran ? "ac.recompute_granularity = " + quoted(gran) : "";
  if (ac.recompute_activations && *ac.recompute_activations) {
    if (gran && *gran != "selective") {
      fail(
          fmt::format("ac.recompute_activations = true means selective recompute, but {} asks for another "
                      "granularity: two spellings of the same setting disagree. Drop one of them.",
                      gran_origin));
    }
    if (!gran) gran_origin = "ac.recompute_activations = true";
    gran = "selective";
  }
  if (gran && *gran != "full" && *gran != "selective") {
    fail(fmt::format("ac.recompute_granularity must be \"full\" or \"selective\", got {}.", quoted(gran)));
  }
  if (ac.recompute_num_layers && *ac.recompute_num_layers < 1) {
    fail(
        fmt::format("ac.recompute_num_layers must be at least 1, got {}; it is the chunk size of "
                    "recompute_method = \"uniform\" or the layers per stage of \"block\".",
                    *ac.recompute_num_layers));
  }
  const bool selective = gran && *gran == "selective";
  if (ac.recompute_method && (selective || !gran)) {
    fail(
        fmt::format("ac.recompute_method = {} is given with {}; a recompute method chooses layers to recompute "
                    "whole, which only full granularity does. Set ac.recompute_granularity = \"full\" with the "
                    "method, or drop ac.recompute_method (to combine both, write e.g. "
                    "ac.policy = \"block:2+modules:[core_attn]\").",
                    quoted(ac.recompute_method),
                    selective ? "selective granularity (" + gran_origin + ")" : "no ac.recompute_granularity"));
  }
  if (ac.recompute_num_layers && (selective || !gran)) {
    fail(
        fmt::format("ac.recompute_num_layers = {} is given with {}; it only counts layers for full granularity "
                    "with a recompute method. Drop it, or set ac.recompute_granularity = \"full\" and "
                    "ac.recompute_method.",
                    *ac.recompute_num_layers,
                    selective ? "selective granularity (" + gran_origin + ")" : "no ac.recompute_granularity"));
  }
  if (gran && *gran == "full") {
    if (ac.recompute_modules) {
      fail(
          fmt::format("ac.recompute_modules = {} applies only to selective granularity, but "
                      "ac.recompute_granularity = \"full\" recomputes whole layers. Drop one of them.",
                      quoted(ac.recompute_modules)));
    }
    if (!ac.recompute_method || !ac.recompute_num_layers) {
      fail(fmt::format(
          "ac.recompute_granularity = \"full\" needs {}: \"uniform\" with N recomputes chunks of N "
          "layers, \"block\" with N the first N layers of each stage (e.g. recompute_method = "
          "\"uniform\", recompute_num_layers = 1). To recompute every layer, use ac.policy = \"full\".",
          !ac.recompute_method && !ac.recompute_num_layers ? "ac.recompute_method and ac.recompute_num_layers"
          : !ac.recompute_method                           ? "ac.recompute_method"
                                                           : "ac.recompute_num_layers"));
    }
    if (*ac.recompute_method != "uniform" && *ac.recompute_method != "block") {
      fail(fmt::format("ac.recompute_method must be \"uniform\" or \"block\", got {}.", quoted(ac.recompute_method)));
    }
    const std::string origin = fmt::format("ac.recompute_method = {} with ac.recompute_num_layers = {}",
                                           quoted(ac.recompute_method), *ac.recompute_num_layers);
    out.push_back({origin, compile(*ac.recompute_method + ":" + std::to_string(*ac.recompute_num_layers), origin)});
  } else if (selective || ac.recompute_modules) {
    std::string mods = "core_attn";
    std::string origin = gran_origin;
    if (ac.recompute_modules) {
      mods = join(split_list(*ac.recompute_modules), ",");
      origin = "ac.recompute_modules = " + quoted(ac.recompute_modules);
      if (mods.empty()) {
        fail("ac.recompute_modules is empty; list the submodules to recompute (e.g. \"core_attn\"), or drop it.");
      }
    }
    out.push_back({origin, compile("modules:[" + mods + "]", origin)});
  }
}

void colossalai(const AcConfig& ac, const StageSplit& layout, std::vector<Candidate>& out,
                const std::function<ActivationPlan(std::string, std::string)>& compile) {
  if (ac.gradient_checkpointing_ratio) {
    const double r = *ac.gradient_checkpointing_ratio;
    const std::string origin = fmt::format("ac.gradient_checkpointing_ratio = {}", r);
    if (!(r >= 0.0 && r <= 1.0)) {
      fail(
          fmt::format("{} is outside [0, 1]; it is the share of each pipeline stage's layers that is recomputed, "
                      "e.g. 0.5 for half of them.",
                      origin));
    }
    out.push_back({origin, compile(fmt::format("ratio:{}", r), origin)});
  }
  if (ac.num_ckpt_layers_per_stage) {
    const auto counts = int_list("ac.num_ckpt_layers_per_stage", *ac.num_ckpt_layers_per_stage);
    const std::string origin = "ac.num_ckpt_layers_per_stage = " + list_text(counts);
    if (counts.size() != layout.size.size()) {
      fail(fmt::format("{} lists {} stages but ac.stages = {}; give one entry per pipeline stage.", origin,
                       counts.size(), layout.size.size()));
    }
    for (size_t s = 0; s < counts.size(); ++s) {
      if (counts[s] < 0 || counts[s] > layout.size[s]) {
        fail(
            fmt::format("{} asks for {} recomputed layers in stage {}, which has {} layers; each entry must be "
                        "between 0 and its stage's layer count.",
                        origin, counts[s], s + 1, layout.size[s]));
      }
    }
    const bool same = std::all_of(counts.begin(), counts.end(), [&](int64_t c) { return c == counts.front(); });
    std::string policy;
    if (same) {
      policy = counts.front() == 0 ? "none" : "block:" + std::to_string(counts.front());
    } else {
      std::vector<std::string> entries;
      for (size_t s = 0; s < counts.size(); ++s) {
        for (int64_t j = 0; j < layout.size[s]; ++j) entries.push_back(j < counts[s] ? "full" : "none");
      }
      policy = "layers:[" + join(entries, ",") + "]";
    }
    out.push_back({origin, compile(policy, origin)});
  }
}

void nanotron(const AcConfig& ac, std::vector<Candidate>& out,
              const std::function<ActivationPlan(std::string, std::string)>& compile) {
  if (ac.recompute_layer) {
    const std::string origin = "ac.recompute_layer = " + boolean(*ac.recompute_layer);
    out.push_back({origin, compile(*ac.recompute_layer ? "full" : "none", origin)});
  }
}

// Megatron's --offload-modules names that have a remat counterpart, and the slots each
// moves: what its module saves for the backward (core attention: q, k, v and the softmax).
const std::vector<std::pair<std::string, SlotMask>>& megatron_offload_names() {
  static const std::vector<std::pair<std::string, SlotMask>> modules = {
      {"attn_norm", {Slot::input, Slot::attn_norm}},
      {"qkv_linear", {Slot::attn_qkv_in, Slot::attn_gathered}},
      {"core_attn", {Slot::attn_qkv, Slot::attn_probs, Slot::attn_dropout}},
      {"attn_proj", {Slot::attn_proj_in}},
      {"mlp_norm", {Slot::mlp_norm}},
      {"layer_input", {Slot::input}},
  };
  return modules;
}

/// An offload asked for by a framework's key: where it came from and its offload term.
struct OffloadAsk {
  std::string origin;
  std::string term;
};

// Every slot a layer keeps: torchtune's and TransformerEngine's whole-layer offload.
const char* const kEveryKeptSlot = ":[input,attn,mlp,mlp.norm]";

OffloadAsk offload_modules_alias(const std::string& value, const ActivationPlan& plan) {
  const std::string origin = "ac.offload_modules = \"" + value + "\"";
  std::vector<std::string> mapped;
  for (const auto& m : megatron_offload_names()) mapped.push_back(m.first);
  const auto names = split_list(value);
  if (names.empty()) {
    fail(
        fmt::format("ac.offload_modules is empty; list the modules whose saved inputs go to host memory ({}), "
                    "or drop it.",
                    join(mapped, ", ")));
  }
  SlotMask slots;
  for (const auto& n : names) {
    const auto m = std::find_if(megatron_offload_names().begin(), megatron_offload_names().end(),
                                [&](const auto& module) { return module.first == n; });
    if (m != megatron_offload_names().end()) {
      slots |= m->second;
      continue;
    }
    const bool moe = n == "expert_fc1" || n == "moe_act" || n == "fused_group_mlp";
    fail(fmt::format("{}: {}; the names that map are {} (the dense MLP's slots: ac.policy = \"P+offload:[mlp]\").",
                     origin,
                     moe ? n + " offloads activations of MoE experts, and remat's blocks have none"
                         : "'" + n + "' is not one of Megatron's offload modules",
                     join(mapped, ", ")));
  }
  if (std::find(names.begin(), names.end(), "layer_input") != names.end()) {
    // Megatron's layer_input is the input a full recompute restarts from; it needs full
    // granularity, where every input a layer keeps is one.
    const auto everything = SlotMask::droppable();
    for (size_t i = 0; i < plan.layers.size(); ++i) {
      if (plan.layers[i].chunk_begin < 0 && plan.layers[i].dropped != everything) {
        fail(
            fmt::format("{}: layer_input moves the input each recomputed layer restarts from, but the policy {} "
                        "keeps layer {}'s input without recomputing that layer whole; Megatron allows layer_input "
                        "only with full recompute, so choose full or uniform:N (ac.recompute_granularity = "
                        "\"full\" with ac.recompute_method = \"uniform\"), or drop layer_input.",
                        origin, plan.policy, i + 1));
      }
    }
  }
  return {origin, "offload:[" + join(slots.names(), ",") + "]"};
}

// The offloads the framework keys ask for, each checked.
std::vector<OffloadAsk> offload_aliases(const AcConfig& ac, const StageSplit& layout, const ActivationPlan& plan) {
  std::vector<OffloadAsk> out;
  if (ac.enable_activation_offloading && *ac.enable_activation_offloading) {
    out.push_back({"ac.enable_activation_offloading = true", std::string("offload") + kEveryKeptSlot});
  }
  if (ac.offload_modules) out.push_back(offload_modules_alias(*ac.offload_modules, plan));
  if (ac.cpu_offloading_num_layers) {
    // Megatron's --cpu-offloading: TransformerEngine offloads every activation of the first
    // N layers and allows 0 <= N < layers; N = 0 would offload nothing.
    const int64_t n = *ac.cpu_offloading_num_layers;
    const std::string origin = fmt::format("ac.cpu_offloading_num_layers = {}", n);
    const int64_t most = layout.smallest() - 1;
    const std::string where =
        layout.size.size() == 1 ? "the model's layers" : "the layers of the smallest pipeline stage";
    if (n < 1) {
      fail(
          fmt::format("{} offloads no layer; give N of at least 1 (the first N layers of each pipeline stage keep "
                      "every slot in host memory), or drop it.",
                      origin));
    }
    if (n > most) {
      fail(
          fmt::format("{} is not less than {} ({}): Megatron offloads all but the last layer at most, whose "
                      "backward follows its forward at once; give N below {}, or offload every layer with "
                      "ac.enable_activation_offloading = true.",
                      origin, where, layout.smallest(), layout.smallest()));
    }
    out.push_back({origin, fmt::format("offload(block:{}){}", n, kEveryKeptSlot)});
  }
  return out;
}

bool recomputes_anything(const ActivationPlan& p) {
  return std::any_of(p.layers.begin(), p.layers.end(),
                     [](const LayerPlan& l) { return !l.dropped.empty() || l.chunk_begin >= 0; });
}

}  // namespace

bool same_layers(const ActivationPlan& a, const ActivationPlan& b) {
  if (a.layers.size() != b.layers.size()) return false;
  for (size_t i = 0; i < a.layers.size(); ++i) {
    if (a.layers[i].dropped != b.layers[i].dropped || a.layers[i].chunk_begin != b.layers[i].chunk_begin ||
        a.layers[i].input_sharded != b.layers[i].input_sharded || a.layers[i].attention != b.layers[i].attention ||
        a.layers[i].offloaded != b.layers[i].offloaded || a.layers[i].prefetch != b.layers[i].prefetch) {
      return false;
    }
  }
  return true;
}

std::vector<int64_t> stage_sizes(const AcConfig& ac, int64_t n_layers) { return stage_layout(ac, n_layers).size; }

ActivationPlan compile_policy(const AcConfig& ac, int64_t n_layers, double dropout) {
  if (n_layers < 1) fail(fmt::format("A recompute plan needs at least one layer, got {}.", n_layers));
  if (ac.check != "none" && ac.check != "meta" && ac.check != "values") {
    fail(fmt::format("ac.check must be \"none\", \"meta\" or \"values\", got \"{}\".", ac.check));
  }
  const StageSplit layout = stage_layout(ac, n_layers);
  auto compile = [&](const std::string& policy, const std::string& origin) {
    return Parser(origin, n_layers, layout).parse(policy);
  };

  std::vector<Candidate> asked;
  if (ac.policy) {
    const std::string origin = "ac.policy = \"" + *ac.policy + "\"";
    asked.push_back({origin, compile(*ac.policy, origin)});
  }
  torchtune(ac, asked, compile);
  megatron(ac, asked, compile);
  colossalai(ac, layout, asked, compile);
  nanotron(ac, asked, compile);

  ActivationPlan plan = asked.empty() ? compile("none", "ac.policy") : asked.front().plan;
  for (size_t i = 1; i < asked.size(); ++i) {
    if (!same_layers(asked.front().plan, asked[i].plan)) {
      fail(
          fmt::format("{} asks for {} but {} asks for {}: two spellings of the recompute policy disagree. "
                      "Set only one of them.",
                      asked.front().origin, asked.front().plan.policy, asked[i].origin, asked[i].plan.policy));
    }
  }
  // The offload keys add their term to the recompute plan the other keys agreed on; a
  // second offload, or an offload term in ac.policy beside them, is refused.
  const auto offloads = offload_aliases(ac, layout, plan);
  if (!offloads.empty()) {
    const std::string first = plan.offloads() ? asked.front().origin : offloads[0].origin;
    const std::string second = plan.offloads() ? offloads[0].origin : offloads.size() > 1 ? offloads[1].origin : "";
    if (!second.empty()) {
      fail(
          fmt::format("{} and {} both choose what moves to host memory; give the offload once (ac.policy = "
                      "\"P+offload:[...]\" or one of the offload keys).",
                      first, second));
    }
    Parser(offloads[0].origin, n_layers, layout).offload(offloads[0].term, plan);
  }

  if (ac.tp_recompute_allgather && *ac.tp_recompute_allgather) {
    // nanotron's default: the gathered inputs of the column-parallel linears are never kept
    // (so not offloaded either).
    for (auto& l : plan.layers) {
      for (const auto& m : block_modules()) {
        if (m.first != "gathered") continue;
        for (const Slot s : SlotMask::of_names(m.second).slots()) {
          l.dropped.add(s);
          l.offloaded.remove(s);
        }
      }
    }
    plan.policy += " (tp_recompute_allgather)";
  }
  if (ac.distribute_saved_activations && *ac.distribute_saved_activations) {
    // Megatron's: the input of every layer recomputed whole (a uniform chunk's first layer,
    // a block:N layer, a full layer) is kept as this rank's share.
    const auto everything = SlotMask::droppable();
    // With no recompute it has nothing to act on (a sweep's `none`); a selective policy
    // alone is a misunderstanding: it keeps every input whole.
    for (auto& l : plan.layers) l.input_sharded = l.chunk_begin < 0 && l.dropped == everything;
    if (std::none_of(plan.layers.begin(), plan.layers.end(), [](const LayerPlan& l) { return l.input_sharded; })) {
      if (recomputes_anything(plan)) {
        fail(
            fmt::format("ac.distribute_saved_activations = true keeps the input of each layer recomputed whole as a "
                        "share per tensor-parallel rank, but the policy {} recomputes no layer whole; choose full, "
                        "uniform:N or block:N (Megatron: ac.recompute_granularity = \"full\" with a method), or "
                        "drop ac.distribute_saved_activations.",
                        plan.policy));
      }
    } else {
      plan.policy += " (distribute_saved_activations)";
    }
    for (size_t i = 0; i < plan.layers.size(); ++i) {
      if (plan.layers[i].input_sharded && plan.layers[i].offloaded.has(Slot::input)) {
        fail(
            fmt::format("ac.distribute_saved_activations = true keeps layer {}'s input as a share per "
                        "tensor-parallel rank, and the policy {} offloads that input to host memory: a kept input "
                        "is held one way. Drop input from offload:[...], or drop "
                        "ac.distribute_saved_activations.",
                        i + 1, plan.policy));
      }
    }
  }
  if (ac.offload_prefetch) {
    if (!ac.budget.empty()) {
      fail(
          fmt::format("ac.budget = \"{}\" lets the planner choose, per layer, when offloaded slots come back, but "
                      "ac.offload_prefetch = true fixes that choice; keep one of them.",
                      ac.budget));
    }
    for (size_t s = 0; s < layout.first.size(); ++s) {
      const int64_t end = layout.first[s] + layout.size[s];
      for (int64_t l = layout.first[s]; l < end; ++l) {
        plan.layers[static_cast<size_t>(l)].prefetch = plan.may_prefetch(l, end);
      }
    }
    if (std::none_of(plan.layers.begin(), plan.layers.end(), [](const LayerPlan& l) { return l.prefetch; })) {
      fail(
          fmt::format("ac.offload_prefetch = true brings a layer's offloaded slots back during the backward of the "
                      "layer above, but under the policy {} no layer offloads below another of its stage outside a "
                      "uniform chunk; add an offload term (ac.policy = \"P+offload:[input,mlp]\") or drop "
                      "ac.offload_prefetch.",
                      plan.policy));
    }
    plan.policy += " (offload_prefetch)";
  }
  if (dropout > 0.0 && !ac.preserve_rng_state && !ac.allow_rng_mismatch && recomputes_anything(plan)) {
    fail(
        fmt::format("ac.preserve_rng_state = false with dropout {} makes recomputed dropout draw other masks than "
                    "the forward did, which silently changes training; keep ac.preserve_rng_state = true, or set "
                    "ac.allow_rng_mismatch = true to accept the mismatch.",
                    dropout));
  }
  return plan;
}

// GCC 12 warns, wrongly, that assigning the empty optional reads an uninitialized string.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
ActivationPlan compile_policy(const std::string& policy, int64_t n_layers, double dropout) {
  AcConfig ac;
  ac.policy = policy;
  return compile_policy(ac, n_layers, dropout);
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

std::string explain_plan(const ActivationPlan& plan) {
  struct Row {
    std::string layers, keeps, drops, chunk, attention, offloads;
  };
  // The attention column only where the plan chooses the op per layer (model.attention =
  // auto), the offload column only where it offloads.
  const bool per_layer_op =
      std::any_of(plan.layers.begin(), plan.layers.end(), [](const LayerPlan& l) { return l.attention.has_value(); });
  const bool offloads = plan.offloads();
  std::vector<Row> rows;
  const auto n = static_cast<int64_t>(plan.layers.size());
  for (int64_t i = 0; i < n;) {
    int64_t j = i;
    while (j + 1 < n && plan.layers[j + 1].dropped == plan.layers[i].dropped &&
           plan.layers[j + 1].chunk_begin == plan.layers[i].chunk_begin &&
           plan.layers[j + 1].input_sharded == plan.layers[i].input_sharded &&
           plan.layers[j + 1].attention == plan.layers[i].attention &&
           plan.layers[j + 1].offloaded == plan.layers[i].offloaded &&
           plan.layers[j + 1].prefetch == plan.layers[i].prefetch && plan.chunk_of(j + 1) == plan.chunk_of(i)) {
      ++j;
    }
    const LayerPlan& l = plan.layers[i];
    Row r;
    r.layers = i == j ? std::to_string(i + 1) : fmt::format("{}-{}", i + 1, j + 1);
    std::vector<std::string> kept, dropped;
    for (const auto& s : block_slots()) (l.dropped.has(slot_of_name(s)) ? dropped : kept).push_back(s);
    if (l.chunk_begin >= 0) {
      r.keeps = fmt::format("nothing (recomputed from layer {}'s input)", l.chunk_begin + 1);
    } else {
      const std::string input = l.input_sharded ? "block input (a share per tensor-parallel rank)" : "block input";
      if (dropped.empty()) {
        r.keeps = l.input_sharded ? "all, " + input : "all";
      } else if (kept.empty()) {
        r.keeps = input + " only";
      } else {
        r.keeps = input + ", " + join(kept, ", ");
      }
    }
    r.drops = dropped.empty() ? "-" : kept.empty() ? "all" : join(dropped, ", ");
    r.attention = l.attention ? attention_name(*l.attention) : "-";
    r.offloads = l.offloaded.empty() ? "-" : join(l.offloaded.names(), ", ");
    if (l.prefetch) r.offloads += " (back during the backward of the layer above)";
    const int64_t chunk = plan.chunk_of(i);
    if (chunk >= 0) {
      r.chunk = fmt::format("{}-{}", chunk + 1, plan.chunk_end(chunk) + 1);
    } else {
      r.chunk = "-";
    }
    rows.push_back(r);
    i = j + 1;
  }
  size_t w_layers = 6, w_keeps = 5, w_drops = 5;
  for (const auto& r : rows) {
    w_layers = std::max(w_layers, r.layers.size());
    w_keeps = std::max(w_keeps, r.keeps.size());
    w_drops = std::max(w_drops, r.drops.size());
  }
  std::string out = fmt::format("policy: {} ({} layers, numbered from 1)\n", plan.policy, n);
  const auto line = [&](const Row& r) {
    std::string text =
        fmt::format("{:<{}}  {:<{}}  {:<{}}  {:<5}", r.layers, w_layers, r.keeps, w_keeps, r.drops, w_drops, r.chunk);
    if (per_layer_op) text += fmt::format("  {:<9}", r.attention);
    if (offloads) text += "  " + r.offloads;
    while (!text.empty() && text.back() == ' ') text.pop_back();
    return text + "\n";
  };
  out += line({"layers", "keeps", "drops", "chunk", "attention", "offloaded to host"});
  for (const auto& r : rows) out += line(r);
  return out;
}

ActivationPlan validate_plan(const Config& c) {
  const std::string why = ops::attention_refusal(c.model.attention, c.model.dropout, c.run.device != "cpu",
                                                 dtype_of(c.run.dtype), c.model.head_dim());
  if (!why.empty()) fail(why);
  const ActivationPlan plan = compile_policy(c.ac, c.model.n_layer, c.model.dropout);
  if (!c.ac.host_budget.empty()) parse_host_budget(c.ac.host_budget, 1);
  if (!c.ac.budget.empty()) {
    parse_budget(c.ac.budget, 1);
    if (c.ac.policy || plan.policy != "none") {
      fail(
          fmt::format("ac.budget = \"{}\" asks the planner for the plan, but the ac settings also choose the policy "
                      "\"{}\"; keep one of them.",
                      c.ac.budget, plan.policy));
    }
  }
  return plan;
}

Config load_run_config(const std::string& toml_path, const std::vector<std::string>& overrides) {
  Config c = load_config(toml_path, overrides);
  validate_plan(c);
  return c;
}

}  // namespace remat
