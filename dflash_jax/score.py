"""`python -m dflash_jax.score`: teacher-forced logits of a token sequence, its mean log-likelihood and perplexity.

Like llama-perplexity on one sequence: the whole sequence is prefilled in fixed chunks and every position's logits
are kept. The log-likelihood averages log p(token[i+1] | token[..i]) over the n-1 predicted tokens.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import KV_DTYPES
from dflash_jax.defaults import resolve_engine, resolve_kernels
from dflash_jax.engine.prefill import DEFAULT_CHUNK, check_tokens, prefill_chunks
from dflash_jax.errors import InputError, run_main
from dflash_jax.load import Target, load_target
from dflash_jax.models.target import init_state
from dflash_jax.tokenizer import load_tokenizer


@dataclasses.dataclass(frozen=True)
class Score:
    """Logits [n, V] float32 of every position and the log-likelihood of tokens 1..n-1."""

    logits: np.ndarray
    mean_log_likelihood: float
    perplexity: float
    tokens: int


def read_ids(spec: str, flag: str = "--ids") -> np.ndarray:
    """Token ids from a .npy file of integers or a non-empty comma-separated list (`flag` names it in errors)."""
    if spec.endswith(".npy"):
        if not os.path.exists(spec):
            raise FileNotFoundError(f"{flag} {spec}: no such file")
        try:
            arr = np.load(spec)
        except ValueError as e:  # not an .npy array (numpy refuses pickles and unknown headers this way)
            raise InputError(f"{flag} {spec}: not a .npy array of token ids ({e})") from None
        if not np.issubdtype(arr.dtype, np.integer):
            raise InputError(f"{flag} {spec}: expected integer token ids, found {arr.dtype}")
        return arr.reshape(-1)
    try:
        ids = np.array([int(t) for t in spec.split(",") if t.strip()], dtype=np.int64)
    except ValueError:
        raise InputError(f"{flag} {spec!r}: expected a .npy file or comma-separated integers") from None
    if not ids.size:
        raise InputError(f"{flag} is empty")
    return ids


def score(model: Target, ids: np.ndarray, *, chunk: int = DEFAULT_CHUNK, kv_dtype: str = "float32") -> Score:
    """Teacher-forced logits of every position of ids (a float32 KV cache by default, the reference precision)."""
    cfg = model.config
    ids = check_tokens(cfg, ids)
    state = init_state(cfg, slots=-(-len(ids) // chunk) * chunk, kv_dtype=jnp.dtype(kv_dtype))
    logits = []
    for _, lg, _, state in prefill_chunks(model.params, cfg, state, ids, chunk=chunk, all_logits=True,
                                          kcfg=model.kcfg):
        logits.append(np.asarray(lg, np.float32))  # to the host chunk by chunk: [n, V] can be large
    logits = np.concatenate(logits)
    if len(ids) < 2:
        return Score(logits, math.nan, math.nan, len(ids))
    logp = jax.nn.log_softmax(jnp.asarray(logits[:-1]), axis=-1)
    mean = float(jnp.mean(jnp.take_along_axis(logp, jnp.asarray(ids[1:, None]), axis=-1)))
    return Score(logits, mean, math.exp(-mean), len(ids))


def main(argv: list[str]) -> int:
    from absl import flags, logging


    logging.set_verbosity(logging.WARNING)  # absl would print JAX's backend probing at INFO
    f = flags.FLAGS
    if len(argv) > 1:
        raise InputError(f"unexpected arguments: {' '.join(argv[1:])}")
    if (f.ids is None) == (f.text is None):
        raise InputError("pass the tokens to score with --ids IDS.npy (or a comma-separated list) or --text")
    ids = read_ids(f.ids) if f.ids is not None else np.asarray(load_tokenizer(f.target).encode(f.text))
    kv_dtype = resolve_engine(kv_dtype=f.kv_dtype).kv_dtype
    t0 = time.perf_counter()
    # a prefill only: the speculative modes' kernel configuration, which holds no second copy of any matrix
    model = load_target(f.target, kcfg=resolve_kernels("ddtree"))
    t1 = time.perf_counter()
    result = score(model, ids, chunk=f.chunk, kv_dtype=kv_dtype)
    t2 = time.perf_counter()
    if f.out:
        np.save(f.out, result.logits)
    print(f"{result.tokens} tokens, {result.tokens - 1} predicted: mean log-likelihood "
          f"{result.mean_log_likelihood:.4f}, perplexity {result.perplexity:.4f} "
          f"(load {t1 - t0:.1f} s, score {t2 - t1:.1f} s, {jax.default_backend()})")
    if f.out:
        print(f"logits [{result.logits.shape[0]}, {result.logits.shape[1]}] float32 written to {f.out}")
    return 0


if __name__ == "__main__":
    from absl import app, flags

    flags.DEFINE_string("target", None, "Target model: a qwen35 GGUF file or an HF safetensors directory.",
                        required=True)
    flags.DEFINE_string("ids", None, "Token ids: a .npy file or a comma-separated list.")
    flags.DEFINE_string("text", None, "Text to score, tokenized as is (special tokens parsed, no chat template).")
    flags.DEFINE_string("out", None, "Write the logits [n, vocab] float32 to this .npy file.")
    flags.DEFINE_integer("chunk", DEFAULT_CHUNK, "Prefill chunk size (tokens per compiled call).")
    flags.DEFINE_enum("kv_dtype", None, list(KV_DTYPES), "KV cache dtype (default: bfloat16 on a GPU, float32 on a "
                      "CPU).")
    app.run(lambda argv: run_main("score", main, argv))
