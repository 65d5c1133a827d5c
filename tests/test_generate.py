"""`python -m dflash_jax.generate` as users run it: greedy-exact speculative output, the shipped default pair,
streaming text, and one-line errors with exit code 2 for bad input."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, TINY
from dflash_jax import assets
from dflash_jax.allocator import ENV
from dflash_jax.testing.gguf_writer import rewrite_gguf


def generate(*args, jit_cache="", stdin=None):
    env = {**{k: v for k, v in os.environ.items() if k != ENV}, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "dflash_jax.generate", f"--jit_cache={jit_cache}", *args],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300, input=stdin)


def test_every_mode_returns_the_greedy_ids(tiny_gguf_path, jit_cache):
    """ar and ddtree (--json) on the fixture pair give the same ids: HF transformers' greedy continuation (chain
    mode is checked in-process by test_engine, which keeps this subprocess test short); ddtree prefills its prompt in
    one chunk of 128 tokens and compiles its step ahead, during the prefill (the default); ar takes the default
    allocator on one device, cuda_async, and ddtree --allocator bfc (on a CPU only the choice is recorded)."""
    want = np.load(TINY / "ref.npz")["hf_q_greedy"][:20].tolist()
    runs = {}
    for mode, chunk, more in (("ar", "64", ["--nocompile_ahead"]), ("ddtree", "128", ["--allocator", "bfc"])):
        proc = generate("--target", str(tiny_gguf_path), "--draft", str(TINY / "draft-full"), "--prompt_ids",
                        str(TINY / "tokens.npy"), "--n_gen", "20", "--mode", mode, "--prefill_chunk", chunk, "--json",
                        *more, jit_cache=jit_cache)
        assert proc.returncode == 0, proc.stderr
        runs[mode] = json.loads(proc.stdout)
    for mode, out in runs.items():
        assert out["tokens"] == want, mode
        assert sum(out["accept_lengths"]) == 19 and out["steps"] == len(out["accept_lengths"])  # first from prefill
    assert runs["ddtree"]["prompt_ids"] == np.load(TINY / "tokens.npy").tolist()
    assert runs["ar"]["prefill_chunk"] == 64 and runs["ddtree"]["prefill_chunk"] == 128
    assert not runs["ar"]["compile_ahead"] and runs["ddtree"]["compile_ahead"]
    assert runs["ar"]["allocator"] == "cuda_async" and runs["ddtree"]["allocator"] == "bfc"


def test_a_quantized_kv_cache_from_the_command_line(tiny_gguf_path, jit_cache):
    """--kv_type q8_0 (chain mode, which the test above leaves to test_engine) decodes the reference's greedy ids;
    --json and --stats name the type."""
    want = np.load(TINY / "ref.npz")["hf_q_greedy"][:12].tolist()
    proc = generate("--target", str(tiny_gguf_path), "--draft", str(TINY / "draft-full"), "--prompt_ids",
                    str(TINY / "tokens.npy"), "--n_gen", "12", "--mode", "chain", "--kv_type", "q8_0", "--json",
                    "--stats", jit_cache=jit_cache)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["tokens"] == want and out["kv_type"] == "q8_0" and "; q8_0 KV cache;" in proc.stderr


def test_the_quick_start_sampled_prints_the_same_text_in_every_mode(jit_cache):
    """The README's first command with --temperature 0.7 --seed 1: one text in every mode; --json reports the seed,
    which a run without --seed draws and reports."""
    texts = {}
    for mode in ("ar", "chain", "ddtree"):
        proc = generate("--prompt", "def fibonacci(n):", "--n_gen", "32", "--temperature", "0.7", "--seed", "1",
                        "--mode", mode, jit_cache=jit_cache)
        assert proc.returncode == 0, proc.stderr
        texts[mode] = proc.stdout
    assert texts["ar"].strip() and texts["chain"] == texts["ar"] == texts["ddtree"], texts
    proc = generate("--prompt", "def fibonacci(n):", "--n_gen", "32", "--temperature", "0.7", "--json",
                    jit_cache=jit_cache)
    drawn = json.loads(proc.stdout)["sampling"]
    assert drawn["temperature"] == 0.7 and 0 <= drawn["seed"] < 2 ** 32
    again = generate("--prompt", "def fibonacci(n):", "--n_gen", "32", "--temperature", "0.7", "--json", "--seed",
                     str(drawn["seed"]), jit_cache=jit_cache)
    assert json.loads(again.stdout)["tokens"] == json.loads(proc.stdout)["tokens"]


def test_default_pair_streams_text_and_stats(jit_cache):
    """The README's first command: no --target, the pair shipped in the package; the text streams to stdout."""
    assert os.path.exists(assets.DEFAULT_TARGET) and os.path.isdir(assets.DEFAULT_DRAFT)
    proc = generate("--prompt", "def fibonacci(n):", "--n_gen", "12", "--stats", jit_cache=jit_cache)
    assert proc.returncode == 0, proc.stderr
    # on a CPU the default budget is CPU_BUDGET, within the draft's depth: no chain seed
    assert proc.stdout.strip() and "acceptance length" in proc.stderr
    assert "[ddtree: budget 8, top-K 8, no chain seed]" in proc.stderr
    raw = generate("--prompt", "def fibonacci(n):", "--n_gen", "12", "--json", jit_cache=jit_cache)
    out = json.loads(raw.stdout)
    assert (out["budget"], out["topk"], out["chain_seed"]) == (8, 8, False)
    # the configuration it ran, as dflash_jax/defaults.py resolves it for a CPU
    assert (out["device_class"], out["kv_type"]) == ("cpu", "f32")
    assert out["kernels"] == {"impl": "reference", "interpret": False, "mgpu": "off", "mgpu_attention": False,
                              "small_rows": 64, "numerics": "exact"}
    assert "reference kernels (jnp and XLA); f32 KV cache" in proc.stderr
    from dflash_jax.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(assets.DEFAULT_TARGET)
    assert out["text"] == tok.decode([t for t in out["tokens"] if t not in tok.stop_ids])
    assert proc.stdout.rstrip("\n") == out["text"]  # streamed pieces add up to the whole text
    assert tok.decode(out["prompt_ids"]).startswith("<|im_start|>user\ndef fibonacci(n):<|im_end|>\n")


def test_stdin_raw_prompt(tiny_gguf_path, jit_cache):
    proc = generate("--target", str(tiny_gguf_path), "--raw", "--n_gen", "4", "--mode", "ar", "--json",
                    stdin="x = 1\n", jit_cache=jit_cache)
    assert proc.returncode == 0, proc.stderr
    from dflash_jax.tokenizer import Tokenizer
    assert json.loads(proc.stdout)["prompt_ids"] == Tokenizer.from_gguf(tiny_gguf_path).encode("x = 1\n")


def _other_arch(tiny_gguf_path, tmp_path):
    path = tmp_path / "llama.gguf"
    rewrite_gguf(tiny_gguf_path, path, arch="llama")
    return str(path)


@pytest.mark.parametrize("args, message", [
    (lambda g, t: ["--target", str(t / "missing.gguf"), "--mode", "ar", "--prompt", "hi"], "no such file"),
    (lambda g, t: ["--target", _other_arch(g, t), "--mode", "ar", "--prompt", "hi"],
     "architecture 'llama' is not supported"),
    (lambda g, t: ["--target", str(g), "--draft", assets.DEFAULT_DRAFT, "--prompt", "hi"], "vocab 8192 != the target's"),
    (lambda g, t: ["--target", str(g), "--prompt_ids", "1,2,3,4", "--max_ctx", "8", "--n_gen", "8"],
     "prompt of 4 tokens \\+ --n_gen 8 exceeds --max_ctx 8"),
    (lambda g, t: ["--target", str(g), "--mode", "ar", "--prompt_ids", "1,5000"], "token id 5000 at position 1"),
    (lambda g, t: ["--prompt_ids", "1,x"], "expected a .npy file or comma-separated integers"),
    (lambda g, t: ["--budget", "0", "--prompt", "hi"], "flag --budget=0"),
    (lambda g, t: ["--mode", "beam", "--prompt", "hi"], "flag --mode=beam"),
    (lambda g, t: ["--draft", str(t), "--prompt", "hi"], "--draft without --target"),
    (lambda g, t: ["--target", str(g), "--prompt", "hi"], "--mode ddtree needs a drafter"),
    (lambda g, t: ["--prompt", "   "], "empty prompt"),
    (lambda g, t: ["--profile", "", "--prompt", "hi"], "--profile needs a directory"),
    (lambda g, t: ["--profile", str(g), "--prompt", "hi"], "exists and is not a directory"),
    (lambda g, t: ["--target", str(g), "--mode", "ar", "--mgpu", "--prompt", "hi"], r"\(--mgpu\) needs a Hopper GPU"),
    (lambda g, t: ["--kv_type", "fp8", "--prompt", "hi"], "flag --kv_type=fp8"),
    (lambda g, t: ["--allocator", "vmm", "--prompt", "hi"], "flag --allocator=vmm"),
])
def test_bad_input_is_one_line_and_exit_code_2(tiny_gguf_path, tmp_path, args, message):
    import re

    proc = generate(*args(tiny_gguf_path, tmp_path))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and re.search(message, lines[0]), proc.stderr
    assert lines[0].startswith("generate: ")


def test_the_shipped_pair_fits_its_limits():
    """The trained pair of scripts/train_tiny_pair.py: each file under 16 MiB, 30 MB at most together, a drafter made
    for this target (its mask token, tap layers and head)."""
    from dflash_jax.load import load_draft, load_target
    from dflash_jax.tokenizer import Tokenizer

    files = [p for p in (ROOT / "dflash_jax" / "assets" / "default").rglob("*") if p.is_file()]
    sizes = {p.name: p.stat().st_size for p in files}
    assert set(sizes) == {"target.gguf", "config.json", "model.safetensors"}
    assert max(sizes.values()) < 16 << 20 and sum(sizes.values()) <= 30e6, sizes
    target = load_target(assets.DEFAULT_TARGET, progress=False)
    draft = load_draft(assets.DEFAULT_DRAFT, target.config, progress=False)
    assert target.config.tie_word_embeddings and draft.config.block_size == 16
    assert draft.config.mask_token_id == Tokenizer.from_gguf(assets.DEFAULT_TARGET).special["<|mask|>"]
