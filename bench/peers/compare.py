#!/usr/bin/python3
"""remat against plain PyTorch (peers.py), alternating, over R rounds.

For each round, arch in --archs, length in --seq and PyTorch setting in --policies it runs
`remat bench` with the remat policy paired with that setting (the same shape) and peers.py
at every PyTorch thread setting, alternating which goes first from round to round. Then
it prints, per arch x seq x setting x thread setting, remat's median step over PyTorch's
(the median over rounds of the per-round ratios) and the same for peak memory, and names
the fastest PyTorch thread setting. The raw rows go to OUT/rows.jsonl, the table to
OUT/table.txt.

    nice -n 19 /usr/bin/python3 bench/peers/compare.py --rounds 3                  # PyTorch 1.13, build/remat
    nice -n 19 /usr/bin/python3 bench/peers/compare.py --torch2 --seq 256,1024     # PyTorch 2.x in the sid root
    nice -n 19 /usr/bin/python3 bench/peers/compare.py --rounds 1 --warmup 1 --steps 2 \\
        --torch-threads 'default;aten=2,blas=1' --remat-override run.threads=2

Run it from anywhere; remat runs from the repository root (its data/ cache lives there).
With --torch2 (or --root NAME) both tools run inside that root of scripts/root.sh, which
needs root privileges; see README.md beside this file.
"""

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PYTHON = "/usr/bin/python3"
# The PyTorch settings (peers.py) and the remat policy each is timed against. compile:B is
# torch.compile at activation_memory_budget B, against remat's budget plan at the peak that
# PyTorch measured there. sac is torchtitan's per-op rule, which keeps every second linear
# matmul of a block: remat's matmul/2 keeps the matmuls of every second layer instead, the
# nearest remat policy (about half the matmul outputs kept and half recomputed). sac-all-mm
# keeps every linear matmul's output and the attention's, as ops:[matmul,attention] does.
# blocks:P is P with each block compiled (torchtitan's per-block torch.compile), against P's.
REMAT_POLICY = {"none": "none", "full": "full", "sac": "ops:[matmul/2,attention]",
                "sac-all-mm": "ops:[matmul,attention]", "compile": "none"}
TORCH2_POLICIES = ("none,full,every:2,sac,sac-all-mm,blocks:none,blocks:full,blocks:sac,"
                   "compile,compile:0.1,compile:0.3,compile:0.5,compile:0.7,compile:0.9")
# PyTorch 2.14's fastest settings here: GPT-2 with the OpenMP OpenBLAS in ATen's pool, Llama
# with one ATen thread and two of the pthread OpenBLAS (its step deadlocked with the OpenMP
# build); its default (two of each, pthread) took twice as long (docs/results.md).
TORCH2_THREADS = "aten=1,blas=2;aten=2,blas=2,build=openmp"
# In a root, the repository is mounted here and the output directory (when outside it) at /out.
ROOT_REPO, ROOT_OUT = "/src", "/out"


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def parse_setting(s):
    """'default' -> []; 'aten=1,blas=2' -> ['--aten-threads', '1', '--blas-threads', '2'];
    build=openmp|pthread|system picks Debian's OpenBLAS build (peers.py --blas-build)."""
    s = s.strip()
    if s == "default":
        return []
    out = []
    for part in s.split(","):
        key, _, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if key in ("aten", "blas") and value.isdigit() and int(value) >= 1:
            out += [f"--{key}-threads", value]
        elif key == "build" and value in ("openmp", "pthread", "system"):
            out += ["--blas-build", value]
        else:
            raise SystemExit(f"compare: bad PyTorch thread setting '{s}': use 'default' or a comma-separated "
                             f"list of aten=N, blas=M and build=openmp|pthread|system (each optional).")
    return out


def parse_policy(p):
    """A PyTorch setting: none, full, every:K, sac, sac-all-mm, compile, compile:B (0 <= B <= 1)
    or blocks:P (P one of the first five, with --compile-blocks).
    Returns (peers.py arguments, the remat policy, B or None)."""
    if p.startswith("blocks:"):
        inner = p[7:]
        if inner.startswith(("blocks", "compile")):
            raise SystemExit(f"compare: bad setting '{p}': blocks:P takes P among none, full, every:K, sac and "
                             f"sac-all-mm.")
        args, remat, _ = parse_policy(inner)
        return ["--compile-blocks"] + args, remat, None
    if p.startswith("compile:"):
        try:
            b = float(p[8:])
        except ValueError:
            b = -1.0
        if not 0.0 <= b <= 1.0:
            raise SystemExit(f"compare: bad setting '{p}': compile:B takes a memory budget B within [0, 1].")
        return ["--compile", "--memory-budget", p[8:]], None, b
    if p == "compile":
        return ["--compile"], "none", None
    if p in REMAT_POLICY:
        return ["--policy", p], REMAT_POLICY[p], None
    if p.startswith("every:") and p[6:].isdigit() and int(p[6:]) >= 1:
        return ["--policy", p], p, None
    raise SystemExit(f"compare: bad setting '{p}' in --policies: use none, full, every:K, sac, sac-all-mm, "
                     f"blocks:P, compile or compile:B.")


def in_root(a, cmd, out, env=None):
    """cmd run inside the debootstrap root a.root (scripts/root.sh), its paths under the
    repository and the output directory rewritten to where the root sees them."""
    if not a.root:
        return cmd
    binds = ["--bind", f"{REPO}:{ROOT_REPO}"]
    if not out.startswith(REPO + "/"):
        binds += ["--bind", f"{out}:{ROOT_OUT}"]
    inner = [to_root(c, out) for c in cmd]
    envs = [f"{k}={v}" for k, v in (env or {}).items()]
    return (["bash", os.path.join(REPO, "scripts", "root.sh"), "run", a.root] + binds +
            ["--", "env"] + envs + ["sh", "-c", f'cd {ROOT_REPO} && exec "$@"', "sh"] + inner)


def to_root(path, out):
    if path == REPO or path.startswith(REPO + "/"):
        return ROOT_REPO + path[len(REPO):]
    if path == out or path.startswith(out + "/"):
        return ROOT_OUT + path[len(out):]
    return path


def from_root(a, path, out):
    """The host path of a path remat printed inside the root (or relative to the repository)."""
    if a.root and path.startswith(ROOT_OUT + "/") and not out.startswith(REPO + "/"):
        return out + path[len(ROOT_OUT):]
    if a.root and (path == ROOT_REPO or path.startswith(ROOT_REPO + "/")):
        return REPO + path[len(ROOT_REPO):]
    return path if os.path.isabs(path) else os.path.join(REPO, path)


def shape_of(a, arch, seq):
    kv = a.heads if arch == "gpt2" else (a.kv_heads if a.kv_heads is not None else 2)
    d_ff = (a.d_ff_gpt2 if arch == "gpt2" else a.d_ff_llama)
    if d_ff is None:
        d_ff = 4 * a.d_model if arch == "gpt2" else 1024
    dropout = (a.dropout_gpt2 if arch == "gpt2" else a.dropout_llama)
    return {"layers": a.layers, "d_model": a.d_model, "heads": a.heads, "kv_heads": kv,
            "d_ff": d_ff, "vocab": a.vocab, "seq": seq, "max_seq": a.max_seq or seq, "batch": a.batch,
            "dropout": dropout}


def data_vocab(vocab):
    """The tokenizer remat's bench reads: data/kjv-v{vocab} when prepared, else the largest
    prepared one below it (model.vocab_size may exceed the tokenizer's; the token ids then
    cover part of the table, which does not change the step's work), else vocab itself
    (remat then prepares that corpus first, which takes a while)."""
    prepared = []
    data = os.path.join(REPO, "data")
    if os.path.isdir(data):
        for name in os.listdir(data):
            if name.startswith("kjv-v") and name[5:].isdigit() and os.path.exists(os.path.join(data, name, "meta.json")):
                prepared.append(int(name[5:]))
    if vocab in prepared:
        return vocab
    below = [v for v in prepared if v <= vocab]
    return max(below) if below else vocab


def remat_overrides(a, arch, shape):
    """remat's key=value settings for the shape, device and dtype, the user's last so that they win."""
    device = [f"run.device={a.device}"] if a.device != "cpu" else []
    dtype = [f"run.dtype={a.dtype}"] if a.dtype else []
    return [
        f"model.preset={arch}-demo", f"model.n_layer={shape['layers']}", f"model.n_head={shape['heads']}",
        f"model.n_kv_head={shape['kv_heads']}", f"model.d_model={shape['d_model']}", f"model.d_ff={shape['d_ff']}",
        f"model.max_seq={shape['max_seq']}", f"model.vocab_size={shape['vocab']}",
        f"data.vocab_size={data_vocab(shape['vocab'])}", f"model.dropout={shape['dropout']}", "model.attention=math",
        f"train.batch={shape['batch']}", f"train.seq={shape['seq']}", "run.progress=false", "ac.profile=false",
    ] + device + dtype + a.remat_override


def remat_command(a, arch, policy, budgets, shape, out_dir):
    overrides = remat_overrides(a, arch, shape)
    # remat bench needs a policy beside its budgets: the budget entries follow that one.
    return ([a.remat, "bench", "--policies", policy] + (["--budgets", ";".join(budgets)] if budgets else []) +
            ["--steps", str(a.steps), "--warmup", str(a.warmup), "--out", out_dir] + overrides)


def peers_command(a, arch, policy, shape, setting):
    cmd = [a.python, os.path.join(HERE, "peers.py"), "--arch", arch, "--attention", a.pt_attention] + \
        parse_policy(policy)[0] + [
           "--layers", str(shape["layers"]), "--d-model", str(shape["d_model"]), "--heads", str(shape["heads"]),
           "--kv-heads", str(shape["kv_heads"]), "--d-ff", str(shape["d_ff"]), "--vocab", str(shape["vocab"]),
           "--seq", str(shape["seq"]), "--max-seq", str(shape["max_seq"]), "--batch", str(shape["batch"]),
           "--dropout", str(shape["dropout"]), "--warmup", str(a.warmup), "--steps", str(a.steps)]
    cmd += (["--device", a.device] if a.device != "cpu" else []) + (["--dtype", a.dtype] if a.dtype else [])
    return cmd + parse_setting(setting) + shlex.split(a.peers_args)


def busy_seconds():
    """CPU seconds every process on the machine has used since boot (/proc/stat: all states
    but idle and iowait), or None without /proc/stat."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]  # user .. steal; guest is in user
    except (OSError, ValueError):
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def children_seconds():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run(cmd, env, log_path, timeout):
    """Runs cmd; returns (stdout, error, wall seconds, the CPUs other processes used meanwhile).

    The last is the machine's busy CPU time during the run less the run's own, over its wall
    time: 2-thread steps stall whenever another process holds a core (OpenMP's threads wait
    for each other at every parallel region), so a run beside other work can take several
    times as long and its ratio says nothing."""
    busy0, own0, t0 = busy_seconds(), children_seconds(), time.time()
    stdout, error = run_logged(cmd, env, log_path, timeout)
    wall = time.time() - t0
    busy1 = busy_seconds()
    others = None
    if busy0 is not None and busy1 is not None and wall > 0:
        others = max(0.0, (busy1 - busy0 - (children_seconds() - own0)) / wall)
    return stdout, error, wall, others


def run_logged(cmd, env, log_path, timeout):
    with open(log_path, "w") as err:
        err.write("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n")
        err.flush()
        try:
            p = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
                               timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, f"timed out after {timeout} s"
    if p.returncode != 0:
        return p.stdout, f"exit status {p.returncode} (see {log_path})"
    return p.stdout, None


def run_remat(a, arch, jobs, shape, rnd, out):
    """One `remat bench` run for jobs [(PyTorch setting it pairs with, remat policy or None,
    budget bytes or None)]: the first job's policy, then each budget as an entry. Returns
    one row per job, its policy the PyTorch setting's name."""
    policy = jobs[0][1]
    budgets = [str(b) for _, _, b in jobs[1:]]
    label = f"{arch}-{shape['seq']}-{jobs[0][0].replace(':', '')}{'-budgets' if budgets else ''}-r{rnd}"
    bench_dir = os.path.join(out, "remat", label)
    env = {}
    for kv in a.remat_env:
        k, _, v = kv.partition("=")
        env[k] = v
    cmd = remat_command(a, arch, policy, budgets, shape, bench_dir)
    if a.root:
        cmd, env = in_root(a, cmd, out, env), dict(os.environ)
    else:
        env = dict(os.environ, **env)
    log_path = os.path.join(out, "logs", f"remat-{label}.log")
    stdout, error, wall, others = run(cmd, env, log_path, a.timeout)
    rows = []
    for setting, p, b in jobs:
        rows.append({"tool": "remat", "round": rnd, "arch": arch, "policy": setting,
                     "remat_policy": p if b is None else f"budget={b}", "budget_bytes": b, "setting": "remat",
                     **shape, "command": cmd, "log": log_path, "wall_seconds": wall, "other_cpus": others,
                     "error": error})
    if error is not None:
        return rows
    # remat names the directory it wrote ("bench dir X: ..."): X may carry a -2 suffix.
    with open(log_path) as f:
        for line in f:
            if line.startswith("bench dir "):
                bench_dir = from_root(a, line[len("bench dir "):].split(":")[0].strip(), out)
    try:
        with open(os.path.join(bench_dir, "bench.json")) as f:
            b = json.load(f)
        entries = {r["entry"]: r for r in b["rows"]}
        blas = b["machine"].get("blas", "")
    except (OSError, KeyError, ValueError) as e:
        for row in rows:
            row["error"] = f"cannot read bench.json in {bench_dir}: {e}"
        return rows
    # remat's set_threads: the OpenMP OpenBLAS runs in ATen's pool (all its threads);
    # the pthread build is held to one thread.
    build = "openmp" if "OpenMP" in blas else "pthread" if "pthreads" in blas else None
    threads = {"aten_threads": b["machine"]["threads"],
               "blas_threads": b["machine"]["threads"] if build == "openmp" else 1 if build == "pthread" else None,
               "blas_build": build, "blas": blas}
    for row in rows:
        entry = row["remat_policy"]
        r = entries.get(entry)
        if r is None:
            row["error"] = f"no entry '{entry}' in {bench_dir}/bench.json"
            continue
        row.update({k: r.get(k) for k in ("median_step_seconds", "min_step_seconds", "max_step_seconds",
                                          "tokens_per_second", "peak_bytes", "reserved_peak_bytes", "final_loss",
                                          "step_seconds", "activation_bytes", "ops_recomputed",
                                          "predicted_peak_bytes")})
        row["threads"] = threads
        row["bench_dir"] = bench_dir
    return rows


def refused_budget(row):
    """(budget bytes, remat's sentence) when the failed run's log says remat refused that
    budget entry, else None."""
    if not row.get("error") or not row.get("log"):
        return None
    mark = "error: Bench entry 'budget="
    with open(row["log"]) as f:
        for line in f:
            if line.startswith(mark):
                b, _, why = line[len(mark):].partition("': ")
                if b.isdigit():
                    return int(b), why.strip()
    return None


def run_peers(a, arch, policy, shape, setting, rnd, out):
    label = f"{arch}-{shape['seq']}-{policy.replace(':', '')}-{setting.replace(',', '_').replace('=', '')}-r{rnd}"
    cmd = in_root(a, peers_command(a, arch, policy, shape, setting), out)
    log_path = os.path.join(out, "logs", f"pytorch-{label}.log")
    stdout, error, wall, others = run(cmd, dict(os.environ), log_path, a.timeout)
    row = {"tool": "pytorch", "round": rnd, "arch": arch, "policy": policy, "setting": setting, **shape,
           "command": cmd, "wall_seconds": wall, "other_cpus": others, "error": error}
    if error is None:
        try:
            r = json.loads(stdout.strip().splitlines()[-1])
            r.pop("tool", None)
            row.update({k: v for k, v in r.items() if k not in ("arch", "policy")})
        except (IndexError, ValueError) as e:
            row["error"] = f"no JSON on stdout: {e}"
    return row


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def table(rows, archs, seqs, policies, settings):
    ok = [r for r in rows if r.get("error") is None]
    lines = []
    head = ["arch", "seq", "pytorch", "remat", "pytorch threads", "remat ms", "pytorch ms", "remat/pt time",
            "remat peak MiB", "pt peak MiB", "remat/pt peak", "pt compile s", "rounds", "others"]
    cells = [head]
    notes = []
    for arch in archs:
        for seq in seqs:
            for policy in policies:
                rm = {r["round"]: r for r in ok if r["tool"] == "remat" and r["arch"] == arch and r["seq"] == seq
                      and r["policy"] == policy}
                best = None
                for s in settings:
                    pt = {r["round"]: r for r in ok if r["tool"] == "pytorch" and r["arch"] == arch and
                          r["seq"] == seq and r["policy"] == policy and r["setting"] == s}
                    both = sorted(set(rm) & set(pt))
                    t_ratio = med([rm[k]["median_step_seconds"] / pt[k]["median_step_seconds"] for k in both])
                    p_ratio = med([rm[k]["peak_bytes"] / pt[k]["peak_bytes"] for k in both
                                   if rm[k].get("peak_bytes") and pt[k].get("peak_bytes")])
                    r_ms = med([rm[k]["median_step_seconds"] * 1e3 for k in both])
                    p_ms = med([pt[k]["median_step_seconds"] * 1e3 for k in pt])
                    r_peak = med([rm[k]["peak_bytes"] / 2 ** 20 for k in both])
                    p_peak = med([pt[k]["peak_bytes"] / 2 ** 20 for k in pt if pt[k].get("peak_bytes")])
                    compile_s = med([pt[k].get("compile_seconds") for k in pt])
                    busy = [r["other_cpus"] for k in both for r in (rm[k], pt[k]) if r.get("other_cpus") is not None]
                    label = s
                    eff = [pt[k].get("threads") for k in pt if pt[k].get("threads")]
                    if eff:
                        label += f" ({eff[0]['aten_threads']}/{eff[0]['blas_threads']} {eff[0].get('blas_build')})"
                    rp = [rm[k]["remat_policy"] for k in sorted(rm)]
                    rp = rp[-1] if rp else "-"
                    if rp.startswith("budget="):  # each round's budget is a measured peak: show the last
                        rp = f"budget={int(rp[7:]) / 2 ** 20:.1f}MiB"
                    cells.append([arch, str(seq), policy, rp, label, fmt(r_ms, ".1f"), fmt(p_ms, ".1f"),
                                  fmt(t_ratio, ".3f"), fmt(r_peak, ".1f"), fmt(p_peak, ".1f"), fmt(p_ratio, ".3f"),
                                  fmt(compile_s, ".1f"), str(len(both)), fmt(max(busy) if busy else None, ".2f")])
                    if p_ms is not None and (best is None or p_ms < best[1]):
                        best = (s, p_ms, t_ratio)
                if best is not None and len(settings) > 1:
                    r_all = med([r["median_step_seconds"] * 1e3 for r in rm.values()])
                    rt = [r.get("threads") for r in rm.values() if r.get("threads")]
                    how = f" ({rt[0]['aten_threads']}/{rt[0]['blas_threads']} {rt[0]['blas_build']})" if rt else ""
                    notes.append(f"{arch} {seq} {policy}: fastest PyTorch setting {best[0]} ({best[1]:.1f} ms "
                                 f"median); remat{how} {fmt(r_all, '.1f')} ms, remat/pytorch {fmt(best[2], '.3f')}")
    width = [max(len(row[i]) for row in cells) for i in range(len(head))]
    for row in cells:
        lines.append("  ".join(c.ljust(width[i]) if i < 5 else c.rjust(width[i]) for i, c in enumerate(row)))
    lines.append("")
    lines.append("pytorch: the PyTorch setting; remat: the remat policy timed against it (budget=: remat's budget "
                 "plan at the peak PyTorch measured). pytorch threads: the setting (effective ATen threads/OpenBLAS "
                 "threads OpenBLAS build). remat/pt < 1: remat is faster (time) or smaller (peak); ratios are "
                 "medians over rounds of per-round ratios. pt compile s: the first step's excess over a compiled "
                 "step. others: the most CPUs other processes used during any of those runs; where it is not near "
                 "0, other work shared the cores and the times are not comparable.")
    lines += notes
    errors = [r for r in rows if r.get("error")]
    for r in errors:
        lines.append(f"FAILED: {r['tool']} {r['arch']} {r['seq']} {r['policy']} {r['setting']} round {r['round']}: "
                     f"{r['error']}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--torch2", action="store_true",
                    help="PyTorch 2.x against remat on LibTorch 2.x: both run in the sid root of scripts/root.sh "
                         "(--root sid), remat from build-libtorch2/, PyTorch with --pt-attention sdpa and, by "
                         "default, every setting: " + TORCH2_POLICIES)
    ap.add_argument("--root", default=None,
                    help="run both tools inside this root of scripts/root.sh (the repository at /src)")
    ap.add_argument("--python", default=PYTHON, help="the Python that runs peers.py (inside --root, the root's)")
    ap.add_argument("--pt-attention", choices=["math", "sdpa"], default=None,
                    help="peers.py --attention (default: math; sdpa with --torch2)")
    ap.add_argument("--device", default="cpu",
                    help="cpu, cuda or cuda:N: remat's run.device and peers.py --device; on CUDA one PyTorch run per "
                         "setting at its default threads unless --torch-threads is given")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                    help="remat's run.dtype and peers.py --dtype (both default to float32; bfloat16 needs CUDA in "
                         "remat)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--archs", default="gpt2,llama")
    ap.add_argument("--policies", default=None,
                    help="PyTorch settings, each timed against a remat policy: none, full, every:K, sac "
                         "(torchtitan's per-op rule, against ops:[matmul/2,attention]), sac-all-mm (against "
                         "ops:[matmul,attention]), blocks:P (P with each block compiled, against P's), compile "
                         "(against none), compile:B (B within [0, 1]: against remat's budget plan at PyTorch's "
                         "measured peak); default none,full, or all with --torch2")
    ap.add_argument("--torch-threads", default=None,
                    help="';'-separated PyTorch thread settings: 'default' or any of aten=N, blas=M, "
                         "build=openmp|pthread|system, comma-separated (build=openmp: Debian's OpenMP OpenBLAS, "
                         "which remat links); default: default;aten=1,blas=2;aten=2,blas=1;aten=2,blas=2,build=openmp, "
                         "or with --torch2 " + TORCH2_THREADS)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d-model", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--kv-heads", type=int, default=None, help="llama's key/value heads (default 2)")
    ap.add_argument("--d-ff-gpt2", type=int, default=None, help="default 4 * d_model")
    ap.add_argument("--d-ff-llama", type=int, default=None, help="default 1024")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", default="256", help="sequence lengths, comma-separated (e.g. 256,1024)")
    ap.add_argument("--max-seq", type=int, default=None, help="default: each --seq")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dropout-gpt2", type=float, default=0.1)
    ap.add_argument("--dropout-llama", type=float, default=0.0)
    ap.add_argument("--remat", default=None, help="the remat binary (default build/remat; build-libtorch2/remat "
                                                  "with --torch2)")
    ap.add_argument("--remat-override", action="append", default=[], metavar="KEY=VALUE",
                    help="extra remat config override (repeatable), e.g. run.threads=2 or train.ce_chunk=2048")
    ap.add_argument("--remat-env", action="append", default=[], metavar="NAME=VALUE",
                    help="environment for remat (repeatable), e.g. OMP_WAIT_POLICY=passive")
    ap.add_argument("--peers-args", default="", help="extra peers.py arguments, e.g. '--ce-chunk 1024'")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per run before it is killed")
    ap.add_argument("--out", default=None, help="output directory (default bench/peers/results/<timestamp>)")
    a = ap.parse_args()
    if a.torch2:
        a.root = a.root or "sid"
        # A run that hangs (a BLAS deadlock) costs a row, not the measurement.
        a.timeout = a.timeout or 600
    a.remat = os.path.abspath(a.remat or os.path.join(REPO, "build-libtorch2" if a.torch2 else "build", "remat"))
    a.pt_attention = a.pt_attention or ("sdpa" if a.torch2 else "math")
    a.policies = a.policies or (TORCH2_POLICIES if a.torch2 else "none,full")
    # The thread sweeps tune the CPU's GEMMs: a CUDA step's matmuls are the GPU's.
    a.torch_threads = a.torch_threads or ("default" if a.device != "cpu" else TORCH2_THREADS if a.torch2 else
                                          "default;aten=1,blas=2;aten=2,blas=1;aten=2,blas=2,build=openmp")

    archs = [x.strip() for x in a.archs.split(",") if x.strip()]
    policies = [x.strip() for x in a.policies.split(",") if x.strip()]
    settings = [x.strip() for x in a.torch_threads.split(";") if x.strip()]
    try:
        seqs = [int(x) for x in a.seq.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"compare: --seq takes comma-separated lengths, got '{a.seq}'.")
    for s in settings:
        parse_setting(s)
    for p in policies:
        parse_policy(p)
    if any(x not in ("gpt2", "llama") for x in archs) or not seqs or not policies:
        raise SystemExit("compare: --archs takes gpt2,llama; --seq and --policies need at least one item.")
    if a.rounds < 1:
        raise SystemExit("compare: --rounds must be at least 1.")
    if not (a.device in ("cpu", "cuda") or (a.device.startswith("cuda:") and a.device[5:].isdigit())):
        raise SystemExit(f"compare: --device {a.device}: use cpu, cuda or cuda:N.")
    if a.dtype == "bfloat16" and a.device == "cpu":
        raise SystemExit("compare: --dtype bfloat16 needs --device cuda: remat refuses run.dtype=bfloat16 on the CPU.")
    if not os.access(a.remat, os.X_OK):
        raise SystemExit(f"compare: {a.remat} is not an executable remat binary (build it, or pass --remat).")
    if a.root and not a.remat.startswith(REPO + "/"):
        raise SystemExit(f"compare: inside --root, remat must lie in the repository ({REPO}), which the root mounts.")
    out = os.path.abspath(a.out or os.path.join(HERE, "results", time.strftime("%Y%m%d-%H%M%S")))
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    os.makedirs(os.path.join(out, "remat"), exist_ok=True)
    rows_path = os.path.join(out, "rows.jsonl")
    log(f"compare: {a.rounds} round(s) x {archs} x seq {seqs} x {policies} on {a.device}"
        f"{f' in {a.dtype}' if a.dtype else ''}; PyTorch settings {settings}"
        f"{f' in root {a.root}' if a.root else ''}; remat {a.remat}; {a.warmup} warm-up + {a.steps} measured "
        f"steps; out {out}")
    dv = data_vocab(a.vocab)
    if dv != a.vocab:
        log(f"compare: note: remat reads the prepared data/kjv-v{dv} tokenizer for model.vocab_size={a.vocab}")
    elif not os.path.isdir(os.path.join(REPO, "data", f"kjv-v{dv}")):
        log(f"compare: note: remat prepares data/kjv-v{dv} first (once; it is cached)")

    plain = [p for p in policies if not p.startswith("compile")]
    compiled = [p for p in policies if p.startswith("compile")]
    peaks = {}  # (arch, seq, compile:B) -> PyTorch's latest measured peak: remat's budget
    rows = []
    with open(rows_path, "w") as jsonl:
        def emit(row):
            rows.append(row)
            jsonl.write(json.dumps(row) + "\n")
            jsonl.flush()
            what = f"remat {row['remat_policy']}" if row["tool"] == "remat" else f"pytorch [{row['setting']}]"
            head = f"compare: round {row['round'] + 1} {row['arch']} {row['seq']} {row['policy']} {what}"
            if row.get("error"):
                log(f"{head}: FAILED: {row['error']}")
            else:
                peak = row.get("peak_bytes")
                log(f"{head}: median step {row['median_step_seconds'] * 1e3:.1f} ms, peak "
                    f"{'-' if not peak else f'{peak / 2 ** 20:.1f} MiB'}, final loss {row['final_loss']:.4f} "
                    f"({row['wall_seconds']:.0f} s; other processes {fmt(row['other_cpus'], '.2f')} CPUs)")

        def compile_remat(arch, seq, shape, rnd):
            # compile against remat none, each compile:B against remat's plan at PyTorch's peak there.
            jobs = [("compile", "none", None)]
            for p in compiled:
                if p == "compile":
                    continue
                if (arch, seq, p) in peaks:
                    jobs.append((p, None, peaks[(arch, seq, p)]))
                else:
                    emit({"tool": "remat", "round": rnd, "arch": arch, "policy": p, "remat_policy": "budget=?",
                          "setting": "remat", **shape, "error": f"no PyTorch peak measured for {p}"})
            while True:
                got = run_remat(a, arch, jobs, shape, rnd, out)
                refused = refused_budget(got[0])
                if refused is None or len(jobs) == 1:
                    break
                # remat plans every entry before it trains any: a budget below its minimum stops the
                # run at once; that budget's row carries the refusal and the others run again.
                for j, row in zip(jobs, got):
                    if j[2] == refused[0]:
                        row["error"] = refused[1]
                        emit(row)
                jobs = [j for j in jobs if j[2] != refused[0]]
            for row in got:
                emit(row)

        for rnd in range(a.rounds):
            for arch in archs:
                for seq in seqs:
                    shape = shape_of(a, arch, seq)
                    for policy in plain:
                        jobs = [("remat", None)] + [("pytorch", s) for s in settings]
                        if rnd % 2 == 1:
                            jobs.reverse()  # alternate who runs first
                        for tool, s in jobs:
                            if tool == "remat":
                                for row in run_remat(a, arch, [(policy, parse_policy(policy)[1], None)], shape,
                                                     rnd, out):
                                    emit(row)
                            else:
                                emit(run_peers(a, arch, policy, shape, s, rnd, out))
                    if not compiled:
                        continue
                    # remat's budgets are PyTorch's measured peaks, so PyTorch goes first in round 1;
                    # later rounds alternate, remat taking the peaks of the round before.
                    if rnd % 2 == 1:
                        compile_remat(arch, seq, shape, rnd)
                    for p in compiled:
                        got = []
                        for s in settings:
                            row = run_peers(a, arch, p, shape, s, rnd, out)
                            emit(row)
                            if row.get("error") is None and row.get("peak_bytes"):
                                got.append(row["peak_bytes"])
                        if got:
                            peaks[(arch, seq, p)] = int(statistics.median(got))
                    if rnd % 2 == 0:
                        compile_remat(arch, seq, shape, rnd)
    text = table(rows, archs, seqs, policies, settings)
    with open(os.path.join(out, "table.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    log(f"compare: rows in {rows_path}, table in {os.path.join(out, 'table.txt')}")
    return 1 if any(r.get("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
