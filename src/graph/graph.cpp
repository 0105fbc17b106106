#include "remat/graph.h"

#include "graph/walk.h"

#include "remat/memory.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <set>

namespace remat::graph {

int BlockGraph::root(int v) const {
  while (values[static_cast<size_t>(v)].alias >= 0) v = values[static_cast<size_t>(v)].alias;
  return v;
}

int64_t BlockGraph::slot_bytes(Slot s) const {
  std::set<int> roots;
  int64_t bytes = 0;
  for (int v : slot(s)) {
    if (roots.insert(root(v)).second) bytes += values[static_cast<size_t>(root(v))].info.bytes();
  }
  return bytes;
}

bool BlockGraph::kept(int v, const std::vector<bool>& keep) const {
  const auto i = static_cast<size_t>(v);
  const int s = slot_of[i];
  if (saved[i]) return s < 0 || keep[static_cast<size_t>(s)];
  const int whole = gathered[i];
  return whole >= 0 && s >= 0 && keep[static_cast<size_t>(s)] && !keep[static_cast<size_t>(slot_of[whole])];
}

int64_t BlockGraph::kept_bytes(const std::vector<bool>& keep, bool input_sharded) const {
  TORCH_INTERNAL_ASSERT(!input_sharded || input_shardable(), "a sharded input in a graph that cannot shard it");
  std::set<int> roots;
  int64_t bytes = 0;
  for (size_t v = 0; v < values.size(); ++v) {
    const int r = root(static_cast<int>(v));
    if (!kept(static_cast<int>(v), keep) || !roots.insert(r).second) continue;
    const int64_t b = values[static_cast<size_t>(r)].info.bytes();
    bytes += input_sharded && r == input ? b / tp : b;
  }
  return bytes;
}

std::vector<std::vector<int>> BlockGraph::offload_groups(const std::vector<bool>& keep, SlotMask offloaded,
                                                         bool input_sharded) const {
  std::map<int, std::vector<int>> by_root;
  std::set<int> stays;
  for (size_t i = 0; i < values.size(); ++i) {
    const int v = static_cast<int>(i);
    if (v == output || !kept(v, keep)) continue;
    const int r = root(v);
    by_root[r].push_back(v);
    const int s = slot_of[i];
    if (s < 0 || !offloaded.has(static_cast<Slot>(s)) || (input_sharded && r == input)) stays.insert(r);
  }
  std::vector<std::vector<int>> groups;
  for (auto& [r, vs] : by_root) {
    if (stays.count(r) == 0) groups.push_back(std::move(vs));
  }
  std::sort(groups.begin(), groups.end());
  return groups;
}

int64_t BlockGraph::offload_bytes(const std::vector<bool>& keep, SlotMask offloaded, bool input_sharded) const {
  int64_t bytes = 0;
  for (const auto& group : offload_groups(keep, offloaded, input_sharded)) {
    bytes += values[static_cast<size_t>(root(group.front()))].info.bytes();
  }
  return bytes;
}

bool BlockGraph::input_shardable() const {
  return tp > 1 && !sp && values[static_cast<size_t>(input)].info.numel() % tp == 0;
}

LinkTraffic BlockGraph::input_gather() const {
  return LinkTraffic::gather(values[static_cast<size_t>(input)].info.bytes(), tp);
}

int64_t BlockGraph::saved_bytes() const {
  std::set<int> roots;
  int64_t bytes = 0;
  for (size_t v = 0; v < values.size(); ++v) {
    const int r = root(static_cast<int>(v));
    if (saved[v] && roots.insert(r).second) bytes += values[static_cast<size_t>(r)].info.bytes();
  }
  return bytes;
}

bool BlockGraph::uses(const OpDef& op) const {
  return std::any_of(nodes.begin(), nodes.end(), [&](const Node& n) { return n.op == &op; });
}

double BlockGraph::forward_flops() const {
  double f = 0;
  for (const auto& n : nodes) f += n.flops;
  return f;
}

std::vector<TensorInfo> BlockGraph::infos(const std::vector<int>& ids) const {
  std::vector<TensorInfo> out;
  for (int v : ids) out.push_back(values[static_cast<size_t>(v)].info);
  return out;
}

namespace {

// The module a parameter belongs to: "q_proj" for "self_attn.q_proj.weight".
std::string module_of(const std::string& param) {
  const std::string path = param.substr(0, param.rfind('.'));
  return path.substr(path.rfind('.') + 1);
}

}  // namespace

Builder::Builder(TensorInfo input, at::ScalarType dtype, bool external) {
  g_.values.push_back({"x", std::move(input), -1, -1, external});
  g_.input = 0;
  g_.dtype = dtype;
  g_.slots.assign(kSlotCount, {});
  assigned_.assign(kSlotCount, false);
}

int Builder::side_input(const std::string& name, TensorInfo info) {
  g_.values.push_back({name, std::move(info), -1, -1, /*external=*/true});
  g_.side_inputs.push_back(static_cast<int>(g_.values.size()) - 1);
  return g_.side_inputs.back();
}

int Builder::param(const std::string& name, std::vector<int64_t> sizes, Shard shard) {
  g_.params.push_back({name, std::move(sizes), std::move(shard)});
  return static_cast<int>(g_.params.size()) - 1;
}

std::vector<int> Builder::add(const std::string& name, const OpDef& op, std::vector<int> inputs,
                              std::vector<int> params, Attrs attrs) {
  for (const auto& n : g_.nodes) TORCH_INTERNAL_ASSERT(n.name != name, "block graph: two nodes named ", name);
  std::vector<TensorInfo> pinfo;
  for (int p : params) pinfo.push_back({g_.params.at(static_cast<size_t>(p)).sizes, g_.dtype, {}});
  const auto in = g_.infos(inputs);
  const auto out = op.infer(in, pinfo, attrs);
  Node n{name, &op, std::move(inputs), {}, std::move(params), std::move(attrs), 0.0, {}, {}};
  n.flops = op.flops(in, pinfo, n.attrs);
  const int id = static_cast<int>(g_.nodes.size());
  for (size_t i = 0; i < out.size(); ++i) {
    const int alias = op.view_of(i);
    const char* part = op.output_name(i);
    std::string value = out.size() == 1 ? name : part ? name + "." + part : fmt::format("{}.{}", name, i);
    if (op.outputs_named_by_params()) value = module_of(g_.params.at(static_cast<size_t>(n.params.at(i))).name);
    g_.values.push_back({std::move(value), out[i], id, alias >= 0 ? n.inputs.at(static_cast<size_t>(alias)) : -1});
    n.outputs.push_back(static_cast<int>(g_.values.size()) - 1);
  }
  g_.nodes.push_back(std::move(n));
  return g_.nodes.back().outputs;
}

int Builder::add1(const std::string& name, const OpDef& op, std::vector<int> inputs, std::vector<int> params,
                  Attrs attrs) {
  const auto out = add(name, op, std::move(inputs), std::move(params), std::move(attrs));
  TORCH_INTERNAL_ASSERT(out.size() == 1, "block graph: node ", name, " has ", out.size(), " outputs");
  return out[0];
}

std::pair<int, int> Builder::dropout(const std::string& name, int x, double p, ops::DropoutSite site) {
  if (p == 0.0) return {x, -1};
  Attrs a;
  a.p = p;
  a.site = site;
  a.sizes = info(x).sizes;
  const int mask = add1(name + "_mask", op::dropout_mask(), {}, {}, a);
  return {add1(name, op::dropout(), {x, mask}, {}, a), mask};
}

int Builder::loss(int hidden, int weight, int64_t chunk, LossHead head) {
  const int64_t C = info(hidden).sizes.back(), N = info(hidden).numel() / C;
  const int rows = view("hidden_rows", hidden, {N, C});
  const int targets = side_input("targets", {{N}, at::kLong, {}});
  Attrs a;
  a.chunk = chunk;
  return add("loss", op::loss(head), {rows, targets}, {weight}, a)[0];
}

int Builder::view(const std::string& name, int x, std::vector<int64_t> sizes) {
  Attrs a;
  a.sizes = std::move(sizes);
  a.from = info(x).sizes;
  return add1(name, op::view(), {x}, {}, a);
}

void Builder::slot(Slot s, std::vector<int> values) {
  const auto i = static_cast<size_t>(s);
  TORCH_INTERNAL_ASSERT(!assigned_[i], "block graph: slot ", slot_name(s), " assigned twice");
  assigned_[i] = true;
  g_.slots[i] = std::move(values);
}

void Builder::gathered(int shard, int whole) { gathers_.emplace_back(shard, whole); }

void Builder::partial(int param) { g_.params.at(static_cast<size_t>(param)).partial = true; }

void Builder::mark_saved(int output) {
  g_.output = output;
  const size_t V = g_.values.size();
  g_.saved.assign(V, false);
  g_.slot_of.assign(V, -1);
  g_.gathered.assign(V, -1);
  for (const auto& [shard, whole] : gathers_) g_.gathered[static_cast<size_t>(shard)] = whole;
  for (const auto& n : g_.nodes) {
    const auto si = n.op->saves_inputs(n.attrs, n.inputs.size());
    const auto so = n.op->saves_outputs(n.attrs, n.outputs.size());
    for (size_t i = 0; i < n.inputs.size(); ++i) {
      if (si[i]) g_.saved[static_cast<size_t>(n.inputs[i])] = true;
    }
    for (size_t i = 0; i < n.outputs.size(); ++i) {
      if (so[i]) g_.saved[static_cast<size_t>(n.outputs[i])] = true;
    }
  }
}

BlockGraph Builder::finish_kept(int output) {
  TORCH_INTERNAL_ASSERT(std::none_of(assigned_.begin(), assigned_.end(), [](bool a) { return a; }),
                        "block graph: a graph without a plan has no slots");
  mark_saved(output);
  return std::move(g_);
}

BlockGraph Builder::finish(int output) {
  mark_saved(output);
  const size_t V = g_.values.size();
  std::vector<int> slot_of_root(V, -1);
  for (int s = 0; s < kSlotCount; ++s) {
    for (int v : g_.slots[static_cast<size_t>(s)]) {
      TORCH_INTERNAL_ASSERT(g_.slot_of[static_cast<size_t>(v)] < 0, "block graph: value ", g_.values[v].name,
                            " is in two slots");
      g_.slot_of[static_cast<size_t>(v)] = s;
      // Dropping a slot frees its memory only if no other slot shares it.
      int& owner = slot_of_root[static_cast<size_t>(g_.root(v))];
      TORCH_INTERNAL_ASSERT(owner < 0 || owner == s, "block graph: slots ", slot_name(static_cast<Slot>(owner)),
                            " and ", slot_name(static_cast<Slot>(s)), " share the memory of ", g_.values[v].name);
      owner = s;
    }
  }
  TORCH_INTERNAL_ASSERT(g_.slot(Slot::input) == std::vector<int>{g_.input},
                        "block graph: Slot::input must hold "
                        "exactly the block input");
  for (size_t v = 0; v < V; ++v) {
    TORCH_INTERNAL_ASSERT(!g_.saved[v] || g_.slot_of[v] >= 0, "block graph: value ", g_.values[v].name,
                          " is read by a backward but is in no slot");
    const int whole = g_.gathered[v];
    TORCH_INTERNAL_ASSERT(whole < 0 || (g_.slot_of[v] >= 0 && g_.slot_of[static_cast<size_t>(whole)] >= 0 &&
                                        g_.slot_of[v] != g_.slot_of[static_cast<size_t>(whole)]),
                          "block graph: the shard ", g_.values[v].name, " and its gathered value must be in two slots");
  }
  return std::move(g_);
}

Lifetimes::Lifetimes(const BlockGraph& g)
    : last_forward_reader(g.values.size(), -1),
      last_backward_reader(g.values.size(), INT_MAX),
      grad_readers(g.values.size()),
      runs_backward(g.nodes.size(), false) {
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    const Node& n = g.nodes[i];
    const int id = static_cast<int>(i);
    const auto si = n.op->saves_inputs(n.attrs, n.inputs.size());
    const auto so = n.op->saves_outputs(n.attrs, n.outputs.size());
    for (size_t j = 0; j < n.inputs.size(); ++j) {
      const int v = n.inputs[j];
      last_forward_reader[v] = id;
      if (si[j]) last_backward_reader[v] = std::min(last_backward_reader[v], id);
      if (n.op->differentiable(j)) grad_readers[v].push_back(id);
    }
    for (size_t j = 0; j < n.outputs.size(); ++j) {
      if (so[j]) last_backward_reader[n.outputs[j]] = std::min(last_backward_reader[n.outputs[j]], id);
    }
  }
  // A node's backward runs when one of its outputs receives a gradient: it feeds a
  // differentiable input of a node whose backward runs, or it is the block output.
  for (int i = static_cast<int>(g.nodes.size()) - 1; i >= 0; --i) {
    for (int v : g.nodes[i].outputs) {
      bool carries = v == g.output;
      for (int r : grad_readers[v]) carries = carries || runs_backward[r];
      if (carries) runs_backward[i] = true;
    }
  }
  for (auto& r : grad_readers) {
    r.erase(std::remove_if(r.begin(), r.end(), [&](int n) { return !runs_backward[n]; }), r.end());
  }
}

std::string explain(const BlockGraph& g) {
  const auto dtype = [](at::ScalarType t) -> std::string {
    switch (t) {
      case at::kFloat:
        return "float32";
      case at::kBFloat16:
        return "bfloat16";
      case at::kDouble:
        return "float64";
      case at::kBool:
        return "bool";
      default:
        return c10::toString(t);
    }
  };
  size_t width = 5;
  for (const auto& v : g.values) width = std::max(width, v.name.size());
  std::string out = fmt::format("{:<{}}  {:<18} {:<8} {:>10}  {:<14} {}\n", "value", width, "shape", "dtype", "bytes",
                                "slot", "producer (op)");
  for (size_t v = 0; v < g.values.size(); ++v) {
    const Value& val = g.values[v];
    const std::string slot = g.slot_of[v] >= 0                 ? slot_name(static_cast<Slot>(g.slot_of[v]))
                             : static_cast<int>(v) == g.output ? "(output)"
                                                               : "-";
    const std::string bytes = val.alias >= 0 ? "view" : memory::format_bytes(val.info.bytes());
    std::string producer = static_cast<int>(v) == g.input ? "block input" : "side input";
    if (val.producer >= 0) {
      const Node& n = g.nodes[static_cast<size_t>(val.producer)];
      producer = fmt::format("{} ({})", n.name, n.op->kind()[0] ? n.op->kind() : "view");
      if (val.alias >= 0) producer += ", view of " + g.values[static_cast<size_t>(val.alias)].name;
    }
    out +=
        fmt::format("{:<{}}  {:<18} {:<8} {:>10}  {:<14} {}\n", val.name, width,
                    fmt::format("[{}]", fmt::join(val.info.sizes, ", ")), dtype(val.info.dtype), bytes, slot, producer);
  }
  return out;
}

}  // namespace remat::graph
