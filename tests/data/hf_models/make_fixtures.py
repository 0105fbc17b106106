#!/usr/bin/env python3
"""Small GPT-2 and Llama models made and run by Hugging Face's transformers, against which
remat's loading, forward and export are held (tests/model/hf_models_test.cpp).

    make_fixtures.py write [NAME...]    makes gpt2/, llama/ and llama3.2/, or those named
                                        (config.json, model.safetensors or its shards, the
                                        tokenizer, goldens.safetensors)
    make_fixtures.py check [EXPORT]     fails when transformers no longer gives the goldens;
                                        with EXPORT (the folder the C++ test exported to, as
                                        REMAT_HF_EXPORT), also when transformers, loading
                                        remat's export, does not give remat's own logits, or
                                        its tokenizer files do not encode as the fixture's

llama3.2 differs from Llama 3 as Llama 3.2 1B does: its head is its embedding and its RoPE
is scaled as "llama3" (first trained at 64 positions here, so that a head's 8 frequencies
fall in all three of the scaling's ranges: kept, blended, stretched); and save_pretrained
spreads its weights over several files.

Needs Debian's python3-transformers (the LibTorch 2.x lane's sid root installs it and runs
`check`). Every weight is drawn afresh (normal, 0.1; norms around 1) so that no tensor is
left at a value that would hide a misplaced one; the goldens are float64 logits and loss of
a fixed sequence, computed in float64.
"""
import os
import shutil
import sys

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZERS = os.path.join(HERE, "..", "hf_tokenizers")
SEQ = 24
# remat computes in float32; its logits may differ from float64's by float32's rounding
# through two blocks (tests/model/hf_models_test.cpp says how far, beside the same constant).
BOUND = 1e-5
# Mixed scripts, a special token written in the text, emoji with a joiner, whitespace runs.
SAMPLE = "Grüße, 世界! <|endoftext|> 👩‍💻  tabs\tand\n\nnew lines"


def vocab_of(name):
    return Tokenizer.from_file(os.path.join(TOKENIZERS, name, "tokenizer.json")).get_vocab_size()


def models():
    gpt2 = GPT2Config(vocab_size=vocab_of("gpt2"), n_positions=64, n_embd=32, n_layer=2, n_head=4,
                      layer_norm_epsilon=1e-5, bos_token_id=0, eos_token_id=0)
    llama = LlamaConfig(vocab_size=vocab_of("llama3"), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1,
                        eos_token_id=2)
    llama32 = LlamaConfig(vocab_size=vocab_of("llama3"), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                          rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                          rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 64})
    return {"gpt2": (GPT2LMHeadModel, gpt2, "gpt2"), "llama": (LlamaForCausalLM, llama, "llama3"),
            "llama3.2": (LlamaForCausalLM, llama32, "llama3")}


# Kilobytes per shard: the 64-wide fixture's 0.4 MB in several files.
SHARD = {"llama3.2": "150KB"}


def ids_for(vocab):
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, vocab, (1, SEQ), generator=g)


def run(model, ids):
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
    return out.logits[0].to(torch.float64), out.loss.to(torch.float64)


def write(names):
    for seed, (name, (cls, config, tokenizer)) in enumerate(models().items()):
        if names and name not in names:
            continue
        torch.manual_seed(seed)
        model = cls(config)
        g = torch.Generator().manual_seed(100 + seed)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                base = 1.0 if ("ln" in pname or "norm" in pname) and pname.endswith("weight") else 0.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
        folder = os.path.join(HERE, name)
        shutil.rmtree(folder, ignore_errors=True)
        model.save_pretrained(folder, max_shard_size=SHARD.get(name, "50GB"))
        for f in ("tokenizer.json", "tokenizer_config.json"):
            src = os.path.join(TOKENIZERS, tokenizer, f)
            if os.path.exists(src):
                shutil.copy(src, folder)
        ids = ids_for(config.vocab_size)
        logits, loss = run(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64,
                                                                attn_implementation="eager"), ids)
        save_file({"ids": ids, "logits": logits, "loss": loss.reshape(1)}, os.path.join(folder, "goldens.safetensors"))
        print(f"{name}: {sum(p.numel() for p in model.parameters())} parameters, loss {loss.item():.6f}")


def check(export):
    failed = False
    for name in models():
        folder = os.path.join(HERE, name)
        goldens = load_file(os.path.join(folder, "goldens.safetensors"))
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, attn_implementation="eager")
        logits, loss = run(model, goldens["ids"])
        diff = (logits - goldens["logits"]).abs().max().item()
        if diff > 1e-9 or abs(loss.item() - goldens["loss"].item()) > 1e-9:
            print(f"{name}: transformers gives logits {diff:.3g} away from the goldens (loss {loss.item()})")
            failed = True
        if export is None:
            continue
        theirs = os.path.join(export, name)
        remat = load_file(os.path.join(theirs, "remat_logits.safetensors"))
        model = AutoModelForCausalLM.from_pretrained(theirs, dtype=torch.float64, attn_implementation="eager")
        logits, loss = run(model, remat["ids"])
        diff = (logits - remat["logits"].to(torch.float64)).abs().max().item()
        loss_diff = abs(loss.item() - remat["loss"].item())
        print(f"{name}: remat's export in transformers: logits within {diff:.3g}, loss within {loss_diff:.3g} "
              f"(bound {BOUND})")
        if diff > BOUND or loss_diff > BOUND:
            failed = True
        ours, exported = AutoTokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(theirs)
        if exported(SAMPLE)["input_ids"] != ours(SAMPLE)["input_ids"]:
            print(f"{name}: the tokenizer remat exported encodes {SAMPLE!r} otherwise than the fixture's")
            failed = True
    if failed:
        sys.exit("transformers disagrees with the goldens or with remat's export")
    print("transformers gives the goldens" + ("" if export is None else " and remat's export its logits"))


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "write":
        write(sys.argv[2:])
    elif len(sys.argv) >= 2 and sys.argv[1] == "check":
        check(sys.argv[2] if len(sys.argv) > 2 else None)
    else:
        sys.exit(__doc__)
