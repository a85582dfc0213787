#!/usr/bin/env python3
"""Trains the small byte-level BPE fixture tokenizer with DeepSeek's pre-tokenizer configuration.

The pre-tokenizer is the one DeepSeek-V3/V3.2/V4 ship in tokenizer.json: a Sequence of three
isolating Split regexes (digits in runs of 1-3, CJK/kana runs, then the word/punctuation/space
pattern) followed by ByteLevel(add_prefix_space=False, use_regex=False); the decoder is ByteLevel.
The special tokens use DeepSeek's strings so the chat format can be exercised end to end.

Usage: tools/text_train_fixture_tokenizer.py [--out tests/fixtures/text/deepseek_like]
Reruns produce identical files (seeded corpus, deterministic trainer).
"""

import argparse
import json
import os
import sys

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import text_corpus  # noqa: E402

DIGITS = r"\p{N}{1,3}"
CJK_RUNS = "[一-龥\u3040-ゟ゠-ヿ]+"
WORDS = ("[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?"
         "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+")

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
SPECIAL = [BOS, EOS, "<｜▁pad▁｜>", "<｜User｜>", "<｜Assistant｜>"]
NON_SPECIAL_ADDED = ["<think>", "</think>"]
DEBIAN_TEXT = ["/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0"]


def build(vocab_size):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(pattern=_regex(DIGITS), behavior="isolated", invert=False),
        pre_tokenizers.Split(pattern=_regex(CJK_RUNS), behavior="isolated", invert=False),
        pre_tokenizers.Split(pattern=_regex(WORDS), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    extra = [p for p in DEBIAN_TEXT if os.path.exists(p)]
    tok.train_from_iterator(text_corpus.training_text(extra_files=extra), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in NON_SPECIAL_ADDED])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    return tok


def _regex(pattern):
    from tokenizers import Regex
    return Regex(pattern)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="tests/fixtures/text/deepseek_like")
    parser.add_argument("--vocab-size", type=int, default=3000)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    tok = build(args.vocab_size)
    tok.save(os.path.join(args.out, "tokenizer.json"), pretty=False)
    config = {
        "bos_token": {"content": BOS, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "__type": "AddedToken"},
        "eos_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 4096,
        "pdserve_chat_format": "deepseek_v4",
    }
    with open(os.path.join(args.out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=2)
        f.write("\n")
    print(f"wrote {args.out}: vocab {tok.get_vocab_size()}")


if __name__ == "__main__":
    main()
