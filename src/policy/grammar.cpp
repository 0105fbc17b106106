#include "policy/grammar.h"

#include "util/number.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <set>
#include <stdexcept>

namespace remat::policy {

void fail(const std::string& msg) { throw std::invalid_argument(msg); }

std::string join(const std::vector<std::string>& parts, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) out += (i ? sep : "") + parts[i];
  return out;
}

namespace {

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

std::string valid_forms() {
  return "valid forms are none, full, every:K, uniform:N, block:N, ratio:R, modules:[...], ops:[...], "
         "layers:[...] and X+Y (X one of every:K, block:N, ratio:R; Y one of modules:[...], ops:[...]), each "
         "optionally followed by +offload:[slots or modules] (in some layers: +offload(block:N):[...]).";
}

}  // namespace

std::vector<std::string> split_list(const std::string& s) {
  std::string t = strip_spaces(s);
  if (t.size() >= 2 && t.front() == '[' && t.back() == ']') t = t.substr(1, t.size() - 2);
  if (t.empty()) return {};
  return split_top(t, ',');
}

std::vector<int64_t> int_list(const std::string& key, const std::string& value) {
  std::vector<int64_t> out;
  for (const auto& e : split_list(value)) {
    const auto v = util::parse_int(e);
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

int64_t StageSplit::smallest() const { return *std::min_element(size.begin(), size.end()); }

Parser::Parser(std::string origin, int64_t n_layers, StageSplit split)
    : origin_(std::move(origin)), n_(n_layers), split_(std::move(split)) {}

ActivationPlan Parser::parse(const std::string& raw) {
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

void Parser::offload(const std::string& term, ActivationPlan& plan) const {
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

// The policy without its offload term.
ActivationPlan Parser::recompute(const std::string& s) {
  ActivationPlan plan = ActivationPlan::none(n_);
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
  if (s == "none") return plan;
  if (s == "full") {
    for (auto& l : plan.layers) l.dropped = SlotMask::droppable();
    plan.policy = "full";
    return plan;
  }
  if (starts_with(s, "uniform:")) {
    const int64_t size = count("uniform", "N", s.substr(8),
                               "uniform:N recomputes chunks of N consecutive layers from each chunk's input");
    for (size_t st = 0; st < split_.size.size(); ++st) {
      for (int64_t j = 0; j < split_.size[st]; ++j) {
        const int64_t i = split_.first[st] + j;
        plan.layers[i].dropped = SlotMask::droppable();
        // The chunk's first layer keeps its input like a full layer (-1); the others
        // point at it. uniform:1 is therefore the same plan as full.
        const int64_t begin = split_.first[st] + (j / size) * size;
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

std::string Parser::model_size() const {
  return split_.size.size() == 1 ? fmt::format("the model, which has {} layers", n_)
                                 : fmt::format("the smallest pipeline stage, which has {} layers", split_.smallest());
}

// The whole number of every:K / uniform:N / block:N, checked against the model.
int64_t Parser::count(const std::string& kind, const char* letter, const std::string& text, const std::string& meaning,
                      const std::string& none) const {
  const auto v = util::parse_int(text);
  if (!v) {
    fail(fmt::format("{}: {} must be a whole number ({}), got '{}'.", origin_, letter, meaning, text));
  }
  if (*v < 1) {
    fail(fmt::format("{}: {} = {} must be at least 1 ({}); {}.", origin_, letter, *v, meaning, none));
  }
  const int64_t limit = kind == "every" ? n_ : split_.smallest();
  if (*v > limit) {
    fail(fmt::format("{}: {} = {} is larger than {}; use {} between 1 and {}.", origin_, letter, *v,
                     kind == "every" ? fmt::format("the model, which has {} layers", n_) : model_size(), letter,
                     limit));
  }
  return *v;
}

// every:K, block:N, ratio:R -> canonical spelling and which layers are chosen: fully
// recomputed, or (verb "offloads") offloading.
std::optional<std::pair<std::string, std::vector<bool>>> Parser::select(const std::string& s,
                                                                        const std::string& verb) const {
  std::vector<bool> full(static_cast<size_t>(n_), false);
  const std::string none =
      verb == "offloads" ? "drop the offload term to offload nothing" : "use none to recompute nothing";
  if (starts_with(s, "every:")) {
    const int64_t k =
        count("every", "K", s.substr(6), "every:K " + verb + " layers K, 2K, 3K, ... counted from 1", none);
    for (int64_t i = k - 1; i < n_; i += k) full[i] = true;
    return std::make_pair("every:" + std::to_string(k), full);
  }
  if (starts_with(s, "block:")) {
    const int64_t b =
        count("block", "N", s.substr(6), "block:N " + verb + " the first N layers of each pipeline stage", none);
    for (size_t st = 0; st < split_.size.size(); ++st) {
      for (int64_t j = 0; j < b; ++j) full[split_.first[st] + j] = true;
    }
    return std::make_pair("block:" + std::to_string(b), full);
  }
  if (starts_with(s, "ratio:")) {
    const auto r = util::parse_real(s.substr(6));
    if (!r || *r < 0.0 || *r > 1.0) {
      fail(
          fmt::format("{}: R = {} is not a number in [0, 1]; ratio:R {} the first ceil(R x layers) "
                      "layers of each pipeline stage, e.g. ratio:0.5 for half of them.",
                      origin_, s.substr(6), verb));
    }
    for (size_t st = 0; st < split_.size.size(); ++st) {
      // The small slack keeps 0.3 x 10 at 3 although the product rounds to 3.0000000000000004.
      const auto take = static_cast<int64_t>(std::ceil(*r * static_cast<double>(split_.size[st]) - 1e-9));
      for (int64_t j = 0; j < take; ++j) full[split_.first[st] + j] = true;
    }
    return std::make_pair(fmt::format("ratio:{}", *r), full);
  }
  return std::nullopt;
}

// The names inside "kind:[a,b]", checked against `valid`, in its order.
std::vector<std::string> Parser::names(const std::string& s, size_t prefix, const std::string& what,
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

std::optional<Selective> Parser::selective(const std::string& s) const {
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

ActivationPlan Parser::layers(const std::string& s) const {
  if (s.size() < 9 || s[7] != '[' || s.back() != ']') {
    fail(fmt::format("{}: '{}' must list one entry per layer in brackets, e.g. layers:[full,none,modules:core_attn].",
                     origin_, s));
  }
  const std::string inside = s.substr(8, s.size() - 9);
  // "layers:[]" lists nothing, not one empty entry.
  const std::vector<std::string> entries =
      inside.find_first_not_of(' ') == std::string::npos ? std::vector<std::string>{} : split_top(inside, ',');
  if (static_cast<int64_t>(entries.size()) != n_) {
    const size_t n = entries.size();
    fail(fmt::format("{}: layers:[...] lists {} but the model has {} layers; give exactly one entry per layer.",
                     origin_,
                     n == 0   ? "no entries"
                     : n == 1 ? "1 entry"
                              : fmt::format("{} entries", n),
                     n_));
  }
  ActivationPlan plan = ActivationPlan::none(n_);
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

}  // namespace remat::policy
