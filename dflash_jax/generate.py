"""`python -m dflash_jax.generate`: generation from a prompt (greedy, or sampled with `--temperature`), streamed as
tokens commit.

    python -m dflash_jax.generate --prompt "def fib(n):"                  # the tiny model pair shipped in the package
    python -m dflash_jax.generate --target Qwen3.5-27B-Q4_K_M.gguf --draft Qwen3.5-27B-DFlash --prompt "..." --stats

The prompt goes through the model's chat template (the GGUF's, else ChatML) unless `--raw`; `--prompt_ids` skips
tokenization. Generation stops at the end-of-sequence token, `<|im_end|>` or `<|endoftext|>`, or after `--n_gen`
tokens. `--profile DIR` writes a jax.profiler trace of `--profile_steps` decode steps (after the first, which
compiles) into DIR; `--compile_report` prints the compile seconds of each jitted function to stderr. Bad input
(missing or corrupt files, a model of another architecture, a drafter that does not fit, a prompt too long for
`--max_ctx` or the model's context, caches larger than the free memory, invalid flag values) ends with a one-line
error on stderr and exit code 2, before any weight loads where it can (docs/errors.md); any other error is a bug,
reported with its traceback and exit code 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from typing import Sequence

from dflash_jax import assets
from dflash_jax.allocator import current_allocator
from dflash_jax.config import (COMPILE_AHEAD, DRAFT_CTX, DRAFT_RULES, KV_TYPES, NUMERICS, PREFILL_BLOCK, SINGLE_DEVICE,
                               EngineConfig, KernelConfig, ParallelConfig)
from dflash_jax.defaults import DEVICE_DEFAULTS, device_class, least_free, resolve_engine, resolve_kernels
from dflash_jax.engine.generate import Engine
from dflash_jax.engine.prefill import check_tokens
from dflash_jax.engine.sampling import SamplingParams, seed_or_drawn
from dflash_jax.errors import USAGE_ERROR, InputError, run_main
from dflash_jax.load import TargetFile, check_path, draft_config, load_draft, open_target, target_tokenizer
from dflash_jax.multihost import define_process_flags, own_stdout, parallel_from_flags
from dflash_jax.parallel import check_split, load_split
from dflash_jax.profiling import CompileLog, StepTrace
from dflash_jax.score import read_ids
from dflash_jax.tokenizer import Tokenizer, require_utf8

CTX_ROUND = 256  # --max_ctx 0 fits prompt + n_gen, rounded up to this (fewer distinct cache shapes to compile)


class UsageError(InputError):
    """Bad flags or input: reported as one line on stderr with exit code 2."""


@dataclasses.dataclass(frozen=True)
class Models:
    """A loaded target (its KernelConfig with it), its tokenizer and (for chain/ddtree) its drafter."""

    target: object  # dflash_jax.models.target.Target, or on several devices a dflash_jax.parallel.ShardedTarget
    draft: object | None  # dflash_jax.models.draft.Draft
    tokenizer: Tokenizer
    load_s: float


def resolve_paths(target: str | None, draft: str | None) -> tuple[str, str | None]:
    """The target and drafter to load: the shipped tiny pair when no target is given."""
    if target is None:
        if draft is not None:
            raise UsageError("--draft without --target: give the target the drafter belongs to")
        return assets.DEFAULT_TARGET, assets.DEFAULT_DRAFT
    return target, draft


@dataclasses.dataclass(frozen=True)
class Opened:
    """A target's header (or config.json), its tokenizer and the drafter to load (None in ar mode), all checked
    before any weight is read."""

    target: TargetFile
    tokenizer: Tokenizer
    draft_path: str | None
    open_s: float


def open_models(target_path: str, draft_path: str | None, mode: str) -> Opened:
    """Open the target's header, its tokenizer and (unless mode is ar) the drafter's config, each checked against
    the others, reading no weight: bad files are refused before the slow part."""
    for path in (target_path, draft_path):
        if path is not None:
            check_path(path)
    if mode != "ar" and draft_path is None:
        raise UsageError(f"--mode {mode} needs a drafter: pass --draft DIR (or use --mode ar)")
    t0 = time.perf_counter()
    target = open_target(target_path)
    tokenizer = target_tokenizer(target)
    if tokenizer.vocab_size > target.config.vocab_size:
        raise UsageError(f"{target_path}: the tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary "
                         f"only {target.config.vocab_size}")
    if mode != "ar":
        draft_config(draft_path, target.config)
    return Opened(target, tokenizer, draft_path if mode != "ar" else None, time.perf_counter() - t0)


def load_weights(opened: Opened, kcfg: KernelConfig, progress: bool = True,
                 parallel: ParallelConfig = SINGLE_DEVICE) -> Models:
    """Load the weights of opened models, laid out for `kcfg` (a target for several devices straight into its
    shards: `parallel.load_split`)."""
    t0 = time.perf_counter()
    check_split(opened.target.config, {}, parallel.devices)  # the heads, before any weight is read
    target = load_split(opened.target, kcfg, parallel, progress)
    draft = None
    if opened.draft_path is not None:
        draft = load_draft(opened.draft_path, target.config, progress=progress, kcfg=kcfg)
    return Models(target, draft, opened.tokenizer, opened.open_s + time.perf_counter() - t0)


def load_models(target_path: str, draft_path: str | None, mode: str, kcfg: KernelConfig,
                progress: bool = True, parallel: ParallelConfig = SINGLE_DEVICE) -> Models:
    """Load target, tokenizer and (unless mode is ar) drafter, checked against each other, laid out for `kcfg` (the
    target for `parallel`'s devices: `load_weights`)."""
    return load_weights(open_models(target_path, draft_path, mode), kcfg, progress, parallel)


def prompt_tokens(tokenizer: Tokenizer, text: str, *, system: str | None = None, raw: bool = False,
                  thinking: bool = False) -> list[int]:
    """Token ids of a user prompt: through the chat template (system message first), or as is with raw."""
    if raw:
        return tokenizer.encode(text)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return tokenizer.encode(tokenizer.render_chat(messages, enable_thinking=thinking))


def fit_max_ctx(requested: int, prompt_len: int, n_gen: int, context: int | None = None) -> int:
    """The context to allocate: the requested one, or (0) prompt + n_gen rounded up to CTX_ROUND; with the model's
    `context` (its max_position_embeddings), never past it."""
    if context is not None and prompt_len + n_gen > context:
        raise UsageError(f"prompt of {prompt_len} tokens + --n_gen {n_gen} exceeds the model's context of {context} "
                         f"tokens (shorten the prompt or lower --n_gen)")
    if requested:
        if context is not None and requested > context:
            raise UsageError(f"--max_ctx {requested} exceeds the model's context of {context} tokens")
        if prompt_len + n_gen > requested:
            raise UsageError(f"prompt of {prompt_len} tokens + --n_gen {n_gen} exceeds --max_ctx {requested}")
        return requested
    rounded = -(-(prompt_len + n_gen) // CTX_ROUND) * CTX_ROUND
    return rounded if context is None else min(rounded, context)


def check_memory(engine: Engine) -> None:
    """Refuse a context whose caches would not fit the free memory of each device they go on (its share of a sharded
    target's), before they are allocated."""
    need, (free, device) = engine.state_bytes(per_device=True), least_free(engine.devices)
    if free is not None and need > free:
        n = len(engine.devices)
        where = "the device has" if n == 1 else f"device {device.id}, one of the {n} it is split over, has"
        each = "" if n == 1 else " on each device"
        raise UsageError(f"a context of {engine.ecfg.max_ctx} tokens needs {need / 2**30:.2f} GiB of caches{each}, "
                         f"but {where} {free / 2**30:.2f} GiB free (lower --max_ctx or --n_gen)")


def read_prompt(flag: str | None) -> str:
    """The prompt of --prompt, else stdin's bytes, checked to be UTF-8 text (one line naming where it is not)."""
    if flag is not None:
        return require_utf8(flag, "--prompt")
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"stdin is not valid UTF-8 ({e.reason} at byte {e.start})") from None


def default_jit_cache() -> str:
    """Where compiled functions persist between runs: $XDG_CACHE_HOME (or ~/.cache)/dflash_jax/jit."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dflash_jax", "jit")


# seconds: programs that compile faster are not kept (JAX's own default is 1 s). 0 keeps every one: the load's
# per-shape layout programs each compile in under 0.5 s and add up to seconds; a warm start on an H200 built the
# synthetic 27B pair in 5.9 s against 17.3 s at 0.5 s (scripts/results/ttft_jit_cache_min_h200_nov28.txt)
JIT_CACHE_MIN_COMPILE_S = 0.0


def _given(f, name: str) -> bool:
    """Whether the user set flag `name` on the command line (absl flags; an argparse namespace cannot say: False)."""
    try:
        return bool(f[name].present)
    except (TypeError, KeyError, AttributeError):
        return False


def program_folder(f) -> str:
    """Where --program_cache keeps the lowered step and prefill chunk: `programs/` in --jit_cache's folder ("" when
    the flag is off, the command has none, or --jit_cache is off; a --program_cache given with it off is refused)."""
    if not getattr(f, "program_cache", False):
        return ""
    if not f.jit_cache:
        if _given(f, "program_cache"):
            raise UsageError("--program_cache keeps its programs in --jit_cache's folder: give --jit_cache a "
                             "directory")
        return ""
    return os.path.join(f.jit_cache, "programs")


def enable_jit_cache(path: str, min_compile_s: float = JIT_CACHE_MIN_COMPILE_S) -> None:
    """Keep JAX's compiled executables in path, so a second run skips compiling ("" leaves the cache off); only
    programs that took at least min_compile_s to compile are kept."""
    import jax

    if path:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_s)


def check_profile_dir(path: str | None) -> None:
    """--profile must name a directory (made if missing), not a file."""
    if path is None:
        return
    if not path:
        raise UsageError("--profile needs a directory to write the trace into")
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"--profile {path}: exists and is not a directory")


def _backend() -> str:
    import jax

    return f"{jax.default_backend()}, {jax.devices()[0].device_kind}"


def resolve_flags(f, *, max_ctx: int | None = None, impl: str = "auto", small_rows: int | None = None
                  ) -> tuple[EngineConfig, KernelConfig]:
    """The engine and kernel configuration of the decoding flags (`f.mode`, `budget`, `topk`, `chain_seed`,
    `max_ctx`, `kv_type`, `kv_type_k`, `kv_type_v`, `draft_ctx`, `draft_rule`, `prefill_chunk`, `mgpu`,
    `mgpu_attention`, `numerics`),
    None flags taking the device class's defaults (dflash_jax/defaults.py): the one resolution every command and
    benchmark goes through."""
    ecfg = resolve_engine(f.mode, budget=f.budget, topk=f.topk, chain_seed=f.chain_seed,
                          max_ctx=f.max_ctx if max_ctx is None else max_ctx, kv_type=f.kv_type,
                          kv_type_k=f.kv_type_k, kv_type_v=f.kv_type_v, draft_ctx=f.draft_ctx,
                          draft_rule=f.draft_rule, prefill_chunk=f.prefill_chunk, program_cache=program_folder(f),
                          compile_ahead=bool(getattr(f, "compile_ahead", COMPILE_AHEAD)))
    kcfg = resolve_kernels(f.mode, impl=impl, mgpu=f.mgpu, small_rows=small_rows, numerics=f.numerics,
                           mgpu_attention=getattr(f, "mgpu_attention", None))
    return ecfg, kcfg


def sampling_from_flags(f) -> SamplingParams:
    """The sampling flags (`temperature`, `top_p`, `top_k`, `min_p`, `seed`) as SamplingParams; with no --seed a
    sampled run draws one (report it: `SamplingParams.describe`)."""
    return SamplingParams(temperature=f.temperature, top_p=f.top_p, top_k=f.top_k, min_p=f.min_p,
                          seed=seed_or_drawn(f.seed, f.temperature))


def tree_settings(ecfg: EngineConfig, engine) -> dict:
    """A DDTree's budget, top-K and chain seed as the engine uses them (empty for the other modes)."""
    if ecfg.mode != "ddtree":
        return {}
    return dict(budget=ecfg.budget, topk=min(ecfg.topk, ecfg.budget), chain_seed=ecfg.seeds_chain(engine.width - 1))


def describe(ecfg: EngineConfig, engine) -> str:
    """The mode and, for a DDTree, its settings, as --stats prints them."""
    if ecfg.mode != "ddtree":
        return ecfg.mode
    t = tree_settings(ecfg, engine)
    return f"ddtree: budget {t['budget']}, top-K {t['topk']}, {'' if t['chain_seed'] else 'no '}chain seed"


def prompt_input(f) -> tuple[list[int] | None, str | None]:
    """(ids, None) from --prompt_ids or (None, text) from --prompt or stdin, checked before any model is opened."""
    if f.prompt is not None and f.prompt_ids is not None:
        raise UsageError("pass either --prompt or --prompt_ids, not both")
    if f.system is not None:
        require_utf8(f.system, "--system")
    if f.prompt_ids is not None:
        ids = read_ids(f.prompt_ids, flag="--prompt_ids").tolist()
        fit_max_ctx(f.max_ctx, len(ids), f.n_gen)
        return ids, None
    text = read_prompt(f.prompt)
    if not text.strip():
        raise UsageError("empty prompt: pass --prompt TEXT, --prompt_ids, or text on stdin")
    return None, text


def kv_cache_words(ecfg: EngineConfig) -> str:
    """The KV caches' types and the drafter's context bound, as --stats prints them."""
    k, v = ecfg.kv_types
    types = f"{k} KV cache" if k == v else f"{k} K / {v} V cache"
    context = "the whole context" if ecfg.draft_ctx is None else f"the last {ecfg.draft_ctx} tokens"
    return types + ("" if ecfg.mode == "ar" else f"; the drafter sees {context}")


def stats_line(ecfg: EngineConfig, engine: Engine, kcfg: KernelConfig, models: Models, prompt_len: int,
               gen, sampling: SamplingParams) -> str:
    """What --stats prints."""
    return (f"[{describe(ecfg, engine)}] load {models.load_s:.1f} s; prompt {prompt_len} tokens, prefill "
            f"{gen.prefill_s:.2f} s (with compiling); decode {sum(gen.accept_lengths)} tokens in {gen.decode_s:.2f} s "
            f"over {gen.steps} steps, acceptance length {gen.mean_accept_length:.2f}: first step "
            f"{gen.first_step_s:.2f} s (with compiling), then {gen.steady_tokens_per_s:.1f} tok/s; {_backend()} "
            f"({device_class()}): {kcfg.describe()}; {kv_cache_words(ecfg)}; {sampling.describe()}")


def run(argv: Sequence[str]) -> int:
    """The command; returns its exit code."""
    from absl import flags, logging

    logging.set_verbosity(logging.WARNING)  # absl would print JAX's backend probing at INFO
    f = flags.FLAGS
    if len(argv) > 1:
        raise UsageError(f"unexpected arguments: {' '.join(argv[1:])} (the prompt goes in --prompt or stdin)")
    pcfg = parallel_from_flags(f, "generate", several=True)  # first: joining processes precedes all other JAX use
    stdout = own_stdout(pcfg)
    enable_jit_cache(f.jit_cache)
    check_profile_dir(f.profile)
    target_path, draft_path = resolve_paths(f.target, f.draft)
    ecfg, kcfg = resolve_flags(f, max_ctx=f.max_ctx or CTX_ROUND)  # checks the values; max_ctx is fitted below
    sampling = sampling_from_flags(f)
    ids, text = prompt_input(f)
    log = CompileLog() if f.compile_report else None
    with contextlib.nullcontext() if log is None else log:  # compiles of loading and generating
        opened = open_models(target_path, draft_path, f.mode)
        tok, cfg = opened.tokenizer, opened.target.config
        if ids is None:
            ids = prompt_tokens(tok, text, system=f.system, raw=f.raw, thinking=f.thinking)
        check_tokens(cfg, ids)  # every check of the prompt before the weights load
        ecfg = dataclasses.replace(ecfg, max_ctx=fit_max_ctx(f.max_ctx, len(ids), f.n_gen,
                                                             cfg.max_position_embeddings))
        models = load_weights(opened, kcfg, progress=not f.json, parallel=pcfg)
        engine = Engine.from_loaded(models.target, models.draft, ecfg, pcfg, kcfg)
        check_memory(engine)
        decoder = tok.stream(skip_stops=True)

        def stream(new: list[int]) -> None:
            text = decoder.push(new)
            if text:
                stdout.write(text)
                stdout.flush()

        on_tokens = None if f.json or not pcfg.primary else stream  # process 0 prints; the others run alike
        tracer = StepTrace(f.profile, f.profile_steps, inner=on_tokens) if f.profile is not None else None
        try:
            gen = engine.generate(ids, f.n_gen, tok.stop_ids, on_tokens=on_tokens if tracer is None else tracer,
                                  sampling=sampling)
        finally:
            if tracer is not None:
                tracer.close()  # generation ended before the traced steps were done, or raised
    if not pcfg.primary:
        return 0
    if f.json:
        out = dict(prompt_ids=list(map(int, ids)), tokens=gen.tokens, text=tok.decode(gen.tokens, skip_stops=True),
                   mode=f.mode, **tree_settings(ecfg, engine),
                   accept_lengths=gen.accept_lengths, steps=gen.steps, mean_accept_length=gen.mean_accept_length,
                   stopped=gen.stopped, load_s=models.load_s, prefill_s=gen.prefill_s, decode_s=gen.decode_s,
                   first_step_s=gen.first_step_s, decode_tokens_per_s=gen.decode_tokens_per_s,
                   steady_tokens_per_s=gen.steady_tokens_per_s, max_ctx=ecfg.max_ctx, kv_type=ecfg.kv_type,
                   kv_type_k=ecfg.kv_types[0], kv_type_v=ecfg.kv_types[1], draft_ctx=ecfg.draft_ctx,
                   prefill_chunk=ecfg.prefill_chunk, compile_ahead=ecfg.compile_ahead, allocator=current_allocator(),
                   backend=_backend(),
                   device_class=device_class(),
                   devices=pcfg.devices, kernels=dataclasses.asdict(kcfg),
                   sampling=dataclasses.asdict(sampling))
        if tracer is not None:
            out["profile_steps"] = tracer.traced_steps
        if log is not None:
            out["compile"] = log.rows()
        print(json.dumps(out), file=stdout)
    else:
        stdout.write(decoder.flush() + "\n")
    stdout.flush()
    if f.stats:
        print(stats_line(ecfg, engine, kcfg, models, len(ids), gen, sampling), file=sys.stderr)
    if tracer is not None:
        print(f"profile: {tracer.traced_steps} steps traced into {f.profile} (open the .trace.json.gz in "
              "ui.perfetto.dev or the directory in TensorBoard)", file=sys.stderr)
    if log is not None:
        print(log.table(), file=sys.stderr)
    return 0


def engine_from_flags(argv: Sequence[str], command: str):
    """For the commands that serve many prompts (chat, serve): check the flags, load the pair, build the engine with
    a fixed --max_ctx (in one process). Returns (engine, models, target path)."""
    from absl import flags, logging

    logging.set_verbosity(logging.WARNING)  # absl would print JAX's backend probing at INFO
    f = flags.FLAGS
    if len(argv) > 1:
        raise UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    pcfg = parallel_from_flags(f, command)  # first: joining other processes precedes any other use of JAX
    enable_jit_cache(f.jit_cache)
    target_path, draft_path = resolve_paths(f.target, f.draft)
    ecfg, kcfg = resolve_flags(f)
    if f.n_gen >= f.max_ctx:
        raise UsageError(f"--n_gen {f.n_gen} does not fit --max_ctx {f.max_ctx}")
    models = load_models(target_path, draft_path, f.mode, kcfg, parallel=pcfg)
    engine = Engine.from_loaded(models.target, models.draft, ecfg, pcfg, kcfg)
    check_memory(engine)
    return engine, models, target_path


def main(argv: Sequence[str]) -> None:
    run_main("generate", run, argv)


def define_model_flags(n_gen: int, max_ctx_help: str, max_ctx: int = 0,
                       n_gen_help: str = "Tokens to generate at most (per reply).", fv=None) -> None:
    """The model and decoding flags that generate, chat and serve share, in `fv` (default: absl's global FLAGS)."""
    from absl import flags

    fv = flags.FLAGS if fv is None else fv

    flags.DEFINE_string("target", None, "Target: a qwen35 GGUF file or an HF directory (default: the shipped tiny "
                        "model).", flag_values=fv)
    flags.DEFINE_string("draft", None, "DFlash drafter: a directory with config.json and model.safetensors, or the "
                        ".safetensors file (default: the shipped tiny drafter when --target is not given).",
                        flag_values=fv)
    flags.DEFINE_string("system", None, "System message for the chat template.", flag_values=fv)
    flags.DEFINE_integer("n_gen", n_gen, n_gen_help, lower_bound=min(n_gen, 1), flag_values=fv)
    flags.DEFINE_enum("mode", "ddtree", ["ar", "chain", "ddtree"], "Decoding: autoregressive, the draft's block "
                      "as a chain, or a DDTree.", flag_values=fv)
    flags.DEFINE_integer("budget", None, f"DDTree nodes besides the root (default: {DEVICE_DEFAULTS['gpu'].budget} "
                         f"on a GPU, as the C++ engine; {DEVICE_DEFAULTS['cpu'].budget} on a CPU, where verifying a "
                         "node costs a large part of an AR step).", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("topk", 8, "DDTree candidates per depth.", lower_bound=1, flag_values=fv)
    flags.DEFINE_boolean("chain_seed", None, "Seed the DDTree with the draft's top-1 chain before best-first "
                         "expansion, as the C++ engine does (default: when the budget exceeds the draft's depth; "
                         "within it a seeded tree is the chain alone).", flag_values=fv)
    flags.DEFINE_integer("max_ctx", max_ctx, max_ctx_help, lower_bound=0, flag_values=fv)
    flags.DEFINE_boolean("thinking", False, "Let the chat template open a thinking block (Qwen3.5/3.6).",
                         flag_values=fv)
    flags.DEFINE_boolean("stats", False, "Print prefill time, decode tok/s, acceptance length and steps to stderr.",
                         flag_values=fv)
    flags.DEFINE_enum("kv_type", None, list(KV_TYPES), "The target's KV cache: f32, bf16 or f16, or quantized as "
                      "it is written: q8_0 (8.5 bits a value), q4_0 (4.5), rq3_0 (3.5, rotated) or rq4_0 (4.25, "
                      "rotated); docs/kv_cache.md. Default: bf16 on a GPU, f32 on a CPU.", flag_values=fv)
    flags.DEFINE_enum("kv_type_k", None, list(KV_TYPES), "The keys' KV cache type (default: --kv_type), e.g. q8_0 "
                      "keys beside bf16 values.", flag_values=fv)
    flags.DEFINE_enum("kv_type_v", None, list(KV_TYPES), "The values' KV cache type (default: --kv_type).",
                      flag_values=fv)
    flags.DEFINE_integer("draft_ctx", None, "The drafter's full-attention layers see only the last this many "
                         "tokens, kept in a ring (its sliding-window layers keep a ring of their window); 0: the whole "
                         f"context. Default: {DRAFT_CTX}, as the C++ engine. It changes the acceptance, never the "
                         "output (docs/kv_cache.md).", lower_bound=0, flag_values=fv)
    flags.DEFINE_integer("prefill_chunk", None, f"Prompt tokens per compiled prefill call, a multiple of "
                         f"{PREFILL_BLOCK} (one compilation per size; the last chunk is padded). Default: "
                         f"{PREFILL_BLOCK}.", lower_bound=PREFILL_BLOCK, flag_values=fv)
    flags.DEFINE_boolean("mgpu", None, "Hopper GPUs: the target's Q4_K and Q6_K products on the Mosaic GPU "
                         "kernels, their layout replacing the Triton kernels'. Default: on on a Hopper GPU, else off "
                         "(--nomgpu).", flag_values=fv)
    flags.DEFINE_boolean("mgpu_attention", None, "Hopper GPUs: tree attention over bf16 and q8_0 KV caches on the "
                         "Mosaic GPU kernel instead of the Triton one. Default: on on a Hopper GPU, else off "
                         "(--nomgpu_attention).", flag_values=fv)
    flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 is greedy decoding. Every mode emits the same "
                       "tokens for a seed (the coupled Gumbel rule: docs/architecture.md, \"Sampling\").",
                       lower_bound=0.0, flag_values=fv)
    flags.DEFINE_float("top_p", 1.0, "Nucleus sampling: keep the most likely tokens whose probabilities reach this "
                       "sum (1: off).", flag_values=fv)
    flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens (0: off).", lower_bound=0, flag_values=fv)
    flags.DEFINE_float("min_p", 0.0, "Keep the tokens at least this fraction as likely as the most likely (0: off).",
                       flag_values=fv)
    flags.DEFINE_integer("seed", None, "Sampling seed, 0 to 2^32-1 (default: a random one, reported by --stats and "
                         "--json).", flag_values=fv)
    flags.DEFINE_enum("draft_rule", "coupled", list(DRAFT_RULES), "What a sampled step builds its tree from: the "
                      "drafter's logits / temperature plus the target's noise (coupled), logits / temperature, or "
                      "the logits.", flag_values=fv)
    flags.DEFINE_enum("numerics", None, list(NUMERICS), "exact: speculative decoding emits exactly what AR emits "
                      "(the same rounding at every row count; float32 delta-rule products, slower on a GPU); fast: "
                      "one-token int8 GEMVs, TF32 delta-rule products, bf16 softmax weights: NOT exact. Default: exact "
                      "(the drafter always runs fast: it cannot change the output).", flag_values=fv)
    flags.DEFINE_string("devices", "1", "Local devices (GPUs) to split the target over, tensor-parallel (a count, or "
                        "'all'; with --coordinator every process's); the drafter runs whole on each "
                        "(docs/architecture.md, \"Several devices\").",
                        flag_values=fv)
    define_process_flags(fv)
    flags.DEFINE_string("jit_cache", default_jit_cache(), "Directory of JAX's persistent compilation cache (a "
                        "second run with the same shapes skips compiling); empty to turn it off.", flag_values=fv)
    flags.DEFINE_bool("program_cache", True, "Also keep the lowered decode step and prefill chunk in --jit_cache's "
                      "folder, so that a later run skips tracing and lowering them (a warm start's largest part on a "
                      "GPU; one device only; off with --jit_cache off).", flag_values=fv)
    flags.DEFINE_bool("compile_ahead", COMPILE_AHEAD, "Compile the decode step on a thread while the prompt is "
                      "prefilled, so that a cold start's two largest compiles run side by side (one device only; "
                      "--nocompile_ahead compiles it at the first step).", flag_values=fv)


def define_flags(fv=None) -> None:
    """The command's absl flags (defined only when it runs as a program), in `fv` (default: absl's global FLAGS)."""
    from absl import flags

    fv = flags.FLAGS if fv is None else fv
    define_model_flags(256, f"Context to allocate (0: prompt + n_gen, rounded up to {CTX_ROUND}).", fv=fv)
    flags.DEFINE_string("prompt", None, "Prompt text (default: read stdin).", flag_values=fv)
    flags.DEFINE_string("prompt_ids", None, "Prompt token ids, comma-separated or a .npy file (skips tokenization "
                        "and the chat template).", flag_values=fv)
    flags.DEFINE_boolean("raw", False, "Do not apply the chat template.", flag_values=fv)
    flags.DEFINE_boolean("json", False, "Print one JSON object (token ids, text, per-step acceptance, timings) "
                         "instead of streaming text.", flag_values=fv)
    flags.DEFINE_string("profile", None, "Directory to write a jax.profiler trace (for Perfetto or TensorBoard) of "
                        "--profile_steps decode steps into, starting after the first step (which compiles).",
                        flag_values=fv)
    flags.DEFINE_integer("profile_steps", 8, "Decode steps to trace with --profile.", lower_bound=1, flag_values=fv)
    flags.DEFINE_boolean("compile_report", False, "Print to stderr, after the run, the seconds each jitted function "
                         "spent tracing, lowering and compiling.", flag_values=fv)


def _underscored(arg: str, known) -> str:
    """`--max-ctx=8` as `--max_ctx=8` and `--no-stats` as `--nostats`: flags may be spelled with dashes, as
    llama.cpp and vLLM spell theirs (only names of known flags are rewritten, never values)."""
    name, eq, value = arg[2:].partition("=")
    flag = name.replace("-", "_")
    if not arg.startswith("--") or "-" not in name:
        return arg
    if flag in known:
        return f"--{flag}{eq}{value}"
    if flag.startswith("no_") and flag[3:] in known:
        return f"--no{flag[3:]}{eq}{value}"
    return arg


HELP_FLAGS = ("-h", "-?", "--help", "-help", "--helpshort", "-helpshort", "--helpfull", "-helpfull")


def parse_flags(argv: list[str], command: str = "generate") -> list[str]:
    """absl flag parsing with bad flags reported as one line and exit code 2 (absl's default is a usage dump), and
    --help printed to stdout with exit code 0 (absl's exits with 1)."""
    from absl import app, flags

    end = argv.index("--") if "--" in argv else len(argv)
    asked = [a for a in argv[1:end] if a in HELP_FLAGS]
    if asked:
        app.usage(shorthelp=not any(a.endswith("helpfull") for a in asked), writeto_stdout=True)
        sys.exit(0)
    try:
        return flags.FLAGS([argv[0], *(_underscored(a, flags.FLAGS) for a in argv[1:end]), *argv[end:]])
    except flags.Error as e:
        print(f"{command}: {e}", file=sys.stderr)
        sys.exit(USAGE_ERROR)


if __name__ == "__main__":
    from absl import app

    define_flags()
    app.run(main, flags_parser=parse_flags)
