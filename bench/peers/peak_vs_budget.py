#!/usr/bin/python3
"""Measured peak memory against the memory budget: remat's ac.budget and torch.compile's
activation_memory_budget, side by side, one arch and length at a time.

remat takes its budget in bytes: ten budgets spread evenly from the least any plan needs
to the no-recompute peak (`remat plan --json` gives both), all measured in one `remat
bench`. torch.compile takes a fraction of the activations its default partitioner keeps:
0.1, 0.2, ..., 1.0, one peers.py run each. Peaks are tensor bytes, counted as compare.py
counts them (bench/peers/README.md), so they do not depend on the machine's load.

    nice -n 19 /usr/bin/python3 bench/peers/peak_vs_budget.py --torch2 --arch gpt2 --seq 256 --out OUT

writes OUT/peaks.csv (system: 0 remat, 1 PyTorch; the budget as given; as a fraction of
remat's no-recompute peak, or PyTorch's fraction; the measured peak in bytes) and, with gnuplot, OUT/peak_vs_budget.png.
"""

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys

import compare as C


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def run_json(cmd, what):
    p = subprocess.run(cmd, cwd=C.REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise SystemExit(f"peak_vs_budget: {what} failed (exit {p.returncode}): {p.stderr.strip()[-2000:]}")
    return p.stdout


def remat_peaks(a, shape, out):
    """[(budget bytes, budget / no-recompute peak, measured peak)] over ten budgets."""
    overrides = C.remat_overrides(a, a.arch, shape)
    plan = json.loads(run_json(C.in_root(a, [a.remat, "plan", "--json"] + overrides + ["ac.budget=1.0"], out),
                               "remat plan --json"))
    least, none = plan["min_feasible_budget"], plan["none_peak"]
    # The least budget plus a margin for the bytes bench holds that plan does not (the tokens).
    least += (none - least) // 50
    budgets = [least + (none - least) * i // 9 for i in range(10)]
    bench_dir = os.path.join(out, "remat")
    run_json(C.in_root(a, C.remat_command(a, a.arch, "none", [str(b) for b in budgets], shape, bench_dir), out),
             "remat bench")
    with open(os.path.join(bench_dir, "bench.json")) as f:
        rows = {r["entry"]: r for r in json.load(f)["rows"]}
    return [(b, b / none, rows[f"budget={b}"]["peak_bytes"]) for b in budgets]


def pytorch_peaks(a, shape, out):
    """[(budget, budget, measured peak)] for activation_memory_budget 0.1 .. 1.0."""
    got = []
    for i in range(1, 11):
        b = round(0.1 * i, 1)
        cmd = C.in_root(a, C.peers_command(a, a.arch, f"compile:{b}", shape, a.torch_threads), out)
        r = json.loads(run_json(cmd, f"peers.py at budget {b}").strip().splitlines()[-1])
        log(f"peak_vs_budget: PyTorch compile at {b}: peak {r['peak_bytes'] / 2**20:.1f} MiB")
        got.append((b, b, r["peak_bytes"]))
    return got


def plot(csv_path, png, title):
    script = f"""
set terminal pngcairo size 900,560
set output '{png}'
set datafile separator ','
set title '{title}'
set xlabel 'budget (remat: ac.budget over its no-recompute peak; PyTorch: activation\\_memory\\_budget)'
set ylabel 'measured peak (MiB)'
set key top left
set grid
plot '{csv_path}' using ($1 == 0 ? $3 : 1/0):($4/1048576) with linespoints title 'remat: measured peak', \\
     '' using ($1 == 0 ? $3 : 1/0):($2/1048576) with lines dashtype 2 title 'remat: its budget', \\
     '' using ($1 == 1 ? $3 : 1/0):($4/1048576) with linespoints title 'PyTorch torch.compile: measured peak'
"""
    subprocess.run(["gnuplot"], input=script, text=True, check=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--torch2", action="store_true", help="both tools in the sid root (as compare.py --torch2)")
    ap.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--torch-threads", default=None,
                    help="PyTorch's thread setting (compare.py's spelling; default: the fastest found per arch)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--remat-override", action="append", default=[], metavar="KEY=VALUE")
    a = ap.parse_args()
    if not a.torch2:
        raise SystemExit("peak_vs_budget: activation_memory_budget needs PyTorch 2.4 or later: give --torch2.")
    # What compare.py's helpers read, at its defaults.
    defaults = dict(root="sid", python="/usr/bin/python3", pt_attention="sdpa", peers_args="", warmup=2, steps=2,
                    layers=6, d_model=384, heads=6, kv_heads=None, d_ff_gpt2=None, d_ff_llama=None, vocab=8192,
                    max_seq=None, batch=8, dropout_gpt2=0.1, dropout_llama=0.0,
                    remat=os.path.join(C.REPO, "build-libtorch2", "remat"))
    for k, v in defaults.items():
        setattr(a, k, v)
    a.torch_threads = a.torch_threads or ("aten=2,blas=2,build=openmp" if a.arch == "gpt2" else "aten=1,blas=2")
    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    shape = C.shape_of(a, a.arch, a.seq)
    rows = [("remat",) + r for r in remat_peaks(a, shape, out)] + [("pytorch",) + r for r in pytorch_peaks(a, shape, out)]
    csv_path = os.path.join(out, "peaks.csv")
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        for system, budget, fraction, peak in rows:
            w.writerow([0 if system == "remat" else 1, budget, fraction, peak])
    over = [r for r in rows if r[0] == "remat" and r[3] > r[1]]
    falls = [i for i in range(1, 10) if rows[i][3] < rows[i - 1][3]]
    log(f"peak_vs_budget: remat's peak {'exceeded its budget at ' + str(over) if over else 'never exceeded its budget'}"
        f"; {'monotone' if not falls else 'fell at budgets ' + str([rows[i][1] for i in falls])} in the budget")
    if shutil.which("gnuplot"):
        plot(csv_path, os.path.join(out, "peak_vs_budget.png"), f"{a.arch} 6x384, {a.seq} tokens x 8: peak against budget")
    return 1 if over or falls else 0


if __name__ == "__main__":
    sys.exit(main())
