"""Byte-level BPE tokenizer with DeepSeek-V3/V4's pre-tokenizer, trained with `tokenizers`.

The pre-tokenizer is the sequence DeepSeek-V3 ships in its tokenizer.json (and V4 keeps): digits
split in runs of at most three, CJK runs isolated, a word/punctuation/whitespace split, then
ByteLevel without its own regex. BOS is prepended by a TemplateProcessing post-processor, as in
DeepSeek's tokenizer.json. Special tokens: BOS 0, EOS 1, pad 2, then the chat role tokens
(special) and <think>/</think> (added, not special, so they survive decode like in DeepSeek).
"""

import json

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, processors, trainers

import chat_format

# DeepSeek-V3 tokenizer.json, pre_tokenizer.pretokenizers[0..2].pattern.Regex.
DIGITS = r"\p{N}{1,3}"
CJK = "[一-龥぀-ゟ゠-ヿ]+"
WORDS = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|"
    r" ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def build_pipeline():
    """An untrained BPE tokenizer with DeepSeek's normalizer, pre-tokenizer and decoder."""
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.normalizer = normalizers.Sequence([])
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(DIGITS), behavior="isolated", invert=False),
            pre_tokenizers.Split(Regex(CJK), behavior="isolated", invert=False),
            pre_tokenizers.Split(Regex(WORDS), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train(texts, vocab_size):
    """Trains on an iterable of strings; the result has exactly vocab_size entries."""
    tok = build_pipeline()
    extra = len(chat_format.ROLE_TOKENS) + len(chat_format.THINK_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - extra,
        min_frequency=2,
        show_progress=False,
        special_tokens=chat_format.SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True) for t in chat_format.ROLE_TOKENS])
    tok.add_tokens([AddedToken(t, special=False) for t in chat_format.THINK_TOKENS])
    bos = chat_format.BOS
    bos_id = tok.token_to_id(bos)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A",
        pair=f"{bos} $A {bos} $B:1",
        special_tokens=[(bos, bos_id)],
    )
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"vocab is {tok.get_vocab_size()}, wanted {vocab_size}")
    return tok


def tokenizer_config(model_max_length):
    """tokenizer_config.json contents: special tokens, BOS handling and the chat template."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": chat_format.BOS,
        "eos_token": chat_format.EOS,
        "pad_token": chat_format.PAD,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "model_max_length": model_max_length,
        "chat_template": chat_format.CHAT_TEMPLATE,
        # pdserve renders the chat format natively (text/chat_format.h); this names it.
        "pdserve_chat_format": {"name": "deepseek_v4"},
    }


def save(tok, directory, model_max_length):
    tok.save(f"{directory}/tokenizer.json")
    with open(f"{directory}/tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(tokenizer_config(model_max_length), f, ensure_ascii=False, indent=2)
        f.write("\n")
