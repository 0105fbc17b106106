#!/usr/bin/env python3
"""Golden encodings of Hugging Face's `tokenizers`, against which remat's byte-level BPE
(tests/data/hf_tokenizer_test.cpp) is held.

    make_goldens.py train    makes the two small tokenizers (gpt2/, llama3/) once
    make_goldens.py write    writes goldens.json from them
    make_goldens.py check    fails when `tokenizers` no longer gives goldens.json

Needs Debian's python3-tokenizers (the LibTorch 2.x lane's sid root installs it and runs
`check`). The tokenizers are trained here, small, on text generated below: GPT-2's
layout (its regular expression inside the ByteLevel pre-tokenizer, <|endoftext|>) and
Llama 3's (a Split on its regular expression, then ByteLevel without one, merges ignored
for whole words, <|begin_of_text|> and <|end_of_text|>, a tokenizer_config.json naming them).
"""
import json
import os
import random
import sys

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

HERE = os.path.dirname(os.path.abspath(__file__))
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

WORDS = [
    "the", "and", "of", "memory", "budget", "layer", "recompute", "gradient", "Über", "straße",
    "naïve", "café", "日本語", "テキスト", "中文", "分词", "русский", "текст", "ελληνικά", "עברית",
    "العربية", "हिन्दी", "한국어", "ภาษาไทย", "🙂", "🚀🚀", "👩‍💻", "1234567", "3.14159", "don't",
    "WE'LL", "it's", "x²", "½", "Ⅻ", "٣٤", "\u00a0nbsp", "tab\there", "—", "«quoted»",
]


def training_text():
    rng = random.Random(1)
    lines = []
    for _ in range(4000):
        n = rng.randint(3, 14)
        line = " ".join(rng.choice(WORDS) for _ in range(n))
        lines.append(line + rng.choice([".", "!", "?", ",", "", ";"]))
    return "\n".join(lines) + "\n"


# The inputs: mixed scripts, emoji (with joiners), whitespace runs of every kind, special
# tokens inside text, and bytes that are not UTF-8 (decoded with replacement, as remat's
# tokenizer reads them).
def samples():
    raw = [
        b"Hello world",
        b" leading space and trailing space ",
        "The King said: \u00ab Let there be light \u00bb \u2014 and there was light.\n".encode(),
        "Stra\u00dfe, caf\u00e9, na\u00efve, \u00dcber \u2013 \u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3002".encode(),
        "\u0440\u0443\u0441\u0441\u043a\u0438\u0439 \u0442\u0435\u043a\u0441\u0442, \u03b5\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac".encode(),
        "\u0627\u0644\u0639\u0631\u0628\u064a\u0629 \u05e2\u05d1\u05e8\u05d9\u05ea \u0939\u093f\u0928\u094d\u0926\u0940 \ud55c\uad6d\uc5b4".encode(),
        "emoji \U0001f642\U0001f680 family \U0001f468\u200d\U0001f469\u200d\U0001f467 flag \U0001f1e9\U0001f1ea".encode(),
        b"tabs\t\tand\n\nnewlines\r\n\r\nand   runs     of spaces\n",
        b"    \n\n\t \n   ",
        "nbsp\u00a0\u00a0ideographic\u3000space, nel\u0085line, zero\u200bwidth".encode(),
        b"numbers 1 12 123 1234 12345 3.14159 1,000,000 0x1F",
        b"don't WE'LL it's I'M you'Re they'VE he'd",
        b"text<|endoftext|>more text <|endoftext|> and <|begin_of_text|>start<|end_of_text|>",
        b"<|endoftext|><|endoftext|>",
        b"invalid \xff\xfe bytes \xc3( and \xe2\x82 cut \xf0\x9f\x98 end\x80",
        b"lone \xed\xa0\x80 surrogate and overlong \xc0\xaf and \xf4\x90\x80\x80 beyond",
        b"!!!???...,,,;;;:::---___***",
        b"a" * 300 + b" " + b"ab" * 200,
        " ".join(WORDS).encode(),
    ]
    rng = random.Random(7)
    for _ in range(6):
        n = rng.randint(20, 80)
        raw.append(" ".join(rng.choice(WORDS) for _ in range(n)).encode())
    return raw


def gpt2_style(text):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=700, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([text], trainer)
    return tok, None


def llama3_style(text):
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=800, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([text], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))]
    )
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    return tok, config


def train():
    text = training_text()
    for name, make in (("gpt2", gpt2_style), ("llama3", llama3_style)):
        tok, config = make(text)
        os.makedirs(os.path.join(HERE, name), exist_ok=True)
        tok.save(os.path.join(HERE, name, "tokenizer.json"))
        if config:
            with open(os.path.join(HERE, name, "tokenizer_config.json"), "w") as f:
                json.dump(config, f, indent=2)
                f.write("\n")


def goldens():
    out = {"tokenizers_version": None, "cases": []}
    import tokenizers

    out["tokenizers_version"] = tokenizers.__version__
    for name in ("gpt2", "llama3"):
        tok = Tokenizer.from_file(os.path.join(HERE, name, "tokenizer.json"))
        for raw in samples():
            text = raw.decode("utf-8", errors="replace")
            ids = tok.encode(text, add_special_tokens=False).ids
            out["cases"].append(
                {
                    "tokenizer": name,
                    "hex": raw.hex(),
                    "ids": ids,
                    "decoded": tok.decode(ids, skip_special_tokens=False),
                }
            )
    return out


def dump(g):
    # The version is informative only: `check` compares the cases.
    return json.dumps(g, indent=1, ensure_ascii=True) + "\n"


def main():
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    path = os.path.join(HERE, "goldens.json")
    if what == "train":
        train()
    elif what == "write":
        with open(path, "w") as f:
            f.write(dump(goldens()))
    elif what == "check":
        with open(path) as f:
            recorded = json.load(f)
        now = goldens()
        if now["cases"] != recorded["cases"]:
            bad = [i for i, (a, b) in enumerate(zip(now["cases"], recorded["cases"])) if a != b]
            sys.exit(f"tokenizers {now['tokenizers_version']} no longer gives {path}: cases {bad} differ")
        print(f"tokenizers {now['tokenizers_version']} gives the {len(now['cases'])} recorded encodings")
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
