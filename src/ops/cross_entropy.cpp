#include "remat/ops/cross_entropy.h"

#include "ops/op_def.h"

#include "remat/dist.h"
#include "remat/trace.h"

#include <fmt/format.h>

#include <algorithm>

namespace remat::ops {
namespace {

// Log-sum-exp and its derivative cost about 4 FLOPs per logit (max, subtract, exp, sum).
constexpr double kLseFlopsPerLogit = 4.0;

// Logits of rows [start, start + n) in `sd`: x's dtype is rounded up for the reductions.
at::Tensor chunk_logits(const at::Tensor& x, const at::Tensor& w, int64_t start, int64_t n, at::ScalarType sd) {
  return at::mm(x.narrow(0, start, n), w.t()).to(sd);
}

void check_weight(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "[cross_entropy] x must be [N, C] and w [V, C], got x ", x.sizes(), " and w ", w.sizes());
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "[cross_entropy] x and w must share a dtype, got ", x.scalar_type(),
              " and ", w.scalar_type());
}

// Both forwards' inputs, the targets' range (read back to the host) and the vocabulary
// split included.
void check_inputs(const at::Tensor& x, const at::Tensor& w, const at::Tensor& targets, int64_t chunk_tokens,
                  const std::optional<VocabShard>& shard, const dist::Group* group) {
  check_weight(x, w);
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == x.size(0) && targets.scalar_type() == at::kLong,
              "[cross_entropy] targets must be [N] int64 for x [N, C], got ", targets.scalar_type(), " targets ",
              targets.sizes(), " for x ", x.sizes());
  TORCH_CHECK(chunk_tokens >= 1, "[cross_entropy] chunk_tokens must be at least 1, got ", chunk_tokens);
  TORCH_CHECK(shard || group == nullptr,
              "[cross_entropy] a group is for a vocabulary split over it: give the weight's share of it too");
  if (shard) {
    shard->check("cross_entropy", w.size(0));
    const int ranks = group != nullptr ? group->size() : 1;
    TORCH_CHECK(shard->vocab == ranks * w.size(0), "[cross_entropy] ", ranks, " rank(s) holding ", w.size(0),
                " vocabulary rows each cannot hold a vocabulary of ", shard->vocab, " rows");
  }
  const int64_t V = shard ? shard->vocab : w.size(0);
  if (x.size(0) > 0) {
    auto [lo, hi] = at::aminmax(targets);
    const int64_t lo_v = lo.item<int64_t>(), hi_v = hi.item<int64_t>();
    TORCH_CHECK(lo_v >= kIgnoreIndex && hi_v < V, "[cross_entropy] targets must lie in [0, ", V, ") or be ",
                kIgnoreIndex, " (ignored), got targets in [", lo_v, ", ", hi_v, "]");
  }
}

// The targets' rows: which count, how many, and the targets as columns of this rank's
// logits, safe to gather (ignored rows read column 0; their terms are zeroed by `counted`).
// With a share of the vocabulary, `foreign` marks the rows whose target column is not
// among ours (the ignored ones too): their target logit and one-hot are another rank's.
struct Rows {
  at::Tensor counted;  // [N] bool
  int64_t count;
  at::Tensor safe;     // [N, 1] int64
  at::Tensor foreign;  // [N, 1] bool; undefined without a share
  Rows(const at::Tensor& targets, const std::optional<VocabShard>& shard, int64_t held)
      : counted(targets.ne(kIgnoreIndex)), count(counted.sum().item<int64_t>()) {
    if (!shard) {
      safe = targets.clamp_min(0).unsqueeze(1);
      return;
    }
    const ShardIds local = shard_ids(targets, *shard, held);
    safe = local.rows.unsqueeze(1);
    foreign = local.foreign.unsqueeze(1);
  }
};

// Rows [start, start + n) of Rows.
struct Chunk {
  int64_t start, n;
  at::Tensor safe, counted, foreign;
  Chunk(const Rows& rows, int64_t start, int64_t n)
      : start(start),
        n(n),
        safe(rows.safe.narrow(0, start, n)),
        counted(rows.counted.narrow(0, start, n)),
        foreign(rows.foreign.defined() ? rows.foreign.narrow(0, start, n) : at::Tensor()) {}
};

// The ranks holding the other columns of a split vocabulary's logits (null: none), over
// which a chunk's row statistics are completed.
struct Split {
  dist::Group* group;
  const char* op;
  int64_t chunk_tokens;
  void all_reduce(std::vector<at::Tensor> tensors, dist::Reduce reduce, const char* what, const Chunk& c) const {
    if (group == nullptr) return;
    group->all_reduce(tensors, reduce,
                      fmt::format("the vocabulary-parallel loss's {} in chunk {} (rows {} to {}) of {}", what,
                                  c.start / chunk_tokens, c.start, c.start + c.n - 1, op));
  }
};

// One chunk's share of the loss: turns its logits in place into exp(logits - max) (divided
// by the row sums when `softmax`), writes each row's log-sum-exp into `lse` and adds the
// counted rows' log-sum-exp minus target logit to `loss`. With a split vocabulary the row
// max, then the sums of exp with the target logits, are completed over the ranks first, so
// the log-sum-exp and the loss come out the same on every rank.
void chunk_loss(at::Tensor& logits, at::Tensor lse, const Chunk& c, const Split& split, at::Tensor& loss,
                bool softmax) {
  at::Tensor target_logit = logits.gather(1, c.safe);
  const at::Tensor max = at::amax(logits, {1}, true);
  if (c.foreign.defined()) {
    target_logit.masked_fill_(c.foreign, 0);
    split.all_reduce({max}, dist::Reduce::max, "row max", c);
  }
  target_logit = target_logit.squeeze(1);
  logits.sub_(max).exp_();
  at::sum_out(lse, logits, {1});
  // One collective for both: the sums and the target logits are added over the same ranks.
  if (c.foreign.defined()) {
    split.all_reduce({lse, target_logit}, dist::Reduce::sum, "row sums of exp and target logits", c);
  }
  if (softmax) logits.div_(lse.unsqueeze(1));
  lse.log_().add_(max.squeeze(1));
  loss.add_(at::sub(lse, target_logit).mul_(c.counted).sum());
}

// The gradient of the mean loss with respect to one chunk's logits, in place over their
// softmax: (softmax - one-hot) * scale on counted rows, 0 on ignored ones. A foreign row's
// one-hot column is another rank's.
void chunk_dlogits(at::Tensor& softmax, const Chunk& c, double scale) {
  const at::Tensor row_scale = c.counted.to(softmax.scalar_type()).mul_(scale).unsqueeze(1);
  at::Tensor onehot = row_scale.neg();
  if (c.foreign.defined()) onehot.masked_fill_(c.foreign, 0);
  softmax.mul_(row_scale).scatter_add_(1, c.safe, onehot);
}

// Accumulates (or writes, `into`) one chunk's dw from its float dlogits, and writes its dx rows.
void chunk_grads(const at::Tensor& dlogits, const at::Tensor& x_c, const at::Tensor& w, at::Tensor dx_c, at::Tensor& dw,
                 GradInto into) {
  const at::Tensor dl = dlogits.to(x_c.scalar_type());
  at::mm_out(dx_c, dl, w);
  // A wider accumulator (float32 for bfloat16 activations) takes the float32 dlogits.
  const bool same = dw.scalar_type() == x_c.scalar_type();
  const at::Tensor a = same ? dl.t() : dlogits.to(dw.scalar_type()).t(), b = same ? x_c : x_c.to(dw.scalar_type());
  if (into == GradInto::write) {
    at::mm_out(dw, a, b);
  } else {
    dw.addmm_(a, b);
  }
}

}  // namespace

Fwd<CrossEntropySaved> cross_entropy_forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& targets,
                                             int64_t chunk_tokens, std::optional<VocabShard> shard,
                                             dist::Group* group) {
  const trace::Scope trace_scope("cross_entropy", trace::Category::forward);
  check_inputs(x, w, targets, chunk_tokens, shard, group);
  const int64_t N = x.size(0);
  const Rows rows(targets, shard, w.size(0));
  const Split split{group, "cross_entropy", chunk_tokens};
  const at::ScalarType sd = stats_dtype(x.scalar_type());
  at::Tensor lse = at::empty({N}, x.options().dtype(sd));
  at::Tensor loss = at::zeros({}, x.options().dtype(sd));
  for (int64_t start = 0; start < N; start += chunk_tokens) {
    const int64_t n = std::min(chunk_tokens, N - start);
    at::Tensor logits = chunk_logits(x, w, start, n, sd);
    chunk_loss(logits, lse.narrow(0, start, n), Chunk(rows, start, n), split, loss, /*softmax=*/false);
  }
  if (rows.count > 0) loss.div_(rows.count);
  return {loss, CrossEntropySaved{x, targets, lse, chunk_tokens, shard}};
}

at::Tensor cross_entropy_backward(double dloss, const CrossEntropySaved& saved, const at::Tensor& w, at::Tensor& dw,
                                  GradInto into) {
  const trace::Scope trace_scope("cross_entropy", trace::Category::backward);
  const at::Tensor& x = saved.x;
  check_weight(x, w);
  TORCH_CHECK(dw.sizes() == w.sizes(), "[cross_entropy] dw must have w's shape ", w.sizes(), ", got ", dw.sizes());
  const int64_t N = x.size(0);
  at::Tensor dx = at::zeros({N, x.size(1)}, x.options());
  const Rows rows(saved.targets, saved.shard, w.size(0));
  if (rows.count == 0) {  // every target ignored: the loss is a constant 0
    if (into == GradInto::write) dw.zero_();
    return dx;
  }
  const at::ScalarType sd = saved.lse.scalar_type();
  const double scale = dloss / static_cast<double>(rows.count);
  for (int64_t start = 0; start < N; start += saved.chunk) {
    const int64_t n = std::min(saved.chunk, N - start);
    // The softmax comes from the saved log-sum-exp, in place over the recomputed logits: with
    // a split vocabulary that log-sum-exp is already the whole vocabulary's, so no
    // collective runs here.
    at::Tensor dlogits = chunk_logits(x, w, start, n, sd);
    dlogits.sub_(saved.lse.narrow(0, start, n).unsqueeze(1)).exp_();
    chunk_dlogits(dlogits, Chunk(rows, start, n), scale);
    chunk_grads(dlogits, x.narrow(0, start, n), w, dx.narrow(0, start, n), dw, start == 0 ? into : GradInto::add);
  }
  return dx;
}

Fwd<FusedCrossEntropySaved> fused_cross_entropy_forward(const at::Tensor& x, const at::Tensor& w,
                                                        const at::Tensor& targets, int64_t chunk_tokens, bool grads,
                                                        std::optional<VocabShard> shard, dist::Group* group) {
  const trace::Scope trace_scope("fused_cross_entropy", trace::Category::forward);
  check_inputs(x, w, targets, chunk_tokens, shard, group);
  const int64_t N = x.size(0);
  const Rows rows(targets, shard, w.size(0));
  const Split split{group, "fused_cross_entropy", chunk_tokens};
  const at::ScalarType sd = stats_dtype(x.scalar_type());
  FusedCrossEntropySaved saved;
  if (grads) {
    saved.dw = at::zeros(w.sizes(), x.options().dtype(sd));
    saved.dx = at::zeros(x.sizes(), x.options());
  }
  at::Tensor loss = at::zeros({}, x.options().dtype(sd));
  // Every target ignored: the loss is a constant 0 and both gradients stay 0.
  const bool grad_chunks = grads && rows.count > 0;
  for (int64_t start = 0; start < N; start += chunk_tokens) {
    const int64_t n = std::min(chunk_tokens, N - start);
    const Chunk c(rows, start, n);
    at::Tensor logits = chunk_logits(x, w, start, n, sd);
    chunk_loss(logits, at::empty({n}, x.options().dtype(sd)), c, split, loss, /*softmax=*/grad_chunks);
    if (!grad_chunks) continue;
    chunk_dlogits(logits, c, 1.0 / static_cast<double>(rows.count));
    chunk_grads(logits, x.narrow(0, start, n), w, saved.dx.narrow(0, start, n), saved.dw, GradInto::add);
  }
  if (rows.count > 0) loss.div_(rows.count);
  return {loss, saved};
}

at::Tensor fused_cross_entropy_backward(double dloss, const FusedCrossEntropySaved& saved, at::Tensor& dw,
                                        GradInto into) {
  const trace::Scope trace_scope("fused_cross_entropy", trace::Category::backward);
  TORCH_CHECK(dw.sizes() == saved.dw.sizes(), "[fused_cross_entropy] dw must have w's shape ", saved.dw.sizes(),
              ", got ", dw.sizes());
  // Written: a copy where the scale is 1 (a plain step's), else scaled into zeros, which
  // allocates nothing where a product with dloss would take a scalar operand.
  if (into == GradInto::write && dloss == 1.0) {
    dw.copy_(saved.dw);
  } else {
    if (into == GradInto::write) dw.zero_();
    dw.add_(saved.dw, dloss);
  }
  return saved.dx.clone().mul_(dloss);
}

int64_t cross_entropy_saved_bytes(int64_t tokens, int64_t C, at::ScalarType dtype) {
  return nbytes(tokens * C, dtype) + nbytes(tokens, at::kLong) + nbytes(tokens, stats_dtype(dtype));
}

int64_t fused_cross_entropy_saved_bytes(int64_t tokens, int64_t C, int64_t vocab, at::ScalarType dtype) {
  return nbytes(tokens * C, dtype) + nbytes(vocab * C, stats_dtype(dtype));
}

int64_t cross_entropy_workspace_bytes(int64_t chunk_tokens, int64_t vocab, at::ScalarType dtype) {
  const at::ScalarType sd = stats_dtype(dtype);
  const int64_t logits = chunk_tokens * vocab;
  return nbytes(logits, sd) + (dtype != sd ? nbytes(logits, dtype) : 0);
}

double cross_entropy_flops(int64_t tokens, int64_t C, int64_t vocab) {
  return 2.0 * tokens * C * vocab + kLseFlopsPerLogit * tokens * vocab;
}

}  // namespace remat::ops

namespace remat::graph {
namespace {

using detail::bytes_of;
using detail::flags;
using detail::stats_of;

// The sizes both loss ops' events are written in (V: the rows this rank's weight holds), and
// whether CUDA kernels run them: those read a double scalar as an argument and cast other
// operands as they read them, where the CPU's copy both first (TensorIteratorBase::compute_types).
struct LossSizes {
  int64_t N, C, V, n;
  at::ScalarType f, sd;
  bool narrower, sharded, cuda;
  LossSizes(const Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& p, const Attrs& a)
      : N(in[0].sizes[0]),
        C(in[0].sizes[1]),
        V(p[0].sizes[0]),
        n(std::min(a.chunk, N)),
        f(in[0].dtype),
        sd(stats_of(f)),
        narrower(sd != f),
        sharded(a.sharded),
        cuda(e.device() == at::kCUDA) {}
};

// The targets' range check: two scalars, gone before anything else is made.
void range_check_events(Events& e) {
  const int64_t lo = e.temp(8), hi = e.temp(8);
  e.release(hi);
  e.release(lo);
}

// Rows: `counted` and `safe` (with a share: the targets seen from it) stay until
// release_rows, the count goes.
struct RowEvents {
  int64_t counted;
  std::optional<int64_t> safe;
  std::optional<detail::ShardIdsEvents> shard;
};
RowEvents rows_events(Events& e, const LossSizes& s) {
  const int64_t counted = e.temp(bytes_of(s.N, at::kBool));
  e.release(e.temp(8));  // the count
  if (s.sharded) return {counted, std::nullopt, detail::shard_ids_events(e, s.N)};
  return {counted, e.temp(bytes_of(s.N, at::kLong)), std::nullopt};
}
void release_rows(Events& e, const RowEvents& r) {
  if (r.shard) detail::release_shard_ids(e, *r.shard);
  if (r.safe) e.release(*r.safe);
  e.release(r.counted);
}

// One chunk's logits in the statistics' dtype, cast from the product in x's when narrower.
int64_t chunk_logits_events(Events& e, const LossSizes& s) {
  const int64_t mm = s.narrower ? e.temp(bytes_of(s.n * s.V, s.f)) : -1;
  const int64_t logits = e.temp(bytes_of(s.n * s.V, s.sd));
  if (mm >= 0) e.release(mm);
  return logits;
}

// chunk_loss: the target logits and row maxima, then the rows' terms, the mask cast for the
// product and their sum.
void chunk_loss_events(Events& e, const LossSizes& s) {
  const int64_t target = e.temp(bytes_of(s.n, s.sd)), max = e.temp(bytes_of(s.n, s.sd));
  const int64_t term = e.temp(bytes_of(s.n, s.sd));
  if (!s.cuda) e.release(e.temp(bytes_of(s.n, s.sd)));  // the row mask cast for the product
  e.release(e.temp(bytes_of(1, s.sd)));                 // the sum
  e.release(term);
  e.release(max);
  e.release(target);
}

// chunk_dlogits, then chunk_grads: the per-row scale and its negation, then for narrower x
// the dlogits in x's dtype and x's rows widened for the wider dw.
void chunk_grads_events(Events& e, const LossSizes& s) {
  const int64_t scale = e.temp(bytes_of(s.n, s.sd));
  if (!s.cuda) detail::scalar_operand(e, s.sd);
  e.release(e.temp(bytes_of(s.n, s.sd)));  // the negated scale
  e.release(scale);
  if (!s.narrower) return;
  const int64_t narrow = e.temp(bytes_of(s.n * s.V, s.f));
  e.release(e.temp(bytes_of(s.n * s.C, s.sd)));
  e.release(narrow);
}

void check_loss_inputs(const char* op, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& p,
                       const Attrs& a) {
  TORCH_CHECK(in.size() == 2 && in[0].sizes.size() == 2 && in[1].sizes == std::vector<int64_t>{in[0].sizes[0]} &&
                  in[1].dtype == at::kLong && p.size() == 1 && p[0].sizes.size() == 2 &&
                  p[0].sizes[1] == in[0].sizes[1] && a.chunk >= 1,
              "[", op, "] needs x [N, C], int64 targets [N], a weight [V, C] and a chunk of at least 1");
}

// The vocabulary-parallel loss's forward (ops::cross_entropy_forward and the fused one's
// chunk_loss): per chunk of rows, three all-reduces of one statistic per row in the
// statistics' dtype, each its own collective (dist::Group::all_reduce): the row max, then
// the sums of exp and the target logits. Its backward runs none (the saved log-sum-exp is
// the whole vocabulary's already). Unsharded, it runs none at all.
LinkTraffic loss_link(const std::vector<TensorInfo>& in, const Attrs& a, int64_t tp) {
  if (!a.sharded) return {};
  const int64_t rows = in[0].sizes.at(0);
  constexpr int64_t kStatistics = 3;
  LinkTraffic t;
  for (int64_t start = 0; start < rows; start += a.chunk) {
    const LinkTraffic one =
        LinkTraffic::all_reduce(bytes_of(std::min(a.chunk, rows - start), stats_of(in[0].dtype)), tp);
    t.bytes += kStatistics * one.bytes;
    t.messages += kStatistics * one.messages;
  }
  return t;
}

// Inputs {x [N, C], targets [N] int64}; params {w [V, C]}; attribute chunk; outputs
// {mean loss [], log-sum-exp [N]}. The backward reads x, the targets and the log-sum-exp,
// and takes the loss's gradient (a scalar) as the scale of its own. Sharded, w is this
// rank's [V/t, C] share of the tensor-parallel group's vocabulary: the loss and the
// log-sum-exp are the whole vocabulary's (completed over the group in the forward), x's
// gradient this rank's part, which the copy node before the op sums over the group.
class CrossEntropyDef final : public OpDef {
 public:
  const char* kind() const override { return "cross_entropy"; }
  TensorParallel tensor_parallel() const override { return TensorParallel::vocab_loss; }
  LinkTraffic forward_link(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&, const Attrs& a,
                           int64_t tp) const override {
    return loss_link(in, a, tp);
  }
  std::vector<TensorInfo> infer(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& p,
                                const Attrs& a) const override {
    check_loss_inputs(kind(), in, p, a);
    const at::ScalarType sd = stats_of(in[0].dtype);
    return {TensorInfo{{}, sd, {}}, TensorInfo{{in[0].sizes[0]}, sd, {}}};
  }
  double flops(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& p, const Attrs&) const override {
    return ops::cross_entropy_flops(in[0].sizes[0], in[0].sizes[1], p[0].sizes[0]);
  }
  std::vector<bool> saves_inputs(const Attrs&, size_t n) const override { return flags(n, {0, 1}); }
  std::vector<bool> saves_outputs(const Attrs&, size_t n) const override { return flags(n, {1}); }
  const char* output_name(size_t i) const override { return i == 0 ? "loss" : "lse"; }
  bool differentiable(size_t input) const override { return input == 0; }
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p, const Attrs& a,
                                  const RunContext& ctx) const override {
    auto r = ops::cross_entropy_forward(in[0], p[0], in[1], a.chunk, detail::vocab_shard(a, ctx, p[0].size(0)),
                                        a.sharded ? ctx.tp : nullptr);
    return {r.out, r.saved.lse};
  }
  std::vector<at::Tensor> backward(const std::vector<at::Tensor>& dy, const std::vector<at::Tensor>& in,
                                   const std::vector<at::Tensor>& out, const std::vector<at::Tensor>& p,
                                   std::vector<at::Tensor*>& g, const Attrs& a, const RunContext& ctx) const override {
    const ops::CrossEntropySaved saved{in[0], in[1], out[1], a.chunk, detail::vocab_shard(a, ctx, p[0].size(0))};
    return {ops::cross_entropy_backward(dy[0].item<double>(), saved, p[0], *g[0], ctx.grads), at::Tensor()};
  }

  // The forward: the row masks, then per chunk the logits and the loss terms.
  void forward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& p,
                      const std::vector<TensorInfo>&, const Attrs& a) const override {
    const LossSizes s(e, in, p, a);
    range_check_events(e);
    const RowEvents rows = rows_events(e, s);
    e.out(1);
    e.out(0);
    if (s.N > 0) {
      const int64_t logits = chunk_logits_events(e, s);
      chunk_loss_events(e, s);
      e.release(logits);
    }
    release_rows(e, rows);
  }
  // The backward: the input gradient, the row masks, then per chunk the logits again and
  // their gradient's products.
  void backward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& p,
                       const std::vector<TensorInfo>&, const Attrs& a) const override {
    const LossSizes s(e, in, p, a);
    e.out(0);
    const RowEvents rows = rows_events(e, s);
    if (s.N > 0) {
      const int64_t logits = chunk_logits_events(e, s);
      chunk_grads_events(e, s);
      e.release(logits);
    }
    release_rows(e, rows);
  }
};

// Inputs and params as cross_entropy; outputs {mean loss [], dx [N, C], dw [V, C]}: the
// forward computes the gradients of the mean loss and the backward only scales them, so it
// reads no input. Sharded as cross_entropy (dw: this rank's rows).
class FusedCrossEntropyDef final : public OpDef {
 public:
  const char* kind() const override { return "fused_cross_entropy"; }
  TensorParallel tensor_parallel() const override { return TensorParallel::vocab_loss; }
  LinkTraffic forward_link(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&, const Attrs& a,
                           int64_t tp) const override {
    return loss_link(in, a, tp);
  }
  std::vector<TensorInfo> infer(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& p,
                                const Attrs& a) const override {
    check_loss_inputs(kind(), in, p, a);
    const at::ScalarType sd = stats_of(in[0].dtype);
    return {TensorInfo{{}, sd, {}}, TensorInfo{in[0].sizes, in[0].dtype, {}}, TensorInfo{p[0].sizes, sd, {}}};
  }
  // The model's FLOPs (the logits and their log-sum-exp), as the recomputing head's: the two
  // gradient products it runs early are the backward's, counted there by the usual 2x.
  double flops(const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& p, const Attrs&) const override {
    return ops::cross_entropy_flops(in[0].sizes[0], in[0].sizes[1], p[0].sizes[0]);
  }
  std::vector<bool> saves_outputs(const Attrs&, size_t n) const override { return flags(n, {1, 2}); }
  const char* output_name(size_t i) const override { return i == 0 ? "loss" : i == 1 ? "dx" : "dw"; }
  bool differentiable(size_t input) const override { return input == 0; }
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p, const Attrs& a,
                                  const RunContext& ctx) const override {
    auto r = ops::fused_cross_entropy_forward(in[0], p[0], in[1], a.chunk, /*grads=*/ctx.train,
                                              detail::vocab_shard(a, ctx, p[0].size(0)), a.sharded ? ctx.tp : nullptr);
    return {r.out, r.saved.dx, r.saved.dw};
  }
  std::vector<at::Tensor> backward(const std::vector<at::Tensor>& dy, const std::vector<at::Tensor>&,
                                   const std::vector<at::Tensor>& out, const std::vector<at::Tensor>&,
                                   std::vector<at::Tensor*>& g, const Attrs&, const RunContext& ctx) const override {
    return {ops::fused_cross_entropy_backward(dy[0].item<double>(), {out[1], out[2]}, *g[0], ctx.grads), at::Tensor()};
  }

  // The forward: the row masks and both gradients, then per chunk the logits, the rows'
  // log-sum-exp, the loss terms and the gradient products.
  void forward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>& p,
                      const std::vector<TensorInfo>&, const Attrs& a) const override {
    const LossSizes s(e, in, p, a);
    range_check_events(e);
    const RowEvents rows = rows_events(e, s);
    e.out(2);
    e.out(1);
    e.out(0);
    if (s.N > 0) {
      const int64_t logits = chunk_logits_events(e, s);
      const int64_t lse = e.temp(bytes_of(s.n, s.sd));
      chunk_loss_events(e, s);
      e.release(lse);
      chunk_grads_events(e, s);
      e.release(logits);
    }
    release_rows(e, rows);
  }
  // The backward: the scaled copy of dx (a double scalar multiplied in; a CUDA kernel takes
  // it as an argument).
  void backward_events(Events& e, const std::vector<TensorInfo>& in, const std::vector<TensorInfo>&,
                       const std::vector<TensorInfo>&, const Attrs&) const override {
    e.out(0);
    if (e.device() != at::kCUDA) detail::scalar_operand(e, in[0].dtype);
  }
};

}  // namespace

const OpDef& op::cross_entropy() {
  static const CrossEntropyDef def;
  return def;
}

const OpDef& op::fused_cross_entropy() {
  static const FusedCrossEntropyDef def;
  return def;
}

const OpDef& op::loss(LossHead head) {
  // Every model declares its head through here, so an unresolved choice stops before
  // anything is built or priced.
  TORCH_CHECK(head != LossHead::automatic,
              "model.loss_head = auto names no loss head: the command resolves it to fused or recompute "
              "(plan_run_auto, src/run/auto.h) before building or planning the model.");
  return head == LossHead::fused ? fused_cross_entropy() : cross_entropy();
}

}  // namespace remat::graph
