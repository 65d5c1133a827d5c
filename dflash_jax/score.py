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

from dflash_jax import assets
from dflash_jax.config import (KV_TYPES, SINGLE_DEVICE, KernelConfig, ParallelConfig, TargetConfig,
                               check_prefill_chunk)
from dflash_jax.defaults import host_memory, least_free, resolve_engine, resolve_kernels
from dflash_jax.engine.prefill import DEFAULT_CHUNK, check_tokens, prefill_chunks
from dflash_jax.errors import InputError, brief, run_main
from dflash_jax.load import Target, open_target, target_tokenizer
from dflash_jax.models.target import init_state
from dflash_jax.multihost import define_process_flags, parallel_from_flags
from dflash_jax.parallel import check_split, load_split, split_target, state_device_bytes
from dflash_jax.tokenizer import require_utf8


@dataclasses.dataclass(frozen=True)
class Score:
    """Logits [n, V] float32 of every position and the log-likelihood of tokens 1..n-1."""

    logits: np.ndarray
    mean_log_likelihood: float
    perplexity: float
    tokens: int


MAX_IDS = 1 << 24  # token ids in one sequence: more than any model's context
MAX_ID = 2**31 - 1  # ids are int32 on the device


def _out_of_range(flag: str, position: int, value: int) -> InputError:
    return InputError(f"{flag}: token id {value} at position {position} is out of range (0 to {MAX_ID})")


def _load_npy_ids(spec: str, flag: str) -> np.ndarray:
    """The ids of a .npy file, memory-mapped so that a header declaring a huge array allocates nothing."""
    if not os.path.exists(spec):
        raise FileNotFoundError(f"{flag} {spec}: no such file")
    try:
        arr = np.load(spec, mmap_mode="r")
    except (ValueError, EOFError) as e:  # not an .npy array (numpy refuses pickles, cut files and bad headers so)
        raise InputError(f"{flag} {spec}: not a .npy array of token ids ({e})") from None
    if not np.issubdtype(arr.dtype, np.integer):
        raise InputError(f"{flag} {spec}: expected integer token ids, found {arr.dtype}")
    if arr.size > MAX_IDS:
        raise InputError(f"{flag} {spec}: {arr.size} token ids, more than any context ({MAX_IDS})")
    arr = np.array(arr).reshape(-1)
    bad = np.flatnonzero((arr < 0) | (arr > MAX_ID))
    if bad.size:
        raise _out_of_range(flag, int(bad[0]), int(arr[bad[0]]))
    return arr.astype(np.int64)


def _parse_ids(spec: str, flag: str) -> np.ndarray:
    """The ids of a comma-separated list (Python integers first: 2^64 must not overflow on the way)."""
    try:
        values = [int(t) for t in spec.split(",") if t.strip()]
    except ValueError:
        raise InputError(f"{flag} {brief(spec)}: expected a .npy file or comma-separated integers") from None
    if len(values) > MAX_IDS:
        raise InputError(f"{flag}: {len(values)} token ids, more than any context ({MAX_IDS})")
    bad = next((i for i, v in enumerate(values) if not 0 <= v <= MAX_ID), None)
    if bad is not None:
        raise _out_of_range(flag, bad, values[bad])
    return np.array(values, dtype=np.int64)


def read_ids(spec: str, flag: str = "--ids") -> np.ndarray:
    """Token ids (int64) from a .npy file of integers or a non-empty comma-separated list, each in 0..2^31-1
    (`flag` names it in errors; the model's vocabulary is checked later)."""
    ids = _load_npy_ids(spec, flag) if spec.endswith(".npy") else _parse_ids(spec, flag)
    if not ids.size:
        raise InputError(f"{flag} is empty")
    return ids


def score(model: Target, ids: np.ndarray, *, chunk: int = DEFAULT_CHUNK, kv_type: str = "f32",
          v_type: str | None = None, slots: int | None = None, kcfg: KernelConfig | None = None,
          parallel: ParallelConfig = SINGLE_DEVICE) -> Score:
    """Teacher-forced logits of every position of ids (a float32 KV cache by default, the reference precision; the
    values in `v_type` if given), in a cache of `slots` (default: the sequence rounded up to the chunk; one size for
    sequences of several lengths compiles the chunk once). With `parallel` over several devices the target (loaded
    into its shards by `parallel.load_split`, or whole in the reference layout: `ShardedTarget.over`) is split over
    them, each shard laid out for `kcfg` (default: the model's)."""
    cfg = model.config
    kcfg = model.kcfg if kcfg is None else kcfg
    ids = check_tokens(cfg, ids)
    split = split_target(model, kcfg, parallel)
    state = split.init_state(cfg, slots=slots or -(-len(ids) // chunk) * chunk, kv_type=kv_type, v_type=v_type)
    logits = []
    for _, lg, _, state in prefill_chunks(split, cfg, state, ids, chunk=chunk, all_logits=True, kcfg=kcfg):
        logits.append(np.asarray(lg, np.float32))  # to the host chunk by chunk: [n, V] can be large
    logits = np.concatenate(logits)
    if len(ids) < 2:
        return Score(logits, math.nan, math.nan, len(ids))
    logp = jax.nn.log_softmax(jnp.asarray(logits[:-1]), axis=-1)
    mean = float(jnp.mean(jnp.take_along_axis(logp, jnp.asarray(ids[1:, None]), axis=-1)))
    return Score(logits, mean, math.exp(-mean), len(ids))


def out_path(out: str | None) -> str | None:
    """The file --out names (np.save adds `.npy` to a name without it), checked before any work: its folder exists
    and it is not itself a folder."""
    if out is None:
        return None
    path = out if out.endswith(".npy") else out + ".npy"
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        raise InputError(f"--out {out}: the folder {folder} does not exist")
    if os.path.isdir(path):
        raise InputError(f"--out {out}: {path} is a directory")
    return path


def check_fits(cfg: TargetConfig, n: int, chunk: int, kv_types: tuple[str, str], devices: int = 1) -> None:
    """Refuse, before loading the weights, a sequence or chunk longer than the model's context, and logits or caches
    that would not fit the free memory (of each of `devices` local devices, which hold a share of the caches)."""
    context = cfg.max_position_embeddings
    if n > context:
        raise InputError(f"{n} tokens exceed the model's context of {context} tokens")
    check_prefill_chunk(chunk)
    if chunk > context:
        raise InputError(f"--prefill_chunk {chunk} exceeds the model's context of {context} tokens")
    logits, host = n * cfg.vocab_size * 4, host_memory()
    if host is not None and logits > host:
        raise InputError(f"the logits of {n} tokens need {logits / 2**30:.2f} GiB, but the host has "
                         f"{host / 2**30:.2f} GiB free")
    slots = -(-n // chunk) * chunk
    shapes = jax.eval_shape(lambda: init_state(cfg, slots, *kv_types))
    cache, (free, device) = state_device_bytes(shapes, devices), least_free(jax.local_devices()[:devices])
    if free is not None and cache > free:
        where = "the device has" if devices == 1 else f"device {device.id}, one of the {devices} they split over, has"
        each = "" if devices == 1 else " on each device"
        raise InputError(f"the caches of {slots} tokens need {cache / 2**30:.2f} GiB{each}, but {where} "
                         f"{free / 2**30:.2f} GiB free")


def run(argv: list[str]) -> int:
    """The command; returns its exit code."""
    from absl import flags, logging

    logging.set_verbosity(logging.WARNING)  # absl would print JAX's backend probing at INFO
    f = flags.FLAGS
    if len(argv) > 1:
        raise InputError(f"unexpected arguments: {' '.join(argv[1:])}")
    if f.ids is not None and f.text is not None:
        raise InputError("pass either --ids or --text, not both")
    if f.ids is None and f.text is None:
        raise InputError("pass the tokens to score with --ids IDS.npy (or a comma-separated list) or --text")
    out = out_path(f.out)
    ids = read_ids(f.ids) if f.ids is not None else None
    text = require_utf8(f.text, "--text") if f.text is not None else None
    pcfg = parallel_from_flags(f, "score")  # first: joining other processes precedes any other use of JAX
    kv_types = resolve_engine(kv_type=f.kv_type, kv_type_k=f.kv_type_k, kv_type_v=f.kv_type_v).kv_types
    # a prefill only: the speculative modes' kernel configuration, which holds no second copy of any matrix
    kcfg = resolve_kernels("ddtree")
    t0 = time.perf_counter()
    target = open_target(f.target or assets.DEFAULT_TARGET)
    check_split(target.config, {}, pcfg.devices)
    if ids is None:
        ids = np.asarray(target_tokenizer(target).encode(text))
    check_tokens(target.config, ids)
    check_fits(target.config, len(ids), f.prefill_chunk, kv_types, pcfg.devices)
    model = load_split(target, kcfg, pcfg)
    t1 = time.perf_counter()
    result = score(model, ids, chunk=f.prefill_chunk, kv_type=kv_types[0], v_type=kv_types[1], kcfg=kcfg,
                   parallel=pcfg)
    t2 = time.perf_counter()
    if out:
        np.save(out, result.logits)
    print(f"{result.tokens} tokens, {result.tokens - 1} predicted: mean log-likelihood "
          f"{result.mean_log_likelihood:.4f}, perplexity {result.perplexity:.4f} "
          f"(load {t1 - t0:.1f} s, score {t2 - t1:.1f} s, {jax.default_backend()})")
    if out:
        print(f"logits [{result.logits.shape[0]}, {result.logits.shape[1]}] float32 written to {out}")
    return 0


def main(argv: list[str]) -> None:
    run_main("score", run, argv)


if __name__ == "__main__":
    from absl import app, flags

    from dflash_jax.generate import parse_flags

    flags.DEFINE_string("target", None, "Target model: a qwen35 GGUF file or an HF safetensors directory (default: "
                        "the tiny model shipped in the package).")
    flags.DEFINE_string("ids", None, "Token ids: a .npy file or a comma-separated list.")
    flags.DEFINE_string("text", None, "Text to score, tokenized as is (special tokens parsed, no chat template).")
    flags.DEFINE_string("out", None, "Write the logits [n, vocab] float32 to this .npy file (.npy is added to a name "
                        "without it).")
    flags.DEFINE_integer("prefill_chunk", DEFAULT_CHUNK, "Prefill chunk size (tokens per compiled call), a multiple "
                         f"of {DEFAULT_CHUNK}.", lower_bound=1)
    flags.DEFINE_enum("kv_type", None, list(KV_TYPES), "KV cache type, as generate's --kv_type (default: bf16 on a "
                      "GPU, f32 on a CPU).")
    flags.DEFINE_enum("kv_type_k", None, list(KV_TYPES), "The keys' KV cache type (default: --kv_type).")
    flags.DEFINE_enum("kv_type_v", None, list(KV_TYPES), "The values' KV cache type (default: --kv_type).")
    flags.DEFINE_string("devices", "1", "Local devices (GPUs) to split the target over, tensor-parallel (a count, or "
                        "'all').")
    define_process_flags()
    app.run(main, flags_parser=lambda argv: parse_flags(argv, "score"))
