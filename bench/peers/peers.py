#!/usr/bin/python3
"""Plain-PyTorch peers of remat's GPT-2 and Llama, for side-by-side step timings.

The models compute the same math as remat's blocks (src/model/gpt2.cpp, llama.cpp and the
ops in src/ops/), and a step is what remat's TrainStep::run times (src/train/step.cpp):
draw a batch, zero the gradients, forward, backward, clip the global gradient norm,
AdamW step. One JSON object goes to stdout per run; the human-readable lines go to stderr.

Run it with Debian's python: bookworm's /usr/bin/python3 has torch 1.13; the sid root of
scripts/root.sh has torch 2.x, which adds sdpa, sac, --compile, --compile-blocks, fused AdamW
and --memory-budget. The checkpointing, per-block compile and optimizer settings reproduce
torchtitan's (torchtitan/distributed/activation_checkpoint.py and models/llama3/infra/
parallelize.py), so that remat is timed against PyTorch as its users run it. Only the
standard library and torch are used. See README.md beside this file.
"""

import argparse
import ctypes
import gc
import inspect
import json
import math
import os
import platform
import resource
import sys
import sysconfig
import time
import warnings


def _select_blas_build():
    """--blas-build openmp|pthread: re-runs this script with Debian's OpenBLAS build of that
    threading first on LD_LIBRARY_PATH, before torch loads libblas.so.3. Debian installs both
    builds side by side (/usr/lib/<multiarch>/openblas-openmp and openblas-pthread) and the
    alternatives system picks the one that /usr/lib/<multiarch>/libblas.so.3 names."""
    build = None
    for i, a in enumerate(sys.argv):
        if a == "--blas-build" and i + 1 < len(sys.argv):
            build = sys.argv[i + 1]
        elif a.startswith("--blas-build="):
            build = a.split("=", 1)[1]
    if build not in ("openmp", "pthread"):
        return None
    d = os.path.join("/usr/lib", sysconfig.get_config_var("MULTIARCH") or "x86_64-linux-gnu", "openblas-" + build)
    if not os.path.exists(os.path.join(d, "libblas.so.3")):
        sys.exit(f"peers.py: --blas-build {build} needs {d}/libblas.so.3 (Debian's libopenblas0-{build}), "
                 f"which is not installed.")
    if os.environ.get("PEERS_BLAS_DIR") != d:
        old = os.environ.get("LD_LIBRARY_PATH")
        env = dict(os.environ, PEERS_BLAS_DIR=d, LD_LIBRARY_PATH=d + (":" + old if old else ""))
        os.execve(sys.executable, [sys.executable] + sys.argv, env)
    return d


BLAS_DIR = _select_blas_build()

# --malloc keep: glibc malloc's tunables that keep freed memory for reuse. By default glibc
# serves blocks above its mmap threshold (128 KiB, rising with frees to at most 32 MiB) with
# mmap and returns them with munmap, and trims the heap top once 2x that is free, so each
# step's activations come back as fresh pages the kernel faults in and zeroes (a setting that
# frees less, such as full, then faults less; docs/results.md). Blocks above 32 MiB (glibc's
# limit for the threshold) are still mapped.
MALLOC_KEEP_TUNABLES = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=17179869184"


def _select_malloc():
    """--malloc keep: re-runs this script with MALLOC_KEEP_TUNABLES in GLIBC_TUNABLES (read by
    glibc at start-up only). Returns the tunables in force, or None."""
    keep = any(a == "--malloc=keep" or (a == "--malloc" and i + 1 < len(sys.argv) and sys.argv[i + 1] == "keep")
               for i, a in enumerate(sys.argv))
    if not keep:
        return None
    have = os.environ.get("GLIBC_TUNABLES", "")
    if MALLOC_KEEP_TUNABLES not in have:
        env = dict(os.environ, GLIBC_TUNABLES=(have + ":" if have else "") + MALLOC_KEEP_TUNABLES)
        os.execve(sys.executable, [sys.executable] + sys.argv, env)
    return os.environ["GLIBC_TUNABLES"]


MALLOC_TUNABLES = _select_malloc()

import torch  # noqa: E402  (after the BLAS and malloc choices)
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch.utils.checkpoint as torch_checkpoint  # noqa: E402

try:  # the node being traced under torch.compile (its stack_trace names the traced frames)
    import torch.fx.traceback as fx_traceback  # noqa: E402
except ImportError:
    fx_traceback = None


# The profiler touches torch.distributed.reduce_op, which warns on every use (2.x quotes the name).
warnings.filterwarnings("ignore", message=".*torch.distributed.reduce_op`? is deprecated.*")


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Threads: ATen's intra-op pool and OpenBLAS's own pthread pool.
# --------------------------------------------------------------------------------------------

def loaded_openblas():
    """The OpenBLAS that torch already loaded, as a ctypes handle (never a second copy).

    Debian's torch links libblas.so.3, which the alternatives system points at
    openblas-pthread/libblas.so.3 -> libopenblasp-r0.3.x.so. The library is found in
    /proc/self/maps and opened with RTLD_NOLOAD, so the handle is the mapped one.
    Returns (handle, path) or (None, None) when no loaded library exports
    openblas_set_num_threads (another BLAS).
    """
    paths = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[-1].startswith("/") and ("blas" in parts[-1]):
                if parts[-1] not in paths:
                    paths.append(parts[-1])
    # The openblas library itself first, then the libblas.so.3 shim that re-exports it.
    paths.sort(key=lambda p: 0 if "openblas" in os.path.basename(p) else 1)
    for p in paths:
        try:
            lib = ctypes.CDLL(p, mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        if hasattr(lib, "openblas_set_num_threads") and hasattr(lib, "openblas_get_num_threads"):
            lib.openblas_get_num_threads.restype = ctypes.c_int
            lib.openblas_set_num_threads.argtypes = [ctypes.c_int]
            return lib, p
    return None, None


def thread_cpu_seconds():
    """CPU seconds (user + system) of each thread of this process, by thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def matmul_check(n=1024, reps=8):
    """Times float32 n x n x n matmuls (OpenBLAS sgemm here) and counts the threads that
    worked on them. Returns (best seconds of one, threads that took >= 15% of the CPU time).

    The thread count is the check that openblas_set_num_threads took effect: it holds on a
    busy machine too, where the wall time of 2 threads need not beat 1."""
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    torch.mm(a, b)  # first call: pool start-up
    before = thread_cpu_seconds()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    after = thread_cpu_seconds()
    used = [after[t] - before.get(t, 0.0) for t in after]
    total = sum(u for u in used if u > 0)
    busy = sum(1 for u in used if total > 0 and u >= 0.15 * total)
    return best, busy


def apply_threads(args):
    """Applies --aten-threads / --blas-threads; returns the effective settings."""
    blas, blas_path = loaded_openblas()
    if BLAS_DIR is not None and (blas_path is None or not blas_path.startswith(BLAS_DIR + "/")):
        sys.exit(f"peers.py: --blas-build asked for the OpenBLAS in {BLAS_DIR}, but torch loaded {blas_path}.")
    if blas is not None and hasattr(blas, "openblas_get_parallel"):
        blas.openblas_get_parallel.restype = ctypes.c_int
        build = {0: "sequential", 1: "pthread", 2: "openmp"}.get(blas.openblas_get_parallel(), "unknown")
    else:
        build = None
    default_aten = torch.get_num_threads()
    default_blas = blas.openblas_get_num_threads() if blas is not None else None
    if args.aten_threads is not None:
        torch.set_num_threads(args.aten_threads)
    if args.blas_threads is not None:
        if blas is None:
            sys.exit("peers.py: --blas-threads needs OpenBLAS, but no loaded library exports "
                     "openblas_set_num_threads (torch uses another BLAS here).")
        blas.openblas_set_num_threads(args.blas_threads)
        if blas.openblas_get_num_threads() != args.blas_threads:
            sys.exit(f"peers.py: openblas_set_num_threads({args.blas_threads}) did not take: OpenBLAS "
                     f"reports {blas.openblas_get_num_threads()} threads.")
    out = {
        "requested": ",".join(x for x in (
            f"aten={args.aten_threads}" if args.aten_threads is not None else "",
            f"blas={args.blas_threads}" if args.blas_threads is not None else "",
            f"build={args.blas_build}" if args.blas_build != "system" else "") if x) or "default",
        "aten_threads": torch.get_num_threads(),
        "blas_threads": blas.openblas_get_num_threads() if blas is not None else None,
        "default_aten_threads": default_aten,
        "default_blas_threads": default_blas,
        "interop_threads": torch.get_num_interop_threads(),
        "blas_library": blas_path,
        "blas_build": build,
        "cpus": len(os.sched_getaffinity(0)),
    }
    return out


# --------------------------------------------------------------------------------------------
# Ops, written as remat writes them (src/ops/).
# --------------------------------------------------------------------------------------------

def attention_math(q, k, v, p, training, future):
    """remat's math attention (src/ops/attention.cpp): q [B, T, Hq, D], k, v [B, T, Hkv, D].

    The G = Hq / Hkv query heads of a key/value group are stacked along rows, so one batched
    matmul against that group's K and V serves them all without repeating K or V (query head
    h uses key/value head h // G, as in Hugging Face's repeat_kv). Scores are
    (q / sqrt(D)) k^T, the future masked to -inf, softmax, dropout on the probabilities,
    times V. The scale is folded into the GEMM (baddbmm's alpha), as remat folds it into
    the copy of q the GEMM needs anyway.
    """
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    q_rows = q.reshape(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B * Hkv, G * T, D)
    k_cols = k.permute(0, 2, 3, 1).reshape(B * Hkv, D, T)
    v_rows = v.permute(0, 2, 1, 3).reshape(B * Hkv, T, D)
    empty = q.new_empty(1, 1, 1)  # beta = 0: its values are never read
    scores = torch.baddbmm(empty, q_rows, k_cols, beta=0.0, alpha=1.0 / math.sqrt(D))
    scores.view(B * Hq, T, T).masked_fill_(future[:T, :T], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if p > 0.0:
        probs = F.dropout(probs, p, training)
    out_rows = torch.bmm(probs, v_rows)  # [B*Hkv, G*T, D]
    return out_rows.view(B, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, Hq * D)


def sdpa_has_enable_gqa():
    """Whether F.scaled_dot_product_attention takes enable_gqa (PyTorch >= 2.5): tried on
    tiny tensors, since the builtin has no inspectable signature."""
    try:
        x = torch.zeros(1, 2, 1, 2)
        F.scaled_dot_product_attention(x, x[:, :1], x[:, :1], enable_gqa=True)
        return True
    except TypeError:
        return False


def attention_sdpa(q, k, v, p, training, future):
    """torch.nn.functional.scaled_dot_product_attention (PyTorch >= 2.0), causal.

    Grouped heads go to the kernel as they are with enable_gqa (2.5+: query head h reads
    key/value head h // G); before 2.5, K and V are repeated G times (repeat_interleave
    over heads, Hugging Face's repeat_kv). On CPU, PyTorch 2.x runs its flash kernel
    without dropout and its math path (bmm, softmax, bernoulli_) with it."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2)
    vh = v.transpose(1, 2)
    kwargs = {}
    if G > 1 and SDPA_GQA:
        kwargs["enable_gqa"] = True
    elif G > 1:
        kh = kh[:, :, None].expand(B, Hkv, G, T, D).reshape(B, Hq, T, D)
        vh = vh[:, :, None].expand(B, Hkv, G, T, D).reshape(B, Hq, T, D)
    out = F.scaled_dot_product_attention(qh, kh, vh, dropout_p=p if training else 0.0, is_causal=True, **kwargs)
    return out.transpose(1, 2).reshape(B, T, Hq * D)


def is_compiling():
    """Whether torch.compile (dynamo) is tracing the caller; False on a torch without it."""
    f = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    if f is None:
        f = getattr(getattr(torch, "_dynamo", None), "is_compiling", None)
    return bool(f()) if f is not None else False


# How deep the eager step is inside attention() (the sac policies keep the attention's work).
_ATTENTION_DEPTH = [0]


def attention(c, q, k, v, training, future):
    """The block's attention (c.attention_fn), marked as the attention region whose result
    the sac policies keep (sac_context). In eager a counter marks it; under torch.compile the
    policy reads the traced frames instead (the counter would only change when the graph runs)."""
    if is_compiling():
        return c.attention_fn(q, k, v, c.dropout, training, future)
    _ATTENTION_DEPTH[0] += 1
    try:
        return c.attention_fn(q, k, v, c.dropout, training, future)
    finally:
        _ATTENTION_DEPTH[0] -= 1


def rope_tables(seq_len, head_dim, theta, dtype):
    """remat's rope_tables: inv_freq[i] = theta^(-2i/D), angle[t, i] = t * inv_freq[i], in
    float64, then cos and sin cast to the compute dtype; [seq_len, D/2] each."""
    inv_freq = torch.pow(theta, torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim).reciprocal()
    angle = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return angle.cos().to(dtype), angle.sin().to(dtype)


def rope(x, cos, sin):
    """remat's rotation (src/ops/rope.cpp) of x [B, T, H, D]: each (x1, x2) = (x[..., :D/2],
    x[..., D/2:]) pair rotates by the table angle: out1 = x1 cos - x2 sin,
    out2 = x2 cos + x1 sin (Hugging Face's rotate_half convention)."""
    T, half = x.shape[1], x.shape[3] // 2
    c = cos[:T].view(1, T, 1, half)
    s = sin[:T].view(1, T, 1, half)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def rmsnorm(x, w, eps):
    """y = x / sqrt(mean(x^2) + eps) * w (remat's rmsnorm: normalise in float32, round to x's
    dtype, then scale; in float32 the casts are no-ops)."""
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True, dtype=torch.float32) + eps)
    return (x * rstd).to(x.dtype) * w


def linear(x, w, name):
    """The layer `name` of the weights w: x w[name.weight]^T + w[name.bias] (no bias where absent)."""
    return F.linear(x, w[name + ".weight"], w.get(name + ".bias"))


def layer_norm(x, w, name, eps):
    return F.layer_norm(x, x.shape[-1:], w[name + ".weight"], w[name + ".bias"], eps)


def compute_weights(module, dtype):
    """remat's compute_weights(): the module's parameters in the compute dtype, by name. In
    float32 they are the parameters themselves; in bfloat16 a cast copy of each, made once a
    step outside any checkpoint (as remat's is), through which the gradients reach the
    float32 parameters."""
    return {n: p.to(dtype) for n, p in module.named_parameters()}


class ChunkedCrossEntropy(torch.autograd.Function):
    """remat's loss head (src/ops/cross_entropy.cpp), for --ce-chunk N > 0: the logits of N
    tokens at a time, never all [tokens, vocab] at once; the forward keeps x, the targets
    and each row's log-sum-exp, and the backward recomputes each chunk's logits. The logits,
    log-sum-exps, loss and dw are float32 whatever the compute dtype, as remat's are."""

    @staticmethod
    def forward(ctx, x, w, targets, chunk):
        n_rows = x.shape[0]
        lse = x.new_empty(n_rows, dtype=torch.float32)
        loss = x.new_zeros((), dtype=torch.float32)
        for start in range(0, n_rows, chunk):
            n = min(chunk, n_rows - start)
            logits = torch.mm(x[start:start + n], w.t()).float()
            target_logit = logits.gather(1, targets[start:start + n, None]).squeeze(1)
            mx = logits.amax(1, keepdim=True)
            logits.sub_(mx).exp_()
            lse_c = lse[start:start + n]
            torch.sum(logits, 1, out=lse_c)
            lse_c.log_().add_(mx.squeeze(1))
            loss.add_((lse_c - target_logit).sum())
        loss.div_(n_rows)
        ctx.save_for_backward(x, w, targets, lse)
        ctx.chunk = chunk
        return loss

    @staticmethod
    def backward(ctx, dloss):
        x, w, targets, lse = ctx.saved_tensors
        n_rows = x.shape[0]
        scale = dloss / n_rows
        dx = torch.empty_like(x)
        dw = torch.zeros_like(w, dtype=torch.float32)
        for start in range(0, n_rows, ctx.chunk):
            n = min(ctx.chunk, n_rows - start)
            x_c = x[start:start + n]
            dl = torch.mm(x_c, w.t()).float()
            dl.sub_(lse[start:start + n, None]).exp_().mul_(scale)
            dl.scatter_add_(1, targets[start:start + n, None], (-scale).expand(n, 1).contiguous())
            torch.mm(dl.to(x.dtype), w, out=dx[start:start + n])
            dw.addmm_(dl.t(), x_c.float())
        return dx, dw.to(w.dtype), None, None


def cross_entropy(logits, targets):
    """Mean cross-entropy of logits [N, V] against targets [N]: the loss function that
    --compile-blocks compiles on its own, as torchtitan compiles its loss ("loss" among
    compile.components) apart from the blocks, the head's matmul staying eager."""
    return F.cross_entropy(logits, targets)


def loss_head(h, w, targets, ce_chunk, loss_fn=cross_entropy):
    """Mean cross-entropy over all tokens of h [B, T, C] through w [V, C]."""
    x = h.reshape(-1, h.shape[-1])
    t = targets.reshape(-1)
    if ce_chunk > 0:
        return ChunkedCrossEntropy.apply(x, w, t, ce_chunk)
    return loss_fn(F.linear(x, w), t)


# --------------------------------------------------------------------------------------------
# Models. Parameter names follow Hugging Face (as remat's do), so counts compare line by line.
# --------------------------------------------------------------------------------------------

class Gpt2Block(nn.Module):
    """Pre-LN block (src/model/gpt2.cpp): x1 = x + drop(c_proj(attn(ln_1(x)))),
    out = x1 + drop(mlp_c_proj(gelu_tanh(c_fc(ln_2(x1))))); attention dropout on the
    probabilities. The modules hold the float32 parameters; forward reads the compute
    weights w (compute_weights) by the same names."""

    def __init__(self, c):
        super().__init__()
        C, F_ = c.d_model, c.d_ff
        self.ln_1 = nn.LayerNorm(C, eps=c.norm_eps)
        self.c_attn = nn.Linear(C, 3 * C)
        self.c_proj = nn.Linear(C, C)
        self.ln_2 = nn.LayerNorm(C, eps=c.norm_eps)
        self.c_fc = nn.Linear(C, F_)
        self.mlp_c_proj = nn.Linear(F_, C)
        self.c = c

    def forward(self, x, w, future):
        c = self.c
        B, T, C = x.shape
        H, D = c.heads, C // c.heads
        qkv = linear(layer_norm(x, w, "ln_1", c.norm_eps), w, "c_attn")
        q, k, v = (t.view(B, T, H, D) for t in qkv.split(C, dim=-1))
        a = attention(c, q, k, v, self.training, future)
        x1 = x + F.dropout(linear(a, w, "c_proj"), c.dropout, self.training)
        m = linear(F.gelu(linear(layer_norm(x1, w, "ln_2", c.norm_eps), w, "c_fc"), approximate="tanh"), w,
                   "mlp_c_proj")
        return x1 + F.dropout(m, c.dropout, self.training)


class LlamaBlock(nn.Module):
    """Block of src/model/llama.cpp: RMSNorm, q/k/v projections without bias, RoPE on q and k,
    grouped-query attention (dropout model.dropout on the probabilities), o_proj, residual;
    RMSNorm, SwiGLU (silu(gate) * up), down_proj, residual. The weights w as Gpt2Block's."""

    def __init__(self, c):
        super().__init__()
        C, F_, D = c.d_model, c.d_ff, c.d_model // c.heads
        KV = c.kv_heads * D
        self.input_layernorm = nn.Parameter(torch.ones(C))
        self.q_proj = nn.Linear(C, C, bias=False)
        self.k_proj = nn.Linear(C, KV, bias=False)
        self.v_proj = nn.Linear(C, KV, bias=False)
        self.o_proj = nn.Linear(C, C, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(C))
        self.gate_proj = nn.Linear(C, F_, bias=False)
        self.up_proj = nn.Linear(C, F_, bias=False)
        self.down_proj = nn.Linear(F_, C, bias=False)
        self.c = c

    def forward(self, x, w, future, cos, sin):
        c = self.c
        B, T, C = x.shape
        Hq, Hkv, D = c.heads, c.kv_heads, C // c.heads
        n1 = rmsnorm(x, w["input_layernorm"], c.norm_eps)
        q = rope(linear(n1, w, "q_proj").view(B, T, Hq, D), cos, sin)
        k = rope(linear(n1, w, "k_proj").view(B, T, Hkv, D), cos, sin)
        v = linear(n1, w, "v_proj").view(B, T, Hkv, D)
        x1 = x + linear(attention(c, q, k, v, self.training, future), w, "o_proj")
        n2 = rmsnorm(x1, w["post_attention_layernorm"], c.norm_eps)
        return x1 + linear(F.silu(linear(n2, w, "gate_proj")) * linear(n2, w, "up_proj"), w, "down_proj")


# How deep the eager step is inside a block's forward (--count-ops: in the backward, that is
# the checkpoint recomputing it). Counted only while an OpCounter runs.
_BLOCK_DEPTH = [0]
_COUNTING = [False]


def run_block(block, x, w, *extra):
    """One block's forward; the function that checkpoint re-runs in the backward."""
    if not _COUNTING[0]:
        return block(x, w, *extra)
    _BLOCK_DEPTH[0] += 1
    try:
        return block(x, w, *extra)
    finally:
        _BLOCK_DEPTH[0] -= 1


class BlockRunner(nn.Module):
    """A block as the step runs it: plain, or under torch.utils.checkpoint with the policy's
    kwargs. This is torchtitan's checkpoint_wrapper(block) (CheckpointImpl.NO_REENTRANT calls
    torch.utils.checkpoint.checkpoint(block, ..., use_reentrant=False, **kwargs)), and the
    unit that --compile-blocks compiles, as torchtitan compiles each wrapped block. It is
    kept outside the Model's modules (a plain list), so parameter names stay Hugging Face's."""

    def __init__(self, block, checkpoint_kwargs):
        super().__init__()
        self.block = block
        self.checkpoint_kwargs = checkpoint_kwargs  # None: not checkpointed

    def forward(self, x, w, *extra):
        if self.checkpoint_kwargs is None:
            return run_block(self.block, x, w, *extra)
        return torch_checkpoint.checkpoint(run_block, self.block, x, w, *extra, **self.checkpoint_kwargs)


class Model(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        C, V = c.d_model, c.vocab
        if c.arch == "gpt2":
            self.wte = nn.Parameter(torch.empty(V, C))
            self.wpe = nn.Parameter(torch.empty(c.max_seq, C))
            self.h = nn.ModuleList(Gpt2Block(c) for _ in range(c.layers))
            self.ln_f = nn.LayerNorm(C, eps=c.norm_eps)
        else:
            self.embed_tokens = nn.Parameter(torch.empty(V, C))
            self.layers = nn.ModuleList(LlamaBlock(c) for _ in range(c.layers))
            self.norm = nn.Parameter(torch.ones(C))
            self.lm_head = nn.Parameter(torch.empty(V, C))
            cos, sin = rope_tables(c.max_seq, C // c.heads, c.rope_theta, c.compute_dtype)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        future = torch.ones(c.max_seq, c.max_seq, dtype=torch.bool).triu_(1)
        self.register_buffer("future", future, persistent=False)
        self.init_weights(c.seed)
        # Checkpoint wrappers as torchtitan's apply_ac: block i (from 1) is checkpointed when
        # checkpoint_every divides i (every block for full and the sac policies).
        blocks = self.h if c.arch == "gpt2" else self.layers
        self.block_fns = [BlockRunner(b, c.checkpoint_kwargs if c.checkpoint_every and (i + 1) % c.checkpoint_every == 0
                                      else None) for i, b in enumerate(blocks)]
        self.loss_fn = cross_entropy

    def compile_blocks(self):
        """--compile-blocks: torchtitan's apply_compile, torch.compile of each (checkpoint-
        wrapped) block after the wrapping, plus the loss function on its own; the embedding,
        final norm and head matmul stay eager. Compiling the wrapper puts the checkpoint, and
        a sac policy, inside the compiled region, where AOTAutograd's partitioner follows the
        policy's save/recompute marks."""
        self.block_fns = [torch.compile(r) for r in self.block_fns]
        self.loss_fn = torch.compile(cross_entropy)

    def init_weights(self, seed):
        """remat's init_param: biases 0, norm weights 1, matrices N(0, init_std), the residual
        branches' output projections N(0, init_std / sqrt(2 n_layer))."""
        gen = torch.Generator().manual_seed(seed)
        residual_out = ("c_proj.weight", "o_proj.weight", "down_proj.weight")  # mlp_c_proj too
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith(".bias"):
                    p.zero_()
                elif p.dim() == 1:
                    p.fill_(1.0)
                else:
                    std = self.c.init_std
                    if name.endswith(residual_out):
                        std /= math.sqrt(2.0 * self.c.layers)
                    p.normal_(0.0, std, generator=gen)

    def forward(self, tokens, targets):
        c = self.c
        T = tokens.shape[1]
        if c.arch == "gpt2":
            wte = self.wte.to(c.compute_dtype)  # one copy for the embedding and the tied head
            x = F.dropout(F.embedding(tokens, wte) + self.wpe.to(c.compute_dtype)[:T], c.dropout, self.training)
            blocks = self.h
        else:
            x = F.embedding(tokens, self.embed_tokens.to(c.compute_dtype))
            blocks = self.layers
        extra = (self.future,) if c.arch == "gpt2" else (self.future, self.rope_cos, self.rope_sin)
        for block, block_fn in zip(blocks, self.block_fns):
            # The compute weights are made outside any checkpoint (never recomputed).
            w = compute_weights(block, c.compute_dtype)
            x = block_fn(x, w, *extra)
        if c.arch == "gpt2":
            ln_f = compute_weights(self.ln_f, c.compute_dtype)
            h = F.layer_norm(x, x.shape[-1:], ln_f["weight"], ln_f["bias"], c.norm_eps)
            return loss_head(h, wte, targets, c.ce_chunk, self.loss_fn)  # tied head
        h = rmsnorm(x, self.norm.to(c.compute_dtype), c.norm_eps)
        return loss_head(h, self.lm_head.to(c.compute_dtype), targets, c.ce_chunk, self.loss_fn)  # untied head


def checkpoint_params():
    """The keyword parameters this torch's torch.utils.checkpoint.checkpoint takes."""
    try:
        return set(inspect.signature(torch_checkpoint.checkpoint).parameters)
    except (TypeError, ValueError):
        return set()


def checkpoint_kwargs(preserve_rng_state):
    """torchtitan's checkpoint_wrapper settings (its ActivationCheckpoint config defaults):
    non-reentrant checkpoint (use_reentrant=False, which torch 1.13 accepts too: the saved-
    tensor-hooks implementation, which also works when the block input needs no grad),
    early_stop=False (the whole block is re-run; where this torch has the argument) and
    preserve_rng_state as resolved by --preserve-rng-state."""
    params = checkpoint_params()
    kw = {}
    if "use_reentrant" in params:
        kw["use_reentrant"] = False
    if "early_stop" in params:
        kw["early_stop"] = False
    kw["preserve_rng_state"] = preserve_rng_state
    return kw


SDPA_GQA = hasattr(F, "scaled_dot_product_attention") and sdpa_has_enable_gqa()


def _op(path):
    """torch.ops.<path> (e.g. 'aten.mm.default'), or None where this torch lacks it."""
    obj = torch.ops
    for part in path.split("."):
        try:
            obj = getattr(obj, part)
        except (AttributeError, RuntimeError):
            return None
    return obj


def _ops(paths):
    return {o for o in map(_op, paths) if o is not None}


class SacOps:
    """The op sets of the sac policies, resolved once (this torch's overloads only).

    keep: torchtitan's _op_sac_save_list (torchtitan/models/llama3/infra/parallelize.py, read
    at commit 018740b7; the rule in torchtitan/distributed/activation_checkpoint.py at
    cfb93265): mm, the fused
    SDPA kernels (flash, efficient, cudnn, the overrideable one and the math one, which is
    CompositeImplicitAutograd and so never reaches a dispatch mode in eager), the
    collectives reduce_scatter_tensor and all_to_all_single, max (kept for float8 scales),
    flex_attention and inductor_compiled_code; plus two spellings of the same work that its
    models never dispatch: addmm (a linear layer with a bias: GPT-2's c_attn, c_proj, c_fc,
    mlp_c_proj) and _scaled_dot_product_flash_attention_for_cpu (the CPU flash kernel).
    counted: the linear matmuls (mm, addmm) that the every-second rule counts.
    """

    def __init__(self):
        self.counted = _ops(["aten.mm.default", "aten.addmm.default"])
        self.keep = self.counted | _ops([
            "aten._scaled_dot_product_flash_attention.default",
            "aten._scaled_dot_product_flash_attention_for_cpu.default",
            "aten._scaled_dot_product_efficient_attention.default",
            "aten._scaled_dot_product_cudnn_attention.default",
            "aten._scaled_dot_product_fused_attention_overrideable.default",
            "aten._scaled_dot_product_attention_math.default",
            "_c10d_functional.reduce_scatter_tensor.default",
            "_c10d_functional.all_to_all_single.default",
            "aten.max.default"])
        hops = getattr(torch, "_higher_order_ops", None)
        for name in ("flex_attention", "inductor_compiled_code"):
            if hops is not None and getattr(hops, name, None) is not None:
                self.keep.add(getattr(hops, name))
        self.softmax = _ops(["aten._softmax.default", "aten._safe_softmax.default"])
        # Ops that draw random numbers (CPU dropout is empty_like, bernoulli_, div_, mul; CUDA's
        # is native_dropout), and the allocation a CPU mask is drawn into.
        self.random = _ops(["aten.bernoulli_.float", "aten.bernoulli_.Tensor", "aten.bernoulli.default",
                            "aten.bernoulli.p", "aten.native_dropout.default", "aten.uniform_.default",
                            "aten.normal_.default", "aten.rand_like.default", "aten.randn_like.default"])
        self.mask_buffer = _ops(["aten.empty_like.default"])
        self.to_copy = _op("aten._to_copy.default")


def _is_view(func):
    """Whether an aten overload returns a view of an input: OpOverload.is_view, or on a torch
    without it (1.13) a return that aliases an input without writing it."""
    flag = getattr(func, "is_view", None)
    if flag is not None:
        return bool(flag)
    try:
        return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
    except AttributeError:
        return False


def _storage_key(t):
    """The data pointer of t's storage in eager; None for a traced (fake) tensor."""
    try:
        p = t.untyped_storage().data_ptr()
    except Exception:  # FakeTensor / FunctionalTensor under torch.compile
        return None
    return p or None


def _in_attention():
    """Whether the op being dispatched is part of attention(): in eager by its counter, under
    torch.compile by the traced frames of the node being traced (dynamo's stack_trace)."""
    if _ATTENTION_DEPTH[0]:
        return True
    meta = getattr(fx_traceback, "current_meta", None) if fx_traceback is not None else None
    trace = (meta.get("stack_trace") or "") if isinstance(meta, dict) else ""
    return "in attention_math" in trace or "in attention_sdpa" in trace


def sac_context(rule):
    """context_fn for torch.utils.checkpoint: a fresh policy state per checkpointed block call,
    as torchtitan's selective_checkpointing_context_fn makes a fresh mm counter per call.

    rule "sac" is torchtitan's per-op rule (_apply_op_sac): the outputs of its save list
    (SacOps.keep) are MUST_SAVE, except that every second linear matmul is recomputed: each
    block counts its forward mm calls (here mm and addmm) and keeps the 1st, 3rd, 5th, ...
    (llama: q, v, gate, down kept; k, o, up recomputed; GPT-2: c_attn, c_fc kept; c_proj,
    mlp_c_proj recomputed). Every other op is PREFER_RECOMPUTE. Rule "sac-all-mm" keeps every
    linear matmul (torchtitan's list without the every-second clause; remat's
    ops:[matmul,attention]).

    Two additions cover what torchtitan's models never dispatch, so that the peer keeps what
    torchtitan keeps where the kernels differ:
    - The attention's result is kept. A fused kernel (flash, efficient, cudnn; on the CPU the
      flash kernel without dropout) is one op on the list. The math path (--attention math,
      and SDPA on the CPU with dropout, which decomposes into bmm, softmax, dropout, bmm) has
      no op on the list: under torchtitan's list alone all of it would be recomputed. Here,
      from its softmax on, every op inside attention() is kept (probabilities, dropout mask,
      dropped probabilities, output: what its backward reads, the memory `none` keeps for
      them), and the scores before the softmax are recomputed, as a fused kernel's backward
      recomputes them. Views are recomputed (they cost nothing and would pin their bases).
    - Dropout masks are drawn once and kept (the empty_like a mask is drawn into, the
      bernoulli_ and the in-place scaling of it). A mask kept inside the attention would
      otherwise shift the generator for the masks redrawn after it, so no mask is redrawn
      and the recompute draws no random numbers; CPU bernoulli_ is also a serial, slow op.
    Both need allow_cache_entry_mutation: a kept buffer is written in place after it is kept.
    """
    ops = SAC_OPS[0]
    policy_type = torch_checkpoint.CheckpointPolicy
    keep, recompute = policy_type.MUST_SAVE, policy_type.PREFER_RECOMPUTE
    every_second = rule == "sac"

    def sac_context_fn():
        # One state for the forward and one for the recompute (torch < 2.5 asks the policy
        # again while recomputing and must get the same answers; later torch does not ask).
        states = {False: {"mm": 0, "softmax": False, "kept": set()},
                  True: {"mm": 0, "softmax": False, "kept": set()}}

        def policy(ctx, func, *args, **kwargs):
            st = states[bool(getattr(ctx, "is_recompute", False))]
            # torchtitan's first case: device-to-host copies are kept (activation offloading).
            if (func is ops.to_copy and args and isinstance(args[0], torch.Tensor) and
                    args[0].device.type == "cuda" and str(kwargs.get("device", "")) == "cpu"):
                return keep
            if func in ops.counted:
                st["mm"] += 1
                return keep if not every_second or st["mm"] % 2 == 1 else recompute
            if func in ops.keep:
                return keep
            if func in ops.random or func in ops.mask_buffer:
                if func in ops.random and args and isinstance(args[0], torch.Tensor):
                    st["kept"].add(_storage_key(args[0]))  # an in-place draw: its buffer
                return keep
            schema = getattr(func, "_schema", None)
            if schema is not None and schema.name.endswith("_") and args and isinstance(args[0], torch.Tensor):
                key = _storage_key(args[0])
                if key is not None and key in st["kept"]:
                    return keep  # in place on a kept mask (dropout's div_): kept with it
            if _in_attention():
                if func in ops.softmax:
                    st["softmax"] = True
                if st["softmax"] and not _is_view(func):
                    return keep
            return recompute

        kw = {}
        if "allow_cache_entry_mutation" in inspect.signature(
                torch_checkpoint.create_selective_checkpoint_contexts).parameters:
            kw["allow_cache_entry_mutation"] = True
        return torch_checkpoint.create_selective_checkpoint_contexts(policy, **kw)

    return sac_context_fn


SAC_OPS = [None]  # SacOps(), made when a sac policy is chosen


# --------------------------------------------------------------------------------------------
# The step, as remat's TrainStep::run.
# --------------------------------------------------------------------------------------------

def learning_rate(c, step):
    """remat's learning_rate(): linear warm-up, then cosine to min_lr over train.steps, which
    remat bench sets to warmup + steps."""
    total = c.warmup + c.steps
    if step < c.lr_warmup:
        return c.lr * (step + 1) / c.lr_warmup
    span = max(1, total - 1 - c.lr_warmup)
    progress = min(1.0, (step - c.lr_warmup) / span)
    return c.min_lr + 0.5 * (c.lr - c.min_lr) * (1.0 + math.cos(math.pi * progress))


def fused_adamw_works(device):
    """Whether this torch's AdamW takes fused=True for parameters on `device` (2.0 added it
    for CUDA, 2.4 for the CPU): one step on a throw-away parameter."""
    try:
        p = torch.zeros(2, device=device, requires_grad=True)
        p.grad = torch.ones_like(p)
        torch.optim.AdamW([p], fused=True).step()
        return True
    except (TypeError, RuntimeError, ValueError):
        return False


def resolve_optimizer(c):
    """--optimizer auto|fused|foreach|for-loop -> the implementation that runs. auto is
    torchtitan's default (optimizer.implementation = "fused") where this torch has the fused
    kernel on the device, else torch's own default there (foreach on CUDA, for-loop on the
    CPU)."""
    if c.optimizer in ("auto", "fused"):
        if fused_adamw_works(c.device):
            return "fused"
        if c.optimizer == "fused":
            sys.exit(f"peers.py: --optimizer fused: torch {torch.__version__}'s AdamW has no fused kernel for "
                     f"{c.device.type} parameters (PyTorch 2.0 added it for CUDA, 2.4 for the CPU).")
        return "foreach" if c.device.type == "cuda" else "for-loop"
    return c.optimizer


def make_optimizer(model, c):
    """AdamW in two groups as remat's adamw_groups(): weight decay on matrices (dim >= 2,
    embeddings included), none on norms and biases; betas (0.9, 0.95), eps 1e-8. The
    implementation (c.optimizer_impl) is passed explicitly, as torchtitan's build_optimizers
    passes fused= and foreach=."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    impl = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[c.optimizer_impl]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": c.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=c.lr, betas=(c.beta1, c.beta2), eps=1e-8, **impl)


@torch.no_grad()
def clip_gradients(params, max_norm):
    """remat's clip_gradients(): one global L2 norm; scale only when it exceeds max_norm."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = math.sqrt(torch.stack([g.pow(2).sum() for g in grads]).double().sum().item())
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for g in grads:
            g.mul_(scale)
    return norm


def sync(device):
    """Waits for the kernels queued on a CUDA device, which run asynchronously to Python."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(model, opt, params, c, step, gen, counter=None):
    """One step; `counter` (an OpCounter, --count-ops) is told which phase runs."""
    for g in opt.param_groups:
        g["lr"] = learning_rate(c, step)
    sync(c.device)
    t0 = time.perf_counter()
    # A fresh batch each step, drawn inside the timed region as remat's data.sample is; drawn
    # on the CPU and moved, so that every device trains on the same tokens.
    seq = torch.randint(0, c.vocab, (c.batch, c.seq + 1), generator=gen).to(c.device)
    tokens, targets = seq[:, :-1], seq[:, 1:]
    opt.zero_grad(set_to_none=False)  # persistent gradients, as remat's flat gradient buffer
    loss = model(tokens, targets)
    if counter is not None:
        counter.phase = "backward"
    loss.backward()
    if counter is not None:
        counter.phase = "optimizer"
    clip_gradients(params, c.grad_clip)
    opt.step()
    sync(c.device)
    seconds = time.perf_counter() - t0
    return loss.item(), seconds


# --------------------------------------------------------------------------------------------
# Peak memory: live tensor bytes at the step's start plus the running peak of the
# allocations and frees the profiler records during one (untimed) step.
# --------------------------------------------------------------------------------------------

def live_tensor_bytes(extra_tensors):
    """Bytes of the distinct CPU storages of every tensor Python can reach now, plus
    `extra_tensors` (gradients live in C++ without a Python object until read)."""
    seen = {}

    def add(t):
        # Subclasses other than Parameter are torch.compile's data-less tensors (FakeTensor,
        # FunctionalTensor), which its caches keep alive.
        if type(t) not in (torch.Tensor, nn.Parameter) or t.is_sparse or t.device.type != "cpu":
            return
        # untyped_storage (2.x) spares TypedStorage's deprecation warning.
        s = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
        ptr = s.data_ptr()
        if ptr:
            seen[ptr] = s.nbytes()

    gc.collect()
    for o in gc.get_objects():
        try:
            if isinstance(o, torch.Tensor):
                add(o)
        except Exception:  # objects whose isinstance check raises (lazy modules)
            pass
    for t in extra_tensors:
        add(t)
    return sum(seen.values())


def profiled_peak(fn):
    """Runs fn() under torch.profiler with profile_memory=True and returns
    (highest running sum of the recorded allocation sizes, net change, result of fn).

    Each allocation and free of the CPU allocator is a "[memory]" event whose nbytes is
    +size or -size; their running sum in time order is the change of live tensor bytes."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    if events and hasattr(events[0], "start_ns"):  # 2.x: start_us is gone, start_ns replaces it
        events.sort(key=lambda e: e.start_ns())  # stable: same-instant events keep their order
    else:
        events.sort(key=lambda e: e.start_us())
    running = peak = 0
    for e in events:
        running += e.nbytes()
        peak = max(peak, running)
    return peak, running, result


def self_test_peak():
    """The measurement on a known case: 4 MiB, then 2 MiB more (peak 6 MiB), free the 4,
    1 MiB more, free all. Returns (peak, net) which must be (6 MiB, 0)."""
    def case():
        a = torch.empty(1 << 20)
        b = torch.empty(1 << 19)
        del a
        c = torch.empty(1 << 18)
        del b, c
    peak, net, _ = profiled_peak(case)
    return peak, net


# --------------------------------------------------------------------------------------------
# --count-ops: which aten ops a step runs in its forward, its recompute and its backward.
# --------------------------------------------------------------------------------------------

def _matmul_flops(name, args):
    """FLOPs of one matrix product (2 per multiply-add); 0 for other ops."""
    try:
        if name == "mm":
            a, b = args[0], args[1]
            return 2 * a.shape[0] * a.shape[1] * b.shape[1]
        if name == "addmm":
            a, b = args[1], args[2]
            return 2 * a.shape[0] * a.shape[1] * b.shape[1]
        if name == "bmm":
            a, b = args[0], args[1]
            return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
        if name == "baddbmm":
            a, b = args[1], args[2]
            return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
        if name.startswith("_scaled_dot_product_") and not name.endswith("_backward"):
            q, k = args[0], args[1]  # [B, H, T, D]: scores and output, causal or not
            return 4 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3]
    except (AttributeError, IndexError, TypeError):
        pass
    return 0


def make_op_counter():
    """An OpCounter (a TorchDispatchMode, PyTorch >= 1.13), or None where torch lacks it."""
    try:
        from torch.utils._python_dispatch import TorchDispatchMode
    except ImportError:
        return None

    class OpCounter(TorchDispatchMode):
        """Counts the aten ops that reach the dispatcher, by phase: "forward", "recompute" (in
        the backward, inside a block's forward: the checkpoint re-running it), "backward" and
        "optimizer" (clipping and AdamW). It is entered before the checkpoints' own modes, so
        it sees what runs: an op whose kept output a selective checkpoint hands back in the
        recompute is not counted there. View ops are counted under "(views)"."""

        def __init__(self):
            super().__init__()
            self.phase = "forward"
            self.ops = {}
            self.flops = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            phase = "recompute" if self.phase == "backward" and _BLOCK_DEPTH[0] else self.phase
            name = func.__name__.split(".")[0] if hasattr(func, "__name__") else str(func)
            key = "(views)" if _is_view(func) or name == "detach" else name
            counts = self.ops.setdefault(phase, {})
            counts[key] = counts.get(key, 0) + 1
            self.flops[phase] = self.flops.get(phase, 0) + _matmul_flops(name, args)
            return out

    return OpCounter()


def count_ops(step_fn, counter):
    """Runs step_fn(counter) with counter active; returns the per-phase op counts (most
    frequent first), their totals and the per-phase matmul GFLOP."""
    _COUNTING[0] = True
    try:
        with counter:
            step_fn(counter)
    finally:
        _COUNTING[0] = False
    phases = ("forward", "recompute", "backward", "optimizer")
    out = {
        "ops": {ph: dict(sorted(counter.ops.get(ph, {}).items(), key=lambda kv: (-kv[1], kv[0]))) for ph in phases},
        "op_totals": {ph: sum(counter.ops.get(ph, {}).values()) for ph in phases},
        "matmul_gflop": {ph: round(counter.flops.get(ph, 0) / 1e9, 4) for ph in phases},
    }
    return out


# --------------------------------------------------------------------------------------------
# Command line.
# --------------------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description="Plain-PyTorch GPT-2 / Llama training steps with remat's math, for side-by-side timing.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2")
    ap.add_argument("--device", default="cpu",
                    help="cpu, cuda or cuda:N: where the model, its gradients, AdamW's state and the batches live")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="remat's run.dtype: bfloat16 keeps the parameters, gradients and AdamW state in float32 "
                         "and computes in a bfloat16 copy of the weights (activations bfloat16, norm and loss "
                         "statistics float32)")
    ap.add_argument("--policy", default="none",
                    help="none; full: torchtitan's full AC, a non-reentrant checkpoint around every block; every:K: "
                         "around blocks K, 2K, ... (counting from 1, torchtitan's selective_ac_option=K and remat's "
                         "every:K); sac: torchtitan's per-op selective AC of every block (keeps every second linear "
                         "matmul's output and the attention's, recomputes the rest; PyTorch >= 2.4); sac-all-mm: "
                         "the same keeping every linear matmul's output (remat's ops:[matmul,attention])")
    ap.add_argument("--preserve-rng-state", choices=["auto", "true", "false"], default="auto",
                    help="the checkpoints' preserve_rng_state: auto is true when the model draws dropout masks "
                         "(dropout > 0; a recompute must redraw the forward's masks, as remat's "
                         "ac.preserve_rng_state=true) and false otherwise (torchtitan's default)")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the whole model (forward and backward, default mode; PyTorch >= 2.0); the "
                         "warm-up steps cover the compilation")
    ap.add_argument("--compile-blocks", action="store_true",
                    help="torchtitan's compile: torch.compile each (checkpoint-wrapped) block and the loss function "
                         "apart; the embedding, final norm and head matmul stay eager (PyTorch >= 2.0)")
    ap.add_argument("--optimizer", choices=["auto", "fused", "foreach", "for-loop"], default="auto",
                    help="AdamW's implementation: auto is fused where this torch has the kernel for the device "
                         "(torchtitan's default; CPU from PyTorch 2.4), else torch's default there")
    ap.add_argument("--count-ops", action="store_true",
                    help="run one more, untimed step that counts the aten ops of its forward, recompute, backward "
                         "and optimizer phases (and their matmul GFLOP); adds op_counts to the JSON (eager only)")
    ap.add_argument("--memory-budget", type=float, default=None,
                    help="with --compile or --compile-blocks: torch._functorch.config.activation_memory_budget (0 "
                         "to 1; 1 keeps what the default partitioner keeps, lower recomputes more; PyTorch >= 2.4)")
    ap.add_argument("--attention", choices=["math", "sdpa"], default="math",
                    help="math: scores, mask, softmax, dropout, matmul (remat's math op); "
                         "sdpa: F.scaled_dot_product_attention (PyTorch >= 2.0)")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d-model", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--kv-heads", type=int, default=None, help="default: heads for gpt2, 2 for llama")
    ap.add_argument("--d-ff", type=int, default=None, help="default: 4*d_model for gpt2, 1024 for llama")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--max-seq", type=int, default=None,
                    help="context length (learned positions / RoPE tables); default: --seq")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dropout", type=float, default=None, help="default: 0.1 for gpt2, 0.0 for llama")
    ap.add_argument("--norm-eps", type=float, default=1e-5)
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--init-std", type=float, default=0.02)
    ap.add_argument("--ce-chunk", type=int, default=0,
                    help="0: plain F.cross_entropy over all logits; N > 0: remat's chunked loss head "
                         "(N tokens of logits at a time, recomputed in the backward; remat's default is 1024)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr", type=float, default=3e-4)
    ap.add_argument("--lr-warmup", type=int, default=50, help="learning-rate warm-up steps (train.warmup)")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--beta1", type=float, default=0.9)
    ap.add_argument("--beta2", type=float, default=0.95)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--warmup", type=int, default=3, help="unmeasured steps first")
    ap.add_argument("--steps", type=int, default=10, help="measured steps")
    ap.add_argument("--aten-threads", type=int, default=None,
                    help="torch.set_num_threads(N); default: leave PyTorch's default")
    ap.add_argument("--blas-threads", type=int, default=None,
                    help="openblas_set_num_threads(N) on the loaded OpenBLAS; default: leave it")
    ap.add_argument("--blas-build", choices=["system", "openmp", "pthread"], default="system",
                    help="which of Debian's OpenBLAS builds torch loads: the system's libblas.so.3 choice, or "
                         "the OpenMP build (its threads are ATen's OpenMP pool, as remat links) or the pthread "
                         "build (a pool of its own), by LD_LIBRARY_PATH")
    ap.add_argument("--malloc", choices=["system", "keep"], default="system",
                    help="system: glibc malloc as it comes; keep: re-run with GLIBC_TUNABLES that keep freed blocks "
                         "up to 32 MiB in the heap (mmap threshold 32 MiB, no trimming), so that a step reuses "
                         "memory instead of faulting in fresh pages")
    ap.add_argument("--no-peak", action="store_true", help="skip the extra profiled step that measures peak memory")
    ap.add_argument("--no-matmul-check", action="store_true", help="skip timing one 1024^3 matmul at start-up")
    ap.add_argument("--param-count", action="store_true",
                    help="print the parameter count as JSON and exit (no training)")
    args = ap.parse_args(argv)
    if args.kv_heads is None:
        args.kv_heads = args.heads if args.arch == "gpt2" else 2
    if args.d_ff is None:
        args.d_ff = 4 * args.d_model if args.arch == "gpt2" else 1024
    if args.dropout is None:
        args.dropout = 0.1 if args.arch == "gpt2" else 0.0
    if args.max_seq is None:
        args.max_seq = args.seq
    if args.d_model % args.heads:
        ap.error(f"--d-model ({args.d_model}) must be divisible by --heads ({args.heads}).")
    if args.heads % args.kv_heads:
        ap.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads}).")
    if args.arch == "gpt2" and args.kv_heads != args.heads:
        ap.error("gpt2 has no grouped-query attention: --kv-heads must equal --heads.")
    if args.arch == "llama" and (args.d_model // args.heads) % 2:
        ap.error("RoPE needs an even head dimension (d_model / heads).")
    if args.seq > args.max_seq:
        ap.error(f"--seq ({args.seq}) exceeds --max-seq ({args.max_seq}).")
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be at least 1 and --warmup at least 0.")
    for name in ("aten_threads", "blas_threads"):
        v = getattr(args, name)
        if v is not None and v < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1.")
    try:
        args.device = torch.device(args.device)
    except RuntimeError:
        ap.error(f"--device {args.device}: use cpu, cuda or cuda:N.")
    if args.device.type not in ("cpu", "cuda"):
        ap.error(f"--device {args.device}: use cpu, cuda or cuda:N.")
    if args.device.type == "cuda" and (not torch.cuda.is_available() or
                                       (args.device.index or 0) >= torch.cuda.device_count()):
        sys.exit(f"peers.py: --device {args.device} names no GPU that torch {torch.__version__} sees "
                 f"({torch.cuda.device_count()} here).")
    # remat's run.dtype=bfloat16: float32 masters, a bfloat16 compute copy (compute_weights), not bfloat16 storage.
    args.compute_dtype = getattr(torch, args.dtype)
    need = f"this is torch {torch.__version__}, which does not have it"
    # A recompute redraws the dropout masks it needs: only then must the generator be restored.
    args.preserve_rng_state = {"true": True, "false": False}.get(args.preserve_rng_state, args.dropout > 0.0)
    args.checkpoint_kwargs = checkpoint_kwargs(args.preserve_rng_state)
    if args.policy == "none":
        args.checkpoint_every = 0
    elif args.policy == "full":
        args.checkpoint_every = 1
    elif args.policy.startswith("every:") and args.policy[6:].isdigit() and 1 <= int(args.policy[6:]) <= args.layers:
        args.checkpoint_every = int(args.policy[6:])
    elif args.policy in ("sac", "sac-all-mm"):
        if not hasattr(torch_checkpoint, "create_selective_checkpoint_contexts"):
            sys.exit(f"peers.py: --policy {args.policy} needs torch.utils.checkpoint."
                     f"create_selective_checkpoint_contexts, which PyTorch 2.4 added; {need}.")
        if "allow_cache_entry_mutation" not in inspect.signature(
                torch_checkpoint.create_selective_checkpoint_contexts).parameters:
            sys.exit(f"peers.py: --policy {args.policy} keeps buffers that are written in place after they are "
                     f"kept (dropout masks), which needs create_selective_checkpoint_contexts("
                     f"allow_cache_entry_mutation=...); {need}.")
        SAC_OPS[0] = SacOps()
        args.checkpoint_every = 1
        args.checkpoint_kwargs["context_fn"] = sac_context(args.policy)
    else:
        ap.error(f"--policy {args.policy}: use none, full, every:K (1 <= K <= --layers), sac or sac-all-mm.")
    if (args.compile or args.compile_blocks) and not hasattr(torch, "compile"):
        sys.exit(f"peers.py: --compile and --compile-blocks need torch.compile, which PyTorch 2.0 added; {need}.")
    if args.compile and args.compile_blocks:
        ap.error("--compile compiles the whole model, --compile-blocks each block: give one.")
    if args.count_ops and (args.compile or args.compile_blocks):
        ap.error("--count-ops counts eager aten ops; a compiled step runs Inductor's kernels instead.")
    if args.memory_budget is not None:
        if not (args.compile or args.compile_blocks):
            ap.error("--memory-budget sets torch.compile's activation budget: give --compile or --compile-blocks too.")
        if not 0.0 <= args.memory_budget <= 1.0:
            ap.error(f"--memory-budget must be within [0, 1], got {args.memory_budget}.")
        try:
            import torch._functorch.config as functorch_config
            functorch_config.activation_memory_budget  # noqa: B018  (raises where absent)
        except (ImportError, AttributeError):
            sys.exit(f"peers.py: --memory-budget needs torch._functorch.config.activation_memory_budget, which "
                     f"PyTorch 2.4 added; {need}.")
    if (args.compile or args.compile_blocks) and args.warmup < 1:
        ap.error("--compile and --compile-blocks compile during the first step: give --warmup 1 or more so that "
                 "no timed step includes it.")
    if args.attention == "sdpa":
        if not hasattr(F, "scaled_dot_product_attention"):
            sys.exit(f"peers.py: --attention sdpa needs torch.nn.functional.scaled_dot_product_attention, which "
                     f"PyTorch 2.0 added; this is torch {torch.__version__}, which does not have it. Use "
                     f"--attention math.")
        args.attention_fn = attention_sdpa
    else:
        args.attention_fn = attention_math
    args.optimizer_impl = resolve_optimizer(args)
    return args


def checkpoint_kwargs_text(c):
    if not c.checkpoint_every:
        return "none (no checkpoint)"
    return "{" + ", ".join(f"{k}={getattr(v, '__qualname__', v)}" for k, v in c.checkpoint_kwargs.items()) + "}"


def compile_text(c):
    what = "whole model" if c.compile else "per block and loss" if c.compile_blocks else None
    if what is None:
        return "off"
    return what + ("" if c.memory_budget is None else f", memory budget {c.memory_budget}")


def main(argv=None):
    c = parse_args(argv)
    # Initialised on the CPU from its own generator of --seed, then moved (as remat's model).
    model = Model(c).to(c.device)
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    shape = {"layers": c.layers, "d_model": c.d_model, "heads": c.heads, "kv_heads": c.kv_heads,
             "d_ff": c.d_ff, "vocab": c.vocab, "seq": c.seq, "max_seq": c.max_seq, "batch": c.batch,
             "dropout": c.dropout}
    if c.param_count:
        print(json.dumps({"arch": c.arch, "parameters": n_params, **shape}))
        return 0

    threads = apply_threads(c)
    log(f"peers: torch {torch.__version__}, {c.arch} ({n_params:,} parameters), policy {c.policy}, "
        f"attention {c.attention}, {c.batch} x {c.seq} tokens on {c.device} in {c.dtype}; "
        f"threads: aten {threads['aten_threads']} "
        f"(default {threads['default_aten_threads']}), OpenBLAS {threads['blas_threads']} "
        f"(default {threads['default_blas_threads']}; {threads['blas_build']} build) from {threads['blas_library']}; "
        f"checkpoint kwargs {checkpoint_kwargs_text(c)}; "
        f"compile {compile_text(c)}; AdamW {c.optimizer_impl}")
    mm = mm_threads = None
    if c.device.type == "cuda":
        log(f"peers: {torch.cuda.get_device_name(c.device)}; the CPU matmul check is skipped (a CUDA step's "
            f"matmuls are the GPU's)")
    elif not c.no_matmul_check:
        mm, mm_threads = matmul_check()
        log(f"peers: one 1024^3 float32 matmul at these settings: {mm * 1e3:.1f} ms "
            f"({2 * 1024 ** 3 / mm / 1e9:.1f} GFLOP/s), computed by {mm_threads} thread(s) (per-thread CPU time)")
        if threads["blas_threads"] is not None and mm_threads != min(threads["blas_threads"], threads["cpus"]):
            log(f"peers: warning: OpenBLAS is set to {threads['blas_threads']} threads but {mm_threads} worked on "
                f"the matmul")

    model.train()
    torch.manual_seed(c.seed)  # dropout's masks: the same whether or not the matmul check drew numbers
    opt = make_optimizer(model, c)
    gen = torch.Generator().manual_seed(c.seed)
    step_model = model
    if c.memory_budget is not None:
        torch._functorch.config.activation_memory_budget = c.memory_budget  # read when a graph is split
    if c.compile:
        step_model = torch.compile(model)  # the same parameters; compiles forward and backward in step 1
    elif c.compile_blocks:
        model.compile_blocks()  # each block and the loss; compiled in step 1
    compiled = c.compile or c.compile_blocks
    # Minor page faults per step (the whole process): fresh pages the kernel maps and zeroes,
    # which glibc's malloc makes of every large block it gets back (see --malloc).
    losses, times, warmup_times, step_faults = [], [], [], []
    for step in range(c.warmup + c.steps):
        if compiled and step == c.warmup and hasattr(torch._dynamo.config, "error_on_recompile"):
            # No timed step may compile: a recompile after the warm-up fails the run instead.
            torch._dynamo.config.error_on_recompile = True
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        loss, seconds = train_step(step_model, opt, params, c, step, gen)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        losses.append(loss)
        (times if step >= c.warmup else warmup_times).append(seconds)
        if step >= c.warmup:
            step_faults.append(faults)
        log(f"peers: step {step + 1}/{c.warmup + c.steps}{'' if step >= c.warmup else ' (warm-up)'}: "
            f"loss {loss:.4f}, {seconds * 1e3:.1f} ms, {faults} minor page faults")
    if abs(losses[0] - math.log(c.vocab)) > 0.5:
        log(f"peers: warning: the first loss {losses[0]:.4f} is far from ln(vocab) = {math.log(c.vocab):.4f}")

    peak = static = reserved = None
    if not c.no_peak and c.device.type == "cuda":
        # A separate, untimed step under the CUDA allocator's high-water marks (remat's peak_bytes
        # and reserved_peak_bytes on CUDA are its allocator's too).
        static = torch.cuda.memory_allocated(c.device)
        torch.cuda.reset_peak_memory_stats(c.device)
        train_step(step_model, opt, params, c, c.warmup + c.steps, gen)
        peak = torch.cuda.max_memory_allocated(c.device)
        reserved = torch.cuda.max_memory_reserved(c.device)
        log(f"peers: peak {peak / 2 ** 20:.1f} MiB allocated in a step ({static / 2 ** 20:.1f} MiB at its start), "
            f"{reserved / 2 ** 20:.1f} MiB reserved by the caching allocator")
    elif not c.no_peak:
        # A separate, untimed step: the profiler slows what it records.
        extra = [p.grad for p in params if p.grad is not None]
        extra += [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        static = live_tensor_bytes(extra)
        delta, _, _ = profiled_peak(lambda: train_step(step_model, opt, params, c, c.warmup + c.steps, gen))
        peak = static + delta
        log(f"peers: peak {peak / 2 ** 20:.1f} MiB of live tensors in a step "
            f"({static / 2 ** 20:.1f} MiB live at its start + {delta / 2 ** 20:.1f} MiB)")

    op_counts = None
    if c.count_ops:
        counter = make_op_counter()
        if counter is None:
            log(f"peers: --count-ops needs torch.utils._python_dispatch.TorchDispatchMode, which torch "
                f"{torch.__version__} lacks; skipped")
        else:
            op_counts = count_ops(lambda ctr: train_step(step_model, opt, params, c, c.warmup + c.steps, gen, ctr),
                                  counter)
            t, g = op_counts["op_totals"], op_counts["matmul_gflop"]
            top = ", ".join(f"{k} {v}" for k, v in list(op_counts["ops"]["recompute"].items())[:12])
            log(f"peers: ops of one step: forward {t['forward']}, recomputed in the backward {t['recompute']}, "
                f"backward {t['backward']}, optimizer {t['optimizer']}; matmul GFLOP forward {g['forward']}, "
                f"recomputed {g['recompute']}, backward {g['backward']}; recomputed: {top or 'nothing'}")

    med = sorted(times)[len(times) // 2]  # remat's median(): the upper middle of an even count
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    # Compiling happens inside the first step: its excess over a compiled step's median.
    compile_seconds = max(0.0, warmup_times[0] - med) if compiled else None
    if compiled:
        log(f"peers: torch.compile: first step {warmup_times[0]:.1f} s, about {compile_seconds:.1f} s of it compiling")
    out = {
        "tool": "pytorch",
        "arch": c.arch,
        "policy": c.policy,
        "attention": c.attention,
        "sdpa_gqa": ("enable_gqa" if SDPA_GQA else "repeat_kv") if c.attention == "sdpa" else None,
        "compile": c.compile,
        "compile_blocks": c.compile_blocks,
        "memory_budget": c.memory_budget,
        "optimizer": f"AdamW ({c.optimizer_impl})",
        "optimizer_impl": c.optimizer_impl,
        "preserve_rng_state": c.preserve_rng_state,
        "malloc": c.malloc,
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        "compile_seconds": compile_seconds,
        "warmup_step_seconds": warmup_times,
        "ce_chunk": c.ce_chunk,
        "threads": threads,
        **shape,
        "parameters": n_params,
        "warmup": c.warmup,
        "steps": c.steps,
        "median_step_seconds": med,
        "min_step_seconds": min(times),
        "max_step_seconds": max(times),
        "step_seconds": times,
        "minor_page_faults_per_step": sorted(step_faults)[len(step_faults) // 2],
        "tokens_per_second": c.batch * c.seq / med,
        "peak_bytes": peak,
        "reserved_peak_bytes": reserved,
        "step_start_bytes": static,
        "maxrss_bytes": maxrss,
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "matmul_1024_seconds": mm,
        "matmul_1024_threads": mm_threads,
        "checkpoint_kwargs": ({k: getattr(v, "__name__", str(v)) for k, v in c.checkpoint_kwargs.items()}
                              if c.checkpoint_every else None),
        "op_counts": op_counts,
        "device": str(c.device),
        "dtype": c.dtype,
        "torch_version": torch.__version__,
        "python": platform.python_version(),
    }
    log(f"peers: median step {med * 1e3:.1f} ms (min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f}), "
        f"{out['tokens_per_second']:.0f} tokens/s, maxrss {maxrss / 2 ** 20:.0f} MiB, final loss {losses[-1]:.4f}")
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--self-test-peak":
        p, n = self_test_peak()
        ok = p == 6 * 2 ** 20 and n == 0
        print(json.dumps({"peak_bytes": p, "net_bytes": n, "expected_peak_bytes": 6 * 2 ** 20, "ok": ok}))
        sys.exit(0 if ok else 1)
    sys.exit(main())
