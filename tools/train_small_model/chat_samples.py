"""Chat-formatted training samples made from KJV verses.

Each sample is a short conversation in the DeepSeek-V4 chat format (chat_format.render) whose
answers are verse text, so the role tokens and the turn structure carry meaning for the model.
Only training chapters are used; the choice of verses and templates is seeded.
"""

import random

import chat_format

SYSTEM_PROMPTS = [
    "You answer with verses from the King James Bible.",
    "You are a helpful assistant who knows the King James Version by heart.",
]


def _first_words(text, rng):
    words = text.split()
    if len(words) < 6:
        return None
    cut = rng.randint(3, len(words) - 2)
    return " ".join(words[:cut]), " ".join(words[cut:])


def _turn(chapter, n, rng):
    """One (question, answer) pair about verse n (1-based) of chapter, or None."""
    verse = chapter.verses[n - 1]
    ref = f"{chapter.book} {chapter.number}:{n}"
    kind = rng.randrange(5)
    if kind == 0:
        return f"Recite {ref}.", verse
    if kind == 1 and n < len(chapter.verses):
        return f'What comes after "{verse}"?', chapter.verses[n]
    if kind == 2:
        split = _first_words(verse, rng)
        if split:
            return f"Finish this verse: {split[0]}", split[1]
    if kind == 3:
        return f"Give me a verse from {chapter.book}.", f"{ref} {verse}"
    if kind == 4 and n + 1 < len(chapter.verses):
        nxt = chapter.verses[n]
        return (f"Quote {ref} and the verse after it.", f"{verse} {nxt}")
    return f"What does {ref} say?", verse


def make_samples(chapters, fraction, seed):
    """Returns chat strings for about `fraction` of the verses of the given chapters."""
    rng = random.Random(seed)
    samples = []
    for chapter in chapters:
        for n in range(1, len(chapter.verses) + 1):
            if rng.random() >= fraction:
                continue
            messages = []
            if rng.random() < 0.3:
                messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
            turns = 2 if rng.random() < 0.2 and n < len(chapter.verses) else 1
            for k in range(turns):
                question, answer = _turn(chapter, n + k, rng)
                messages.append({"role": "user", "content": question})
                messages.append({"role": "assistant", "content": answer})
            samples.append(chat_format.render(messages))
    return samples
