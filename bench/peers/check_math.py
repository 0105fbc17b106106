#!/usr/bin/python3
"""Checks that peers.py computes remat's math: loads the weights of a finished `remat train`
run into the peers model and recomputes its final validation loss.

remat's validation loss (src/train/trainer.cpp, validation_loss) is the row-weighted mean
loss of the first train.eval_batches sequential batches of the validation split, with
dropout off; summary.json records it as final_val_loss, computed with the weights that
model.safetensors holds. Same weights, same tokens, same math: the two must agree to
float32 rounding (about 1e-5 here).

    /usr/bin/python3 bench/peers/check_math.py RUN_DIR [--data-dir data]

Make the run small, e.g. (from the repository root):
    ./build/remat train model.preset=gpt2-demo model.n_layer=2 model.n_head=4 model.d_model=64 \
        model.d_ff=256 model.max_seq=64 model.vocab_size=8192 data.vocab_size=8192 train.seq=64 \
        train.batch=2 train.steps=1 train.eval_batches=1 run.sample_tokens=0 ac.profile=false \
        run.out_dir=/tmp/peers-check run.name=gpt2
"""

import argparse
import json
import os
import struct
import sys
import tomllib

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402

DTYPES = {"F32": torch.float32, "F64": torch.float64, "BF16": torch.bfloat16, "F16": torch.float16}


def load_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = memoryview(data)[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        t = torch.frombuffer(bytearray(body[a:b]), dtype=DTYPES[info["dtype"]]) if b > a else \
            torch.empty(0, dtype=DTYPES[info["dtype"]])
        out[name] = t.reshape(info["shape"])
    return out


def peers_name(arch, name):
    """remat's (Hugging Face) parameter name -> (peers state-dict key, transposed in the file)."""
    if arch == "gpt2":
        name = name.removeprefix("transformer.")
        if name.startswith("h."):
            _, layer, rest = name.split(".", 2)
            rename = {"attn.c_attn.": "c_attn.", "attn.c_proj.": "c_proj.", "mlp.c_fc.": "c_fc.",
                      "mlp.c_proj.": "mlp_c_proj."}
            for old, new in rename.items():
                if rest.startswith(old):
                    # GPT-2 files keep Conv1D's [in, out] layout (remat's hf_transposed).
                    return f"h.{layer}.{new}{rest[len(old):]}", rest.endswith("weight")
            return f"h.{layer}.{rest}", False
        return {"wte.weight": "wte", "wpe.weight": "wpe"}.get(name, name), False
    if name.startswith("model.layers."):
        _, _, layer, rest = name.split(".", 3)
        rest = rest.removeprefix("self_attn.").removeprefix("mlp.")
        rest = rest.replace("layernorm.weight", "layernorm")
        return f"layers.{layer}.{rest}", False
    return {"model.embed_tokens.weight": "embed_tokens", "model.norm.weight": "norm",
            "lm_head.weight": "lm_head"}[name], False


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    ap.add_argument("--data-dir", default=None, help="default: the run's data.dir, from the repository root")
    ap.add_argument("--tolerance", type=float, default=1e-4)
    a = ap.parse_args()
    with open(os.path.join(a.run_dir, "config.toml"), "rb") as f:
        cfg = tomllib.load(f)
    with open(os.path.join(a.run_dir, "summary.json")) as f:
        summary = json.load(f)
    m, t = cfg["model"], cfg["train"]
    if m.get("attention", "math") != "math":
        print(f"note: the run used {m['attention']} attention; peers computes the same function with math attention",
              file=sys.stderr)
    argv = ["--arch", m["arch"], "--layers", str(m["n_layer"]), "--d-model", str(m["d_model"]),
            "--heads", str(m["n_head"]), "--kv-heads", str(m["n_kv_head"]), "--d-ff", str(m["d_ff"]),
            "--vocab", str(m["vocab_size"]), "--seq", str(t["seq"]), "--max-seq", str(m["max_seq"]),
            "--batch", str(t["batch"]), "--dropout", str(m["dropout"]), "--norm-eps", str(m["norm_eps"]),
            "--rope-theta", str(m["rope_theta"])]
    c = peers.parse_args(argv)
    model = peers.Model(c)

    if cfg["data"].get("text"):
        sys.exit("check_math: the run trained on data.text; pass --data-dir with its prepared corpus")
    data_dir = a.data_dir or os.path.join(cfg["data"]["dir"], f"kjv-v{cfg['data']['vocab_size']}")
    with open(os.path.join(data_dir, "meta.json")) as f:
        meta = json.load(f)
    width = {"uint16": 2, "uint32": 4}[meta["tokens"]["dtype"]]
    with open(os.path.join(data_dir, meta["tokens"]["val"]["file"]), "rb") as f:
        raw = f.read()
    ids = torch.tensor(list(memoryview(raw).cast("H" if width == 2 else "I")), dtype=torch.long)

    def val_loss():
        B, T = t["batch"], t["seq"]
        windows = (ids.numel() - 1) // T
        n_batches = min(t["eval_batches"], (windows + B - 1) // B)
        model.eval()
        total = rows_seen = 0.0
        with torch.no_grad():
            for i in range(n_batches):
                rows = min(B, windows - i * B)
                starts = (torch.arange(rows) + i * B) * T
                w = ids[starts[:, None] + torch.arange(T + 1)[None, :]]
                total += rows * model(w[:, :-1], w[:, 1:]).item()
                rows_seen += rows
        return total / rows_seen

    state = model.state_dict()
    loaded = set()
    for name, tensor in load_safetensors(os.path.join(a.run_dir, "model.safetensors")).items():
        key, transposed = peers_name(c.arch, name)
        if key not in state:
            sys.exit(f"check_math: {name} (as {key}) is not a peers parameter")
        value = tensor.t() if transposed else tensor
        if tuple(value.shape) != tuple(state[key].shape):
            sys.exit(f"check_math: {name} is {tuple(value.shape)}, peers' {key} is {tuple(state[key].shape)}")
        state[key].copy_(value)
        loaded.add(key)
    missing = {k for k, _ in model.named_parameters()} - loaded
    if missing:
        sys.exit(f"check_math: the file lacks {sorted(missing)}")
    ours = val_loss()

    theirs = summary["final_val_loss"]
    n_params = sum(p.numel() for p in model.parameters())
    ok = abs(ours - theirs) <= a.tolerance and n_params == summary["parameters"]
    print(json.dumps({"arch": c.arch, "remat_val_loss": theirs, "peers_val_loss": ours, "difference": ours - theirs,
                      "remat_parameters": summary["parameters"], "peers_parameters": n_params, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
