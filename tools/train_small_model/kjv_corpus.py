"""The King James Version text from Debian's bible-kjv packages, as chapters and verses.

The text comes from the `bible` program (package bible-kjv) reading /usr/lib/bible.data
(package bible-kjv-text). The split into training and held-out chapters is deterministic: every
20th chapter (global chapter index % 20 == 10) is held out, 5% of the chapters.
"""

import dataclasses
import re
import subprocess

_HEADER = re.compile(r"^(\S.*) (\d+)$")
_VERSE = re.compile(r"^\s+(\d+) (.*)$")
HELD_OUT_MODULUS = 20
HELD_OUT_REMAINDER = 10


@dataclasses.dataclass
class Chapter:
    index: int  # 0-based position in canonical order (Genesis 1 = 0, Revelation 22 = 1188)
    book: str
    number: int
    verses: list  # verse texts, verse n at verses[n - 1]

    @property
    def held_out(self):
        return self.index % HELD_OUT_MODULUS == HELD_OUT_REMAINDER

    def text(self):
        """The chapter as one document: a heading line, then one numbered verse per line."""
        lines = [f"{self.book} {self.number}", ""]
        lines += [f"{n} {v}" for n, v in enumerate(self.verses, start=1)]
        return "\n".join(lines) + "\n"


def read_bible():
    """Runs `bible` over the whole text and returns the 1189 chapters in canonical order.

    Raises RuntimeError if the program is missing or its output does not parse.
    """
    try:
        raw = subprocess.run(
            ["bible", "-l100000", "Gen1:1-Rev22:21"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except FileNotFoundError as e:
        raise RuntimeError("`bible` not found: install the Debian package bible-kjv") from e
    chapters = []
    for line in raw.splitlines():
        if not line.strip():
            continue
        verse = _VERSE.match(line)
        if verse:
            if not chapters or int(verse.group(1)) != len(chapters[-1].verses) + 1:
                raise RuntimeError(f"verse out of order: {line!r}")
            chapters[-1].verses.append(verse.group(2).strip())
            continue
        header = _HEADER.match(line)
        if not header:
            raise RuntimeError(f"unparsed line: {line!r}")
        chapters.append(Chapter(len(chapters), header.group(1), int(header.group(2)), []))
    if len(chapters) != 1189 or sum(len(c.verses) for c in chapters) != 31102:
        raise RuntimeError("unexpected KJV size: expected 1189 chapters and 31102 verses")
    return chapters
