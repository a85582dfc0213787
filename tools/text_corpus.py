"""Deterministic text corpora for the tokenizer fixtures, golden vectors and cross-checks.

`crosscheck_strings` returns the strings the C++ tokenizer is compared on against the Python
`tokenizers` package: ASCII prose, whitespace runs, digits, code, CJK, emoji with ZWJ sequences,
combining marks, text that looks like special tokens, other scripts and random mixes of all of
them. `training_text` returns the text the fixture tokenizer is trained on. Both depend only on
the seed, so every rerun of the tools produces the same files.
"""

import random
import unicodedata

WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no what "
    "up out about who them can more into some time could only other new people than first way "
    "model token prefill decode page ticket router worker request stream latency throughput "
    "attention sparse compressed indexer expert memory cache batch sample temperature server "
    "DeepSeek Transformer Hello World Paris London Tokyo Berlin don't isn't we're they've I'm "
    "you'll he'd It's naïve café résumé coöperate façade jalapeño Straße Ærøskøbing"
).split()

CJK = "的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可主发年动同工也能下过子说产种面而方后多定行学法所民得经十三之进着等部度家电力里如水化高自二理起小物现实加量都两体制机当使点从业本去把性好应开它合还因由其些然前外天政四日那社义事平形相全表间样与关各重新线内数正心反你明看原又么利比或但质气第向道命此变条只没结解问意建月公无系军很情者最立代想已通并提直题党程展五果料象员革位入常文总次品式活设及管特件长求老头基资边流路级少图山统接知较将组见计别她手角期根论运农指几九区强放决西被干做必战先回则任取据处理"
KANA = "あいうえおかきくけこさしすせそたちつてとなにぬねのはひふへほまみむめもやゆよらりるれろわをんアイウエオカキクケコサシスセソタチツテトナニヌネノハヒフヘホマミムメモヤユヨラリルレロワヲンー"
HANGUL = "가나다라마바사아자차카타파하한국어대한민국서울사람시간세계"
OTHER_SCRIPTS = (
    "Привет мир", "Здравствуйте, как дела?", "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया",
    "สวัสดีชาวโลก", "Γειά σου Κόσμε", "Բարեւ աշխարհ", "ሰላም ልዑል", "Tiếng Việt có dấu",
)
EMOJI = (
    "😀", "🎉", "🚀", "❤️", "👍🏽", "👩‍💻", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇯🇵", "🇺🇸🇫🇷", "1️⃣", "🧑🏿‍🤝‍🧑🏻",
    "🐈‍⬛", "😶‍🌫️", "🫠", "🤌🏼", "👁️‍🗨️", "©️", "™", "🀄",
)
COMBINING = ("e\u0301", "a\u0308", "n\u0303", "o\u0302\u0323", "Z\u0336\u0335\u0334a\u0337l\u0338g\u0321o",
             "\u0915\u094d\u0937", "\u0e01\u0e34\u0e4a", "i\u0307\u0301", "\u1100\u1161\u11a8")
SPACES = (" ", "  ", "\t", "\n", "\r\n", "\n\n", "\u00a0", "\u3000", "\u2009", "\u200b", "\u0085",
          "\u2028", "\x0b", "\x0c", " \t \n")
PUNCT = ".,;:!?()[]{}<>\"'`~@#$%^&*-_=+|\\/"
CODE = (
    "def f(x):\n    return x * 2\n", "int main() { return 0; }", "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
    "if __name__ == '__main__':\n    main()", "SELECT id, name FROM users WHERE age >= 18;",
    "const x = () => { console.log(`value: ${v}`); };", "#include <vector>\nstd::vector<int> v{1, 2, 3};",
    "fn main() -> Result<(), Box<dyn Error>> {\n    Ok(())\n}", "  <div class=\"a\">&nbsp;</div>",
    "x=1;y=2;z=x+y", "$ ls -la | grep '^d' > out.txt 2>&1", "{\"key\": [1, 2.5, null, true]}",
)
LOOKALIKES = (
    "<｜User｜>", "<｜Assistant｜>", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<think>",
    "</think>", "<｜User", "｜>", "<|User|>", "<|im_start|>", "<｜▁pad▁｜>", "<<｜User｜>>",
    "<｜User｜><｜User｜>", "</think></think>", "<thinking>", "<｜DSML｜invoke>",
)


def _number(rng):
    kind = rng.randrange(5)
    if kind == 0:
        return str(rng.randrange(10 ** rng.randrange(1, 12)))
    if kind == 1:
        return f"{rng.uniform(-1e4, 1e4):.{rng.randrange(1, 6)}f}"
    if kind == 2:
        return "".join(rng.choice("0123456789") for _ in range(rng.randrange(1, 30)))
    if kind == 3:
        return rng.choice(("٣٤٥", "１２３", "Ⅻ", "½", "²³", "١٢٣٤٥٦٧"))
    return f"{rng.randrange(1000)},{rng.randrange(1000):03d},{rng.randrange(1000):03d}"


def _sentence(rng, n_words):
    words = [rng.choice(WORDS) for _ in range(n_words)]
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice(".!?;")


def _piece(rng, kind):
    if kind == "ascii":
        return _sentence(rng, rng.randrange(1, 20))
    if kind == "spaces":
        return "".join(rng.choice(SPACES) * rng.randrange(1, 4) for _ in range(rng.randrange(1, 6)))
    if kind == "digits":
        return _number(rng)
    if kind == "code":
        return rng.choice(CODE)
    if kind == "cjk":
        pool = rng.choice((CJK, KANA, HANGUL, CJK + KANA))
        return "".join(rng.choice(pool) for _ in range(rng.randrange(1, 25)))
    if kind == "emoji":
        return "".join(rng.choice(EMOJI) for _ in range(rng.randrange(1, 6)))
    if kind == "combining":
        return "".join(rng.choice(COMBINING) for _ in range(rng.randrange(1, 5)))
    if kind == "lookalike":
        return rng.choice(LOOKALIKES)
    if kind == "script":
        return rng.choice(OTHER_SCRIPTS)
    if kind == "punct":
        return "".join(rng.choice(PUNCT) for _ in range(rng.randrange(1, 8)))
    while True:
        c = chr(rng.choice((rng.randrange(0x20, 0x7f), rng.randrange(0xa0, 0xd7ff),
                            rng.randrange(0xe000, 0xfffd), rng.randrange(0x10000, 0x1fbff))))
        # Debian 12's PCRE2 (10.42) has Unicode 14 tables while `tokenizers`' Oniguruma has newer
        # ones, so characters assigned after Unicode 14 can split differently (docs/text.md).
        # Unicode 3.2 assignments keep the pool the same on every Python version.
        if unicodedata.ucd_3_2_0.category(c) != "Cn":
            return c


KINDS = ("ascii", "spaces", "digits", "code", "cjk", "emoji", "combining", "lookalike", "script",
         "punct", "codepoint")


def crosscheck_strings(seed=20261129, count=2400):
    """Returns `count` strings: each kind alone, then mixes of 2-8 pieces of random kinds."""
    rng = random.Random(seed)
    strings = ["", " ", "\n", "a", "  leading", "trailing  ", "x" * 300, " " * 64, "1" * 40,
               "中" * 50, "😀" * 20]
    for kind in KINDS:
        strings.extend(_piece(rng, kind) for _ in range(60))
    while len(strings) < count:
        glue = rng.choice(("", " ", "", "\n"))
        strings.append(glue.join(_piece(rng, rng.choice(KINDS)) for _ in range(rng.randrange(2, 9))))
    return strings[:count]


def training_text(seed=7, extra_files=()):
    """Returns training lines: generated mixes plus the text of `extra_files` (Debian docs)."""
    rng = random.Random(seed)
    lines = []
    for path in extra_files:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines.extend(f.read().splitlines())
    for _ in range(6000):
        lines.append(" ".join(_piece(rng, rng.choice(KINDS + ("ascii", "ascii", "cjk")))
                              for _ in range(rng.randrange(1, 6))))
    return lines
