"""The passes a training step makes over every parameter besides the forward, the backward
and the update, as remat made them before and after 769fd91, in PyTorch at GPT-2 small's
parameter shapes (124M; the tied table is written by the loss head, so only the position
table's gradient is zeroed):

  zero all        every float32 gradient zeroed before the step
  zero positions  only the gradients the first backward adds into by rows
  cast each       each float32 master cast into a new bfloat16 tensor after the update
  cast flat       one copy_ from the flat buffer of masters into the flat buffer of copies

Each round times every pass (the median of --steps runs after one), the passes
alternating; it prints the median over rounds.

    python3 bench/step_passes.py --threads 2 --rounds 5
"""
import argparse
import statistics
import time

import torch


def gpt2_shapes(layers, d_model, vocab, positions):
    C = d_model
    shapes = [(vocab, C), (positions, C)]
    for _ in range(layers):
        shapes += [(C,), (C,), (3 * C, C), (3 * C,), (C, C), (C,),
                   (C,), (C,), (4 * C, C), (4 * C,), (C, 4 * C), (C,)]
    return shapes + [(C,), (C,)]


def views(flat, shapes):
    out, at = [], 0
    for s in shapes:
        n = torch.Size(s).numel()
        out.append(flat[at:at + n].view(s))
        at += n
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=768)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    shapes = gpt2_shapes(a.layers, a.d_model, 50257, 1024)
    P = sum(torch.Size(s).numel() for s in shapes)
    masters = torch.randn(P, generator=torch.Generator().manual_seed(0))
    separate = [m.clone() for m in views(masters, shapes)]
    grads = torch.zeros(P)
    positions = views(grads, shapes)[1]
    copies = torch.empty(P, dtype=torch.bfloat16)
    passes = {
        "zero all": lambda: grads.zero_(),
        "zero positions": lambda: positions.zero_(),
        "cast each": lambda: [m.to(torch.bfloat16) for m in separate],
        "cast flat": lambda: copies.copy_(masters),
    }
    seconds = {name: [] for name in passes}
    for _ in range(a.rounds):
        for name, run in passes.items():
            run()
            times = []
            for _ in range(a.steps):
                t0 = time.perf_counter()
                run()
                times.append(time.perf_counter() - t0)
            seconds[name].append(statistics.median(times))
    print(f"{P:,} parameters, torch {torch.__version__}, {a.threads} threads, {a.rounds} rounds")
    for name, s in seconds.items():
        print(f"{name:15} {statistics.median(s) * 1e3:8.2f} ms  (rounds: {', '.join(f'{x * 1e3:.1f}' for x in s)})")


if __name__ == "__main__":
    main()
