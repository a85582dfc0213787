#!/usr/bin/env python3
"""Rebuilds the small model's training data and tokenizer from Debian's KJV packages.

Writes into --out (nothing here is committed except the held-out slice under --fixtures):
  tokenizer.json, tokenizer_config.json   byte-level BPE, DeepSeek pre-tokenizer, chat template
  train_ids.npy  uint16 token stream: shuffled training documents (chapters whole and verse
                 runs as prose, see --prose) and chat samples, each <bos> ... <eos>
  val_ids.npy    uint16 token stream: the held-out chapters (5%) in canonical order, each
                 <bos> text <eos>
  prompts.json   the 8 logits-fixture prompts and the 5 sampling prompts, with token ids
  heldout_slice_ids.bin  a copy of the fixture below, for train.py
  data.json      sizes and the split, for the model card
and into --fixtures the held-out slice used by the engine's perplexity test:
  heldout_slice.txt       the first held-out chapters (<= --slice-bytes of text)
  heldout_slice_ids.bin   their token ids, uint32 little-endian; a prefix of val_ids.npy

With --long-fixture TOKENS:ROWS (the wide model, models/kjv-v4-wide) prompts.json gets a ninth
fixture prompt, "heldout_long": the held-out stream's first TOKENS tokens (several chapters, BOS /
EOS between them), whose logits fixture keeps only its last ROWS positions (a full [TOKENS, vocab]
float32 file would be tens of MB). --context sets the tokenizer's model_max_length.

Usage: build_data.py --out DIR --fixtures tests/fixtures/small_model [--prose some|every]
                     [--context 512] [--long-fixture TOKENS:ROWS]
"""

import argparse
import json
import os
import random

import numpy as np

import chat_format
import chat_samples
import kjv_corpus
import train_tokenizer

VOCAB_SIZE = 4096
CONTEXT = 512
SEED = 1611
CHAT_FRACTION = 0.15
PASSAGE_FRACTION = 0.4  # --prose some: share of chapters written as prose instead of whole
# verses per prose run (inclusive); "every-sentence" is "every" with each run extended until it
# ends a sentence
PASSAGE_VERSES = {"some": (4, 24), "every": (3, 16), "every-sentence": (3, 16)}
SENTENCE_END = (".", "?", "!")


def chat_prompt(user, system=None):
    messages = [{"role": "system", "content": system}] if system else []
    return chat_format.render(messages + [{"role": "user", "content": user}])


def fixture_prompts(val_text):
    """The 8 logits-fixture prompts: short plain and chat prompts plus held-out passages long
    enough (up to ~80 tokens) that the sliding window (64), the HCA compressor (rate 32) and the
    indexer's top-k selection (rate 4, top 8) all act."""
    bos = chat_format.BOS
    return [
        ("plain_short", bos + "In the beginning"),
        ("plain_phrase", bos + "And God said, Let there be"),
        ("chat_recite", chat_prompt("Recite John 3:16.")),
        (
            "chat_system_two_turns",
            chat_format.render(
                [
                    {"role": "system", "content": chat_samples.SYSTEM_PROMPTS[0]},
                    {"role": "user", "content": "Recite Genesis 1:1."},
                    {
                        "role": "assistant",
                        "content": "In the beginning God created the heaven and the earth.",
                    },
                    {"role": "user", "content": "What comes after it?"},
                ]
            ),
        ),
        ("heldout_24", val_text[0]),
        ("heldout_36", val_text[1]),
        ("heldout_52", val_text[2]),
        ("heldout_80", val_text[3]),
    ]


SAMPLE_PROMPTS = [
    ("beginning", chat_format.BOS + "In the beginning"),
    ("lord_spake", chat_format.BOS + "And the LORD spake unto Moses, saying,"),
    ("blessed", chat_format.BOS + "Blessed are the"),
    ("chat_psalm", chat_prompt("Recite Psalms 23:1.")),
    ("chat_love", chat_prompt("Give me a verse from John.", chat_samples.SYSTEM_PROMPTS[1])),
]


def encode_document(tok, text):
    bos, eos = tok.token_to_id(chat_format.BOS), tok.token_to_id(chat_format.EOS)
    return [bos] + tok.encode(text, add_special_tokens=False).ids + [eos]


def plain_documents(chapters, rng, prose):
    """Training documents. prose "some" (the shipped model's data): most chapters whole (heading
    and numbered verses, like the held-out text), PASSAGE_FRACTION of them cut into runs of 4-24
    verses written as running prose instead, so a prompt that starts mid-text right after BOS is in
    distribution. prose "every": every chapter whole and every chapter again as prose runs of 3-16
    verses, so that a verse opening right after BOS (such as "And the LORD spake unto Moses,
    saying,") is seen continued as prose far more often than as a chat answer, the only place where
    EOS follows a verse's last word or punctuation directly. prose "every-sentence": as "every",
    but a run that would end on a verse ending mid-sentence (such as "... saying,") is extended
    to the next verse that ends with . ? or ! (or the chapter's end), so that no plain document
    teaches EOS right after an unfinished sentence."""
    docs = []
    for chapter in chapters:
        if prose.startswith("every"):
            docs.append(chapter.text())
        elif rng.random() >= PASSAGE_FRACTION:
            docs.append(chapter.text())
            continue
        start = 0
        while start < len(chapter.verses):
            end = min(len(chapter.verses), start + rng.randint(*PASSAGE_VERSES[prose]))
            if prose == "every-sentence":
                while end < len(chapter.verses) and not chapter.verses[end - 1].rstrip().endswith(
                        SENTENCE_END):
                    end += 1
            docs.append(" ".join(chapter.verses[start:end]) + "\n")
            start = end
    return docs


def held_out_passages(tok, chapters, lengths):
    """Passages of about the given token lengths from held-out chapters (text starting with BOS)."""
    out = []
    for length, chapter in zip(lengths, chapters[-len(lengths):]):
        words = chapter.text().split(" ")
        text = ""
        for w in words:
            candidate = (text + " " + w) if text else w
            if len(tok.encode(chat_format.BOS + candidate, add_special_tokens=False).ids) > length:
                break
            text = candidate
        out.append(chat_format.BOS + text)
    return out


def long_fixture(val_ids, spec):
    """The "heldout_long" fixture prompt from --long-fixture TOKENS:ROWS: the first TOKENS ids of
    the held-out stream; train.py writes logits for its last ROWS positions only (logits_from)."""
    tokens, rows = (int(v) for v in spec.split(":"))
    if not 0 < rows <= tokens <= len(val_ids):
        raise SystemExit(f"--long-fixture {spec}: need 0 < ROWS <= TOKENS <= {len(val_ids)}")
    ids = [int(t) for t in val_ids[:tokens]]
    return {"name": "heldout_long", "text": f"the first {tokens} held-out tokens", "ids": ids,
            "logits_from": tokens - rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--fixtures", required=True)
    ap.add_argument("--slice-bytes", type=int, default=48_000)
    ap.add_argument("--prose", choices=sorted(PASSAGE_VERSES), default="some",
                    help="some: 40%% of chapters as prose instead of whole (shipped model); "
                    "every: every chapter whole and again as prose; every-sentence: as every, "
                    "each prose run ending a sentence")
    ap.add_argument("--context", type=int, default=CONTEXT,
                    help="the tokenizer's model_max_length (the model's context)")
    ap.add_argument("--long-fixture", metavar="TOKENS:ROWS",
                    help="add the heldout_long fixture prompt (off by default)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.fixtures, exist_ok=True)

    chapters = kjv_corpus.read_bible()
    train_ch = [c for c in chapters if not c.held_out]
    val_ch = [c for c in chapters if c.held_out]

    tok = train_tokenizer.train([c.text() for c in train_ch], VOCAB_SIZE)
    train_tokenizer.save(tok, args.out, args.context)

    plain = [encode_document(tok, d)
             for d in plain_documents(train_ch, random.Random(SEED), args.prose)]
    chats = [tok.encode(s, add_special_tokens=False).ids for s in chat_samples.make_samples(
        train_ch, CHAT_FRACTION, SEED)]
    samples = plain + chats
    random.Random(SEED).shuffle(samples)
    train_ids = np.array([t for s in samples for t in s], dtype=np.uint16)
    val_docs = [encode_document(tok, c.text()) for c in val_ch]
    val_ids = np.array([t for d in val_docs for t in d], dtype=np.uint16)
    np.save(f"{args.out}/train_ids.npy", train_ids)
    np.save(f"{args.out}/val_ids.npy", val_ids)

    slice_text, slice_ids = "", []
    for chapter, ids in zip(val_ch, val_docs):
        if len(slice_text) + len(chapter.text()) > args.slice_bytes:
            break
        slice_text += chapter.text()
        slice_ids += ids
    with open(f"{args.fixtures}/heldout_slice.txt", "w", encoding="utf-8") as f:
        f.write(slice_text)
    for directory in (args.fixtures, args.out):
        np.array(slice_ids, dtype="<u4").tofile(f"{directory}/heldout_slice_ids.bin")

    passages = held_out_passages(tok, val_ch, [24, 36, 52, 80])
    prompts = {
        "fixtures": [
            {"name": n, "text": t, "ids": tok.encode(t, add_special_tokens=False).ids}
            for n, t in fixture_prompts(passages)
        ],
        "samples": [
            {"name": n, "text": t, "ids": tok.encode(t, add_special_tokens=False).ids}
            for n, t in SAMPLE_PROMPTS
        ],
    }
    if args.long_fixture:
        prompts["fixtures"].append(long_fixture(val_ids, args.long_fixture))
    with open(f"{args.out}/prompts.json", "w", encoding="utf-8") as f:
        json.dump(prompts, f, ensure_ascii=False, indent=1)

    data = {
        "source": "Debian packages bible-kjv-text 4.38 (text) and bible-kjv 4.38 (`bible` reader)",
        "chapters": {"train": len(train_ch), "held_out": len(val_ch)},
        "held_out_rule": f"chapter index % {kjv_corpus.HELD_OUT_MODULUS} == "
        f"{kjv_corpus.HELD_OUT_REMAINDER} (canonical order, Genesis 1 = 0)",
        "tokens": {
            "train_total": int(train_ids.size),
            "train_plain": int(sum(len(s) for s in plain)),
            "train_chat": int(sum(len(s) for s in chats)),
            "chat_samples": len(chats),
            "held_out": int(val_ids.size),
            "heldout_slice": len(slice_ids),
        },
        "chars": {"train": sum(len(c.text()) for c in train_ch),
                  "held_out": sum(len(c.text()) for c in val_ch),
                  "heldout_slice": len(slice_text)},
        "vocab_size": VOCAB_SIZE,
        "seed": SEED,
        "chat_fraction_of_verses": CHAT_FRACTION,
        "prose": args.prose,
        "passage_verses": list(PASSAGE_VERSES[args.prose]),
        **({"passage_fraction_of_chapters": PASSAGE_FRACTION} if args.prose == "some" else {}),
        "plain_documents": len(plain),
    }
    with open(f"{args.out}/data.json", "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    print(json.dumps(data, indent=1))
    for p in prompts["fixtures"] + prompts["samples"]:
        print(f"{p['name']:24s} {len(p['ids']):4d} tokens")


if __name__ == "__main__":
    main()
