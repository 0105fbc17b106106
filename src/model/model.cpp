#include "remat/model.h"

#include "model/transformer.h"
#include "remat/dist.h"
#include "remat/safetensors.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <numeric>
#include <set>
#include <stdexcept>

namespace remat {

int64_t ActivationBytes::total() const {
  int64_t t = embedding + head;
  for (int64_t b : blocks) t += b;
  return t;
}

std::unique_ptr<Model> Model::create(const ModelConfig& cfg, at::Device device, at::ScalarType compute_dtype,
                                     uint64_t seed, const Layout& layout, dist::Group* tp) {
  TORCH_CHECK(cfg.vocab_size > 0, "The model needs a vocabulary size (model.vocab_size), got ", cfg.vocab_size);
  TORCH_CHECK(compute_dtype == at::kFloat || compute_dtype == at::kBFloat16 || compute_dtype == at::kDouble,
              "The compute dtype must be float32, bfloat16 or float64, got ", compute_dtype);
  TORCH_CHECK(layout.tp == (tp != nullptr ? tp->size() : 1), "The layout shares each layer over ", layout.tp,
              " tensor-parallel ranks, but the model's group has ", tp != nullptr ? tp->size() : 1);
  TORCH_CHECK(!layout.sp || layout.tp > 1,
              "Sequence parallelism shares the positions over a tensor-parallel group, but the model has none; "
              "set parallel.tp > 1 with parallel.sp = true.");
  const std::vector<int64_t> split = layout.stage_split(cfg.n_layer);
  const bool valid = layout.pp >= 1 && static_cast<int64_t>(split.size()) == layout.pp && layout.stage >= 0 &&
                     layout.stage < layout.pp &&
                     std::all_of(split.begin(), split.end(), [](int64_t n) { return n >= 1; }) &&
                     std::accumulate(split.begin(), split.end(), int64_t{0}) == cfg.n_layer;
  TORCH_CHECK(valid, "A pipeline of ", layout.pp, " stages splits the model's ", cfg.n_layer,
              " layers into as many runs of at least one layer each; got the split [", c10::Join(",", split),
              "] and stage ", layout.stage + 1, ".");
  const StageSpan stage{layout.first_layer(cfg.n_layer), layout.stage_layers(cfg.n_layer)};
  return std::make_unique<detail::TransformerModel>(detail::arch_decl(cfg.arch), cfg, device, compute_dtype, seed, tp,
                                                    layout.sp, stage);
}

double Model::forward_backward(const at::Tensor& tokens, const at::Tensor& targets, const StepContext& ctx,
                               double loss_scale, int64_t ce_chunk, ActivationBytes* measured) {
  TORCH_CHECK(first_stage() && last_stage(),
              "forward_backward runs every layer, but this model is the pipeline "
              "stage of layers ",
              stage_.first + 1, " to ", stage_.first + stage_.count,
              " (counted from 1); run its "
              "forward() and backward().");
  StepContext next = ctx;
  next.backward_follows = true;
  const std::unique_ptr<Microbatch> mb = forward(tokens, targets, next, ce_chunk, measured);
  backward(*mb, at::Tensor(), loss_scale);
  return mb->loss;
}

int64_t Model::tp_size() const { return tp_ != nullptr ? tp_->size() : 1; }

at::Tensor Model::whole(size_t i, const at::Tensor& part) const {
  const graph::Shard& shard = params_.at(i).shard;
  if (!shard.split() || tp_size() == 1) return part;
  return graph::join_parts(
      tp_->all_gather(part.contiguous(), shard.dim, fmt::format("gathering parameter {}", params_[i].name)), shard,
      tp_size());
}

at::Tensor Model::whole_value(size_t i) const {
  const Param& p = params_.at(i);
  if (!values_sharded()) return p.value;
  // From its owner, as ZeRO's exchange.
  const bool own = kept_values_[i];
  at::Tensor v = own ? p.value.clone() : at::empty(p.value.sizes(), value_buffer_.options());
  dist::from_owners({v}, {own}, v, *value_group_, fmt::format("gathering parameter {} from its owner", p.name));
  return v;
}

at::Tensor Model::part(size_t i, const at::Tensor& full) const {
  return graph::take_part(full, params_.at(i).shard, tp_size(), tp_ != nullptr ? tp_->rank() : 0);
}

std::vector<int64_t> Model::whole_sizes(size_t i) const {
  std::vector<int64_t> s = params_.at(i).value.sizes().vec();
  const graph::Shard& shard = params_.at(i).shard;
  if (shard.split()) s[static_cast<size_t>(shard.dim)] *= tp_size();
  return s;
}

namespace graph {

BlockGraph block_graph(const ModelConfig& cfg, int64_t batch, int64_t seq, at::ScalarType dtype, const Layout& layout) {
  const auto& decl = detail::arch_decl(cfg.arch);
  return tensor_parallel(decl.block(cfg, batch, seq, dtype), decl.tp_plan, layout.tp, layout.sp);
}

BlockGraph embed_graph(const ModelConfig& cfg, int64_t batch, int64_t seq, at::ScalarType dtype, const Layout& layout) {
  const auto& decl = detail::arch_decl(cfg.arch);
  return tensor_parallel(decl.embed(cfg, batch, seq, dtype), decl.tp_plan, layout.tp, layout.sp);
}

BlockGraph head_graph(const ModelConfig& cfg, int64_t batch, int64_t seq, at::ScalarType dtype, int64_t chunk,
                      const Layout& layout) {
  const auto& decl = detail::arch_decl(cfg.arch);
  return tensor_parallel(decl.head(cfg, batch, seq, dtype, chunk), decl.tp_plan, layout.tp, layout.sp);
}

}  // namespace graph

int64_t Model::num_params() const {
  int64_t n = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto s = whole_sizes(i);
    n += std::accumulate(s.begin(), s.end(), int64_t{1}, std::multiplies<>());
  }
  return n;
}

void Model::zero_grad() {
  // Sharded, the next backward copies into the kept gradients, and zeroes its own buffers.
  if (!grads_sharded()) {
    for (const int i : added_only_) params_[static_cast<size_t>(i)].grad.zero_();
  }
  fresh_grads_ = true;
}

void Model::sum_partial_grads(const std::string& what) {
  if (grads_sharded()) return;  // each part's are summed as its backward ends
  std::vector<at::Tensor> parts;
  for (const Param& p : params_) {
    if (p.partial) parts.push_back(p.grad.reshape({-1}));
  }
  if (parts.empty() || tp_size() == 1) return;
  // Norm weights and biases: small, so one flat copy beats a collective each.
  std::vector<at::Tensor> flat{at::cat(parts)};
  tp_->all_reduce(flat, dist::Reduce::sum, what);
  int64_t at = 0;
  for (at::Tensor& part : parts) {
    part.copy_(flat[0].narrow(0, at, part.numel()));
    at += part.numel();
  }
}

std::vector<std::pair<std::string, at::Tensor>> Model::whole_params(int64_t vocab_rows) const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  out.reserve(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const Param& p = params_[i];
    at::Tensor t = whole(i, whole_value(i).detach()).to(at::kCPU);
    TORCH_CHECK(!p.vocab || vocab_rows <= t.size(0), "[whole_params] ", vocab_rows,
                " vocabulary rows asked of a model with ", t.size(0));
    if (p.vocab && vocab_rows > 0) t = t.narrow(0, 0, vocab_rows);
    out.emplace_back(p.name, hf_transposed(p.name) ? t.t().contiguous() : t.contiguous());
  }
  return out;
}

void Model::save(const std::string& path, const std::map<std::string, std::string>& metadata) const {
  model::save_safetensors(path, whole_params(), metadata);
}

void Model::load(const std::string& path) {
  const bool sharded = detail::ends_with(path, ".index.json");
  const std::vector<std::string> files = sharded ? model::safetensors_index_files(path) : std::vector{path};
  // Hugging Face GPT-2 files may prefix every name with "transformer.".
  std::map<std::string, at::Tensor> file;
  for (const std::string& shard : files) {
    for (auto& [name, t] : model::load_safetensors(shard).tensors) {
      const std::string prefix = "transformer.";
      const bool strip = cfg_.arch == Arch::gpt2 && name.rfind(prefix, 0) == 0;
      const std::string key = strip ? name.substr(prefix.size()) : name;
      if (!file.emplace(key, t).second) {
        throw std::runtime_error(
            fmt::format("{} holds '{}' twice ({}); it is ambiguous which to load (nothing was loaded).", path, key,
                        sharded ? "in two of its files, or with and without the 'transformer.' prefix"
                                : "with and without the 'transformer.' prefix"));
      }
    }
  }

  // Check everything first; write nothing until the whole file is known to fit.
  std::vector<at::Tensor> staged;
  std::set<std::string> used;
  int64_t file_vocab = 0;  // rows of the file's vocabulary tensors; 0: none seen yet
  for (size_t i = 0; i < params_.size(); ++i) {
    const Param& p = params_[i];
    auto it = file.find(p.name);
    if (it == file.end()) {
      throw std::runtime_error(
          fmt::format("{} has no tensor '{}', which this {} model needs; it is not a "
                      "checkpoint of this model (nothing was loaded).",
                      path, p.name, arch_name(cfg_.arch)));
    }
    at::Tensor t = hf_transposed(p.name) && it->second.dim() == 2 ? it->second.t() : it->second;
    const std::vector<int64_t> want = whole_sizes(i);
    if (p.vocab && t.dim() == 2) {
      if (file_vocab == 0) file_vocab = t.size(0);
      if (t.size(0) != file_vocab) {
        throw std::runtime_error(fmt::format(
            "Tensor '{}' in {} has {} vocabulary rows but another of its vocabulary tensors has {}; it is not a "
            "checkpoint of one vocabulary (nothing was loaded).",
            p.name, path, t.size(0), file_vocab));
      }
      // An unpadded checkpoint: the padding rows get the mean row (the header says why).
      if (t.size(0) >= 1 && t.size(0) < want[0] && t.size(1) == want[1] && at::isFloatingType(t.scalar_type())) {
        t = at::cat({t, t.to(at::kDouble).mean(0, true).to(t.scalar_type()).expand({want[0] - t.size(0), want[1]})});
      }
    }
    if (t.sizes() != at::IntArrayRef(want)) {
      throw std::runtime_error(
          fmt::format("Tensor '{}' in {} has shape [{}] but the model expects [{}] (nothing was loaded).", p.name, path,
                      fmt::join(t.sizes(), ", "), fmt::join(want, ", ")));
    }
    if (!at::isFloatingType(t.scalar_type())) {
      throw std::runtime_error(
          fmt::format("Tensor '{}' in {} is of dtype {}, not a floating type (nothing was loaded).", p.name, path,
                      std::string(c10::toString(t.scalar_type()))));
    }
    staged.push_back(part(i, t));
    used.insert(it->first);
  }
  std::vector<std::string> extra;
  for (const auto& [name, t] : file) {
    if (!used.count(name) && !ignorable(name)) extra.push_back(name);
  }
  if (!extra.empty()) {
    throw std::runtime_error(
        fmt::format("{} holds tensors this {} model does not have ({}); it is a checkpoint "
                    "of another model shape (nothing was loaded).",
                    path, arch_name(cfg_.arch), fmt::join(extra, ", ")));
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!values_sharded() || kept_values_[i]) params_[i].value.copy_(staged[i]);
  }
}

namespace detail {

const ArchDecl& arch_decl(Arch arch) {
  switch (arch) {
    case Arch::gpt2:
      return gpt2_decl();
    case Arch::llama:
      return llama_decl();
  }
  TORCH_INTERNAL_ASSERT(false, "unknown architecture");
}

int64_t distinct_storage_bytes(const std::vector<at::Tensor>& ts, std::unordered_set<const void*>& seen) {
  int64_t total = 0;
  for (const auto& t : ts) {
    if (!t.defined()) continue;
    const void* key = t.storage().unsafeGetStorageImpl();
    if (seen.insert(key).second) total += static_cast<int64_t>(t.storage().nbytes());
  }
  return total;
}

void init_param(const std::string& name, at::Tensor& t, const ModelConfig& cfg, at::Generator& gen) {
  auto ends = [&](const char* s) { return ends_with(name, s); };
  if (ends(".bias")) {
    t.zero_();
  } else if (t.dim() == 1) {  // norm weights
    t.fill_(1.0);
  } else {
    // Residual-branch outputs are scaled down so the residual stream's variance does not
    // grow with depth (GPT-2's initialisation).
    const bool residual_out =
        ends("attn.c_proj.weight") || ends("mlp.c_proj.weight") || ends("o_proj.weight") || ends("down_proj.weight");
    const double std = residual_out ? cfg.init_std / std::sqrt(2.0 * cfg.n_layer) : cfg.init_std;
    t.normal_(0.0, std, gen);
  }
}

StepContext recompute_context(const StepContext& ctx, const ActivationStore& st) {
  if (st.options().preserve_rng) return ctx;
  StepContext other = ctx;
  other.seed = ctx.seed ^ 0x9e3779b97f4a7c15ULL;
  return other;
}

}  // namespace detail
}  // namespace remat
