"""A byte-level BPE trained with `tokenizers` behind Qwen3.5's split regex, with Qwen's special tokens and a mask
token, written as GGUF tokenizer metadata that `Tokenizer.from_gguf` (and llama.cpp) read back."""

from __future__ import annotations

import json
from typing import Iterable

from gguf import GGUFValueType as VT

from dflash_jax.chat_template import CHATML
from dflash_jax.tokenizer import PRE_TOKENIZERS, Tokenizer, TokenizerError

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|mask|>")  # the last ids


def train_bpe(texts: Iterable[str], vocab_size: int, special: tuple[str, ...] = SPECIAL
              ) -> tuple[list[str], list[str]]:
    """(tokens in id order, merges "a b") of a BPE of vocab_size tokens, the special tokens last."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENIZERS["qwen35"]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(special), min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    if len(tokens) != vocab_size - len(special):
        raise ValueError(f"the corpus gave {len(tokens)} tokens, expected {vocab_size - len(special)}: too little "
                         "text for this vocabulary")
    merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    return tokens + list(special), merges


def gguf_metadata(tokens: list[str], merges: list[str], chat_template: str = CHATML,
                  special: tuple[str, ...] = SPECIAL) -> list[tuple]:
    """The tokenizer.* metadata fields (key, value, type, array element type) of a GGUF for this BPE."""
    ids = {t: i for i, t in enumerate(tokens)}
    return [
        ("tokenizer.ggml.model", "gpt2", VT.STRING, None),
        ("tokenizer.ggml.pre", "qwen35", VT.STRING, None),
        ("tokenizer.ggml.tokens", tokens, VT.ARRAY, VT.STRING),
        ("tokenizer.ggml.token_type", [3 if t in special else 1 for t in tokens], VT.ARRAY, VT.INT32),
        ("tokenizer.ggml.merges", merges, VT.ARRAY, VT.STRING),
        ("tokenizer.ggml.eos_token_id", ids["<|im_end|>"], VT.UINT32, None),
        ("tokenizer.ggml.padding_token_id", ids["<|endoftext|>"], VT.UINT32, None),
        ("tokenizer.ggml.bos_token_id", ids["<|endoftext|>"], VT.UINT32, None),
        ("tokenizer.ggml.add_bos_token", False, VT.BOOL, None),
        ("tokenizer.chat_template", chat_template, VT.STRING, None),
    ]


def bpe_tokenizer(tokens: list[str], merges: list[str], chat_template: str = CHATML):
    """The `Tokenizer` a GGUF with this BPE's metadata gives, without writing the file."""
    fields = {key: value for key, value, _, _ in gguf_metadata(tokens, merges, chat_template)}

    def value(key, default=...):
        if key not in fields and default is ...:
            raise TokenizerError(f"missing {key}")
        return fields.get(key, default)

    return Tokenizer.from_metadata(value, "the trained BPE")
