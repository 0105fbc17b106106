#!/usr/bin/python3
"""remat against plain PyTorch (peers.py), alternating, over R rounds.

For each round, each arch in --archs and each policy in --policies it runs `remat bench`
(one policy, the same shape) and peers.py at every PyTorch thread setting, alternating
which goes first from round to round. Then it prints, per arch x policy x PyTorch
setting, remat's median step over PyTorch's (the median over rounds of the per-round
ratios) and the same for peak memory, and names the fastest PyTorch setting. The raw rows
go to OUT/rows.jsonl, the table to OUT/table.txt.

    nice -n 19 /usr/bin/python3 bench/peers/compare.py --rounds 3
    nice -n 19 /usr/bin/python3 bench/peers/compare.py --rounds 1 --warmup 1 --steps 2 \\
        --torch-threads 'default;aten=2,blas=1' --remat-override run.threads=2

Run it from anywhere; remat runs from the repository root (its data/ cache lives there).
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


def shape_of(a, arch):
    kv = a.heads if arch == "gpt2" else (a.kv_heads if a.kv_heads is not None else 2)
    d_ff = (a.d_ff_gpt2 if arch == "gpt2" else a.d_ff_llama)
    if d_ff is None:
        d_ff = 4 * a.d_model if arch == "gpt2" else 1024
    dropout = (a.dropout_gpt2 if arch == "gpt2" else a.dropout_llama)
    return {"layers": a.layers, "d_model": a.d_model, "heads": a.heads, "kv_heads": kv,
            "d_ff": d_ff, "vocab": a.vocab, "seq": a.seq, "max_seq": a.max_seq or a.seq, "batch": a.batch,
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


def remat_command(a, arch, policy, shape, out_dir):
    overrides = [
        f"model.preset={arch}-demo", f"model.n_layer={shape['layers']}", f"model.n_head={shape['heads']}",
        f"model.n_kv_head={shape['kv_heads']}", f"model.d_model={shape['d_model']}", f"model.d_ff={shape['d_ff']}",
        f"model.max_seq={shape['max_seq']}", f"model.vocab_size={shape['vocab']}",
        f"data.vocab_size={data_vocab(shape['vocab'])}", f"model.dropout={shape['dropout']}", "model.attention=math",
        f"train.batch={shape['batch']}", f"train.seq={shape['seq']}", "run.progress=false", "ac.profile=false",
    ] + a.remat_override  # the user's last, so they win
    return [a.remat, "bench", "--policies", policy, "--steps", str(a.steps), "--warmup", str(a.warmup),
            "--out", out_dir] + overrides


def peers_command(a, arch, policy, shape, setting):
    cmd = [PYTHON, os.path.join(HERE, "peers.py"), "--arch", arch, "--policy", policy,
           "--layers", str(shape["layers"]), "--d-model", str(shape["d_model"]), "--heads", str(shape["heads"]),
           "--kv-heads", str(shape["kv_heads"]), "--d-ff", str(shape["d_ff"]), "--vocab", str(shape["vocab"]),
           "--seq", str(shape["seq"]), "--max-seq", str(shape["max_seq"]), "--batch", str(shape["batch"]),
           "--dropout", str(shape["dropout"]), "--warmup", str(a.warmup), "--steps", str(a.steps)]
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


def run_remat(a, arch, policy, shape, rnd, out):
    label = f"{arch}-{policy}-r{rnd}"
    bench_dir = os.path.join(out, "remat", label)
    env = dict(os.environ)
    for kv in a.remat_env:
        k, _, v = kv.partition("=")
        env[k] = v
    cmd = remat_command(a, arch, policy, shape, bench_dir)
    log_path = os.path.join(out, "logs", f"remat-{label}.log")
    stdout, error, wall, others = run(cmd, env, log_path, a.timeout)
    row = {"tool": "remat", "round": rnd, "arch": arch, "policy": policy, "setting": "remat", **shape,
           "command": cmd, "wall_seconds": wall, "other_cpus": others, "error": error}
    if error is None:
        # remat names the directory it wrote ("bench dir X: ..."): X may carry a -2 suffix.
        with open(log_path) as f:
            for line in f:
                if line.startswith("bench dir "):
                    bench_dir = line[len("bench dir "):].split(":")[0].strip()
        try:
            with open(os.path.join(bench_dir if os.path.isabs(bench_dir) else os.path.join(REPO, bench_dir),
                                   "bench.json")) as f:
                b = json.load(f)
            r = b["rows"][0]
            row.update({k: r[k] for k in ("median_step_seconds", "min_step_seconds", "max_step_seconds",
                                          "tokens_per_second", "peak_bytes", "final_loss", "step_seconds",
                                          "activation_bytes", "ops_recomputed")})
            blas = b["machine"].get("blas", "")
            # remat's set_threads: the OpenMP OpenBLAS runs in ATen's pool (all its threads);
            # the pthread build is held to one thread.
            build = "openmp" if "OpenMP" in blas else "pthread" if "pthreads" in blas else None
            row["threads"] = {"aten_threads": b["machine"]["threads"],
                              "blas_threads": b["machine"]["threads"] if build == "openmp" else
                              1 if build == "pthread" else None,
                              "blas_build": build, "blas": blas}
            row["bench_dir"] = bench_dir
        except (OSError, KeyError, IndexError, ValueError) as e:
            row["error"] = f"cannot read bench.json in {bench_dir}: {e}"
    return row


def run_peers(a, arch, policy, shape, setting, rnd, out):
    label = f"{arch}-{policy}-{setting.replace(',', '_').replace('=', '')}-r{rnd}"
    cmd = peers_command(a, arch, policy, shape, setting)
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


def table(rows, archs, policies, settings):
    ok = [r for r in rows if r.get("error") is None]
    lines = []
    head = ["arch", "policy", "pytorch threads", "remat ms", "pytorch ms", "remat/pt time", "remat peak MiB",
            "pt peak MiB", "remat/pt peak", "rounds", "others"]
    cells = [head]
    notes = []
    for arch in archs:
        for policy in policies:
            rm = {r["round"]: r for r in ok if r["tool"] == "remat" and r["arch"] == arch and r["policy"] == policy}
            best = None
            for s in settings:
                pt = {r["round"]: r for r in ok
                      if r["tool"] == "pytorch" and r["arch"] == arch and r["policy"] == policy and r["setting"] == s}
                both = sorted(set(rm) & set(pt))
                t_ratio = med([rm[k]["median_step_seconds"] / pt[k]["median_step_seconds"] for k in both])
                p_ratio = med([rm[k]["peak_bytes"] / pt[k]["peak_bytes"] for k in both
                               if rm[k].get("peak_bytes") and pt[k].get("peak_bytes")])
                r_ms = med([rm[k]["median_step_seconds"] * 1e3 for k in both])
                p_ms = med([pt[k]["median_step_seconds"] * 1e3 for k in pt])
                r_peak = med([rm[k]["peak_bytes"] / 2 ** 20 for k in both])
                p_peak = med([pt[k]["peak_bytes"] / 2 ** 20 for k in pt if pt[k].get("peak_bytes")])
                busy = [r["other_cpus"] for k in both for r in (rm[k], pt[k]) if r.get("other_cpus") is not None]
                label = s
                eff = [pt[k].get("threads") for k in pt if pt[k].get("threads")]
                if eff:
                    label += f" ({eff[0]['aten_threads']}/{eff[0]['blas_threads']} {eff[0].get('blas_build')})"
                cells.append([arch, policy, label, fmt(r_ms, ".1f"), fmt(p_ms, ".1f"), fmt(t_ratio, ".3f"),
                              fmt(r_peak, ".1f"), fmt(p_peak, ".1f"), fmt(p_ratio, ".3f"), str(len(both)),
                              fmt(max(busy) if busy else None, ".2f")])
                if p_ms is not None and (best is None or p_ms < best[1]):
                    best = (s, p_ms, t_ratio)
            if best is not None:
                r_all = med([r["median_step_seconds"] * 1e3 for r in rm.values()])
                rt = [r.get("threads") for r in rm.values() if r.get("threads")]
                how = f" ({rt[0]['aten_threads']}/{rt[0]['blas_threads']} {rt[0]['blas_build']})" if rt else ""
                notes.append(f"{arch} {policy}: fastest PyTorch setting {best[0]} ({best[1]:.1f} ms median); "
                             f"remat{how} {fmt(r_all, '.1f')} ms, remat/pytorch {fmt(best[2], '.3f')}")
    width = [max(len(row[i]) for row in cells) for i in range(len(head))]
    for row in cells:
        lines.append("  ".join(c.ljust(width[i]) if i < 3 else c.rjust(width[i]) for i, c in enumerate(row)))
    lines.append("")
    lines.append("pytorch threads: the setting (effective ATen threads/OpenBLAS threads OpenBLAS build). "
                 "remat/pt < 1: remat is faster "
                 "(time) or smaller (peak); ratios are medians over rounds of per-round ratios. "
                 "others: the most CPUs other processes used during any of those runs; where it "
                 "is not near 0, other work shared the cores and the times are not comparable.")
    lines += notes
    errors = [r for r in rows if r.get("error")]
    for r in errors:
        lines.append(f"FAILED: {r['tool']} {r['arch']} {r['policy']} {r['setting']} round {r['round']}: {r['error']}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--archs", default="gpt2,llama")
    ap.add_argument("--policies", default="none,full")
    ap.add_argument("--torch-threads", default="default;aten=1,blas=2;aten=2,blas=1;aten=2,blas=2,build=openmp",
                    help="';'-separated PyTorch thread settings: 'default' or any of aten=N, blas=M, "
                         "build=openmp|pthread|system, comma-separated (build=openmp: Debian's OpenMP OpenBLAS, "
                         "which remat links)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d-model", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--kv-heads", type=int, default=None, help="llama's key/value heads (default 2)")
    ap.add_argument("--d-ff-gpt2", type=int, default=None, help="default 4 * d_model")
    ap.add_argument("--d-ff-llama", type=int, default=None, help="default 1024")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--max-seq", type=int, default=None, help="default: --seq")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dropout-gpt2", type=float, default=0.1)
    ap.add_argument("--dropout-llama", type=float, default=0.0)
    ap.add_argument("--remat", default=os.path.join(REPO, "build", "remat"), help="the remat binary")
    ap.add_argument("--remat-override", action="append", default=[], metavar="KEY=VALUE",
                    help="extra remat config override (repeatable), e.g. run.threads=2 or train.ce_chunk=2048")
    ap.add_argument("--remat-env", action="append", default=[], metavar="NAME=VALUE",
                    help="environment for remat (repeatable), e.g. OMP_WAIT_POLICY=passive")
    ap.add_argument("--peers-args", default="", help="extra peers.py arguments, e.g. '--ce-chunk 1024'")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per run before it is killed")
    ap.add_argument("--out", default=None, help="output directory (default bench/peers/results/<timestamp>)")
    a = ap.parse_args()

    archs = [x.strip() for x in a.archs.split(",") if x.strip()]
    policies = [x.strip() for x in a.policies.split(",") if x.strip()]
    settings = [x.strip() for x in a.torch_threads.split(";") if x.strip()]
    for s in settings:
        parse_setting(s)
    if any(x not in ("gpt2", "llama") for x in archs) or any(p not in ("none", "full") for p in policies):
        raise SystemExit("compare: --archs takes gpt2,llama and --policies none,full.")
    if a.rounds < 1:
        raise SystemExit("compare: --rounds must be at least 1.")
    if not os.access(a.remat, os.X_OK):
        raise SystemExit(f"compare: {a.remat} is not an executable remat binary (build it, or pass --remat).")
    out = os.path.abspath(a.out or os.path.join(HERE, "results", time.strftime("%Y%m%d-%H%M%S")))
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    os.makedirs(os.path.join(out, "remat"), exist_ok=True)
    rows_path = os.path.join(out, "rows.jsonl")
    log(f"compare: {a.rounds} round(s) x {archs} x {policies}; PyTorch settings {settings}; "
        f"{a.warmup} warm-up + {a.steps} measured steps; out {out}")
    dv = data_vocab(a.vocab)
    if dv != a.vocab:
        log(f"compare: note: remat reads the prepared data/kjv-v{dv} tokenizer for model.vocab_size={a.vocab}")
    elif not os.path.isdir(os.path.join(REPO, "data", f"kjv-v{dv}")):
        log(f"compare: note: remat prepares data/kjv-v{dv} first (once; it is cached)")

    rows = []
    with open(rows_path, "w") as jsonl:
        for rnd in range(a.rounds):
            for arch in archs:
                for policy in policies:
                    shape = shape_of(a, arch)
                    jobs = [("remat", None)] + [("pytorch", s) for s in settings]
                    if rnd % 2 == 1:
                        jobs.reverse()  # alternate who runs first
                    for tool, s in jobs:
                        if tool == "remat":
                            row = run_remat(a, arch, policy, shape, rnd, out)
                        else:
                            row = run_peers(a, arch, policy, shape, s, rnd, out)
                        rows.append(row)
                        jsonl.write(json.dumps(row) + "\n")
                        jsonl.flush()
                        what = "remat" if tool == "remat" else f"pytorch [{s}]"
                        if row.get("error"):
                            log(f"compare: round {rnd + 1} {arch} {policy} {what}: FAILED: {row['error']}")
                        else:
                            peak = row.get("peak_bytes")
                            log(f"compare: round {rnd + 1} {arch} {policy} {what}: median step "
                                f"{row['median_step_seconds'] * 1e3:.1f} ms, peak "
                                f"{'-' if not peak else f'{peak / 2 ** 20:.1f} MiB'}, final loss "
                                f"{row['final_loss']:.4f} ({row['wall_seconds']:.0f} s; other processes "
                                f"{fmt(row['other_cpus'], '.2f')} CPUs)")
    text = table(rows, archs, policies, settings)
    with open(os.path.join(out, "table.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    log(f"compare: rows in {rows_path}, table in {os.path.join(out, 'table.txt')}")
    return 1 if any(r.get("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
