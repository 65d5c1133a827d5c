"""The GGUF tokenizer against llama.cpp's tokenization of the fixture, UTF-8-safe streaming, the HF route, errors."""

import json

import pytest
from gguf import GGUFValueType as VT

from conftest import TINY
from dflash_jax.testing.gguf_writer import rewrite_gguf
from dflash_jax.tokenizer import Tokenizer, TokenizerError, load_tokenizer

CASES = json.loads((TINY / "tokenizer_ref.json").read_text())


@pytest.fixture(scope="module")
def tok(tiny_gguf_path):
    return Tokenizer.from_gguf(tiny_gguf_path)


@pytest.mark.parametrize("case", CASES, ids=[c["text"][:20] for c in CASES])
def test_reproduces_llama_cpp_ids_and_decodes_back(tok, case):
    """Contractions in any case, digit runs, CRLF, whitespace runs, combining marks, emoji, special tokens."""
    assert tok.encode(case["text"]) == case["ids"]
    assert tok.decode(case["ids"]) == case["text"]


def test_stop_ids_and_special_tokens(tok):
    assert tok.stop_ids == (1020, 1018)  # eos = <|im_end|>, then <|endoftext|>
    assert tok.encode("a<|im_end|>b") == [64, 1020, 65]
    assert tok.decode([64, 1020, 65, 1018], skip_stops=True) == "ab"
    assert tok.stream(skip_stops=True).push([64, 1020, 65]) == "ab" and tok.stream().push([1020]) == "<|im_end|>"
    assert tok.eos_token == "<|im_end|>" and tok.bos_token == "<|endoftext|>"


def test_stream_never_splits_a_character(tok):
    text = "Ünïcödé 日本語 🙂 café"
    ids = tok.encode(text)
    assert len(ids) > len(text)  # multi-byte characters span several byte tokens
    stream, pieces = tok.stream(), []
    for i in ids:
        pieces.append(stream.push([i]))
    pieces.append(stream.flush())
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)


def test_stream_flush_marks_an_unfinished_character(tok):
    stream = tok.stream()
    assert stream.push(tok.encode("é")[:1]) == ""  # the lead byte alone is held back
    assert stream.flush() == "\ufffd"


def test_hf_directory_uses_transformers_and_agrees(tok, tmp_path):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tok.backend, eos_token="<|im_end|>", bos_token="<|endoftext|>")
    hf.chat_template = "{{ messages[0]['content'] }}"
    hf.save_pretrained(tmp_path)
    got = load_tokenizer(tmp_path)
    for case in CASES:
        assert got.encode(case["text"]) == case["ids"]
        assert got.decode(case["ids"]) == case["text"]
    assert got.stop_ids == tok.stop_ids and got.chat_template == hf.chat_template


@pytest.mark.parametrize("keys, message", [
    ([("tokenizer.ggml.model", "llama", VT.STRING, None)], "tokenizer.ggml.model 'llama' is not supported"),
    ([("tokenizer.ggml.pre", "falcon", VT.STRING, None)], "tokenizer.ggml.pre 'falcon' is not supported"),
])
def test_unsupported_tokenizers_are_refused(tiny_gguf_path, tmp_path, keys, message):
    path = tmp_path / "edited.gguf"
    rewrite_gguf(tiny_gguf_path, path, set_keys=keys)
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_gguf(path)


def test_gguf_without_tokenizer(tiny_gguf_path, tmp_path):
    path = tmp_path / "bare.gguf"
    rewrite_gguf(tiny_gguf_path, path, drop_keys=["tokenizer.ggml.model"])
    with pytest.raises(TokenizerError, match="no tokenizer in the GGUF metadata"):
        Tokenizer.from_gguf(path)


def test_a_trained_bpe_reads_back_as_the_gguf_written_with_it(tmp_path):
    """training.bpe (which trained the shipped default target's tokenizer): a BPE trained on some Python, written into
    a GGUF's metadata, reads back as a tokenizer that encodes alike, special tokens last and parsed whole."""
    from conftest import ROOT
    from dflash_jax import assets
    from dflash_jax.testing.gguf_writer import write_gguf
    from dflash_jax.testing.tiny import random_gguf_tensors, tiny_target_config
    from dflash_jax.training.bpe import SPECIAL, bpe_tokenizer, gguf_metadata, train_bpe

    vocab = 512
    texts = [p.read_text() for p in sorted((ROOT / "dflash_jax" / "engine").glob("*.py"))]
    tokens, merges = train_bpe(texts, vocab)
    cfg = tiny_target_config(num_layers=2, vocab_size=vocab)
    write_gguf(tmp_path / "t.gguf", random_gguf_tensors(cfg, 0), cfg, metadata=gguf_metadata(tokens, merges))
    trained, written = bpe_tokenizer(tokens, merges), Tokenizer.from_gguf(tmp_path / "t.gguf")
    assert tokens[-len(SPECIAL):] == list(SPECIAL) and trained.vocab_size == written.vocab_size == vocab
    text = 'def f(x):\n    return x + 1  # héllo, 世界 <|im_end|>\n<|mask|>'
    assert trained.encode(text) == written.encode(text) and trained.decode(trained.encode(text)) == text
    assert trained.stop_ids == written.stop_ids and trained.special["<|mask|>"] == vocab - 1
    shipped = Tokenizer.from_gguf(assets.DEFAULT_TARGET)  # made the same way, with 8192 tokens
    assert shipped.vocab_size == 8192 and shipped.special["<|mask|>"] == 8191
    assert list(shipped.stop_ids) == [i + 8192 - vocab for i in written.stop_ids]  # the same special tokens, last
    with pytest.raises(ValueError, match="too little text"):
        train_bpe(["a b"], 4096)
