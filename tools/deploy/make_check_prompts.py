#!/usr/bin/env python3
"""Writes the prompt sets of `pdserve check` (deploy/check/*.jsonl).

prompts.jsonl: the default set for a production model: long code and HTML generation, a
multi-turn chat with a system message, structured output, and long-context recall (a fact hidden
in ~2,000 words of generated town records, with "expect" naming the fact).
kjv-prompts.jsonl: for the bundled tiny KJV model (models/kjv-v4-tiny), in the chat tasks it was
trained on (recite, next verse, finish a verse, a verse from a book; some with a system prompt,
some two-turn). Its samples sometimes end at once with EOS, so a quarter may fail per prompt.

Deterministic (seeded); rerun after editing:  python3 tools/deploy/make_check_prompts.py
"""
import json
import os
import random

OUT = os.path.join(os.path.dirname(__file__), "..", "..", "deploy", "check")


def town_records(rng, needle, sentences=160):
    streets = ["Mill", "Orchard", "Quarry", "Bell", "Harbor", "Tanner", "Cedar", "Lantern"]
    trades = ["cooper", "weaver", "glazier", "farrier", "chandler", "miller", "potter", "mason"]
    goods = ["barrels", "linen", "window panes", "horseshoes", "candles", "flour", "jugs", "lintels"]
    months = ["January", "March", "May", "July", "September", "November"]
    lines = []
    for i in range(sentences):
        street, trade, good = rng.choice(streets), rng.choice(trades), rng.choice(goods)
        lines.append(
            f"In {rng.choice(months)} {1800 + rng.randrange(120)}, the {trade} on {street} Street "
            f"recorded {rng.randrange(3, 400)} {good} sold to household number {i + 1}.")
    lines.insert(sentences // 2, needle)
    return " ".join(lines)


def default_set(rng):
    code = "7391-HARLOW"
    context = town_records(rng, f"The key to the archive room is kept under code {code}.")
    return [
        {"id": "html-landing-page", "max_tokens": 1500, "messages": [
            {"role": "user", "content":
             "Write a complete HTML5 landing page for a small bakery: a <style> block with a "
             "responsive grid, a header with navigation, three product cards with prices, an "
             "opening-hours table and a footer. Output only the HTML."}]},
        {"id": "python-lru-cache", "max_tokens": 1500, "messages": [
            {"role": "user", "content":
             "Write a Python module implementing a thread-safe LRU cache class with get, put and "
             "delete, type hints and docstrings, followed by unittest tests covering eviction "
             "order and capacity 0."}]},
        {"id": "multi-turn-system", "max_tokens": 600, "messages": [
            {"role": "system", "content":
             "You are a precise assistant for a railway company. Answer in complete sentences."},
            {"role": "user", "content": "What should I check before booking a night train?"},
            {"role": "assistant", "content":
             "Check the departure station, the type of berth, whether meals are included and the "
             "cancellation terms."},
            {"role": "user", "content":
             "Explain the difference between a couchette and a sleeper berth, then list three "
             "things to pack."}]},
        {"id": "json-records", "max_tokens": 1200, "messages": [
            {"role": "user", "content":
             "Return a JSON array of 15 fictional library books, each an object with title, "
             "author, year, isbn and a one-sentence summary. Every book must be different."}]},
        {"id": "long-context-recall", "max_tokens": 200, "expect": code, "messages": [
            {"role": "system", "content": "Answer from the document only."},
            {"role": "user", "content":
             "Document:\n" + context + "\n\nUnder which code is the key to the archive room "
             "kept? Answer with the code and one sentence."}]},
    ]


def kjv_set():
    lenient = {"max_failing_fraction": 0.25}
    system = "You answer with verses from the King James Bible."
    prompts = [
        ("recite-john", [{"role": "user", "content": "Recite John 3:16."}]),
        ("recite-psalm", [{"role": "user", "content": "Recite Psalms 23:1."}]),
        ("finish-verse", [{"role": "user", "content":
                           "Finish this verse: In the beginning God created"}]),
        ("verse-from-book", [
            {"role": "system", "content":
             "You are a helpful assistant who knows the King James Version by heart."},
            {"role": "user", "content": "Give me a verse from John."}]),
        ("what-does-say", [{"role": "user", "content": "What does Genesis 1:3 say?"}]),
        ("system-two-turns", [
            {"role": "system", "content": system},
            {"role": "user", "content": "Recite Genesis 1:1."},
            {"role": "assistant", "content":
             "In the beginning God created the heaven and the earth."},
            {"role": "user", "content": "What comes after it?"}]),
    ]
    return [{"id": pid, "max_tokens": 128, "thresholds": lenient, "messages": msgs}
            for pid, msgs in prompts]


def write(name, items):
    with open(os.path.join(OUT, name), "w") as f:
        for item in items:
            f.write(json.dumps(item) + "\n")


def main():
    os.makedirs(OUT, exist_ok=True)
    write("prompts.jsonl", default_set(random.Random(1611)))
    write("kjv-prompts.jsonl", kjv_set())


if __name__ == "__main__":
    main()
