"""Frozen configs: the Qwen3.5/3.6 hybrid target, the DFlash drafter and the speculative engine.

Each config is built by one function per source: `target_config_from_hf` / `draft_config_from_hf` read an HF-style
config.json (the format of `configs/*.json`), and `dflash_jax.gguf.target_config_from_gguf` reads GGUF metadata.
Field meanings follow specs/qwen35_gguf.md §1 and specs/dflash_ddtree.md §1.2.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

from dflash_jax.errors import InputError, brief
from dflash_jax.kv_quant import TYPES as _KV

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
SLIDING_ATTENTION = "sliding_attention"
# Sane limits on sizes read from a file, checked before anything is built from them:
MAX_LAYERS = 1024  # a model's layers (the 27B has 64): more is a corrupt file, not a model
MAX_SIZE = 2**31 - 1  # a width, head count, vocabulary or context: int32 quantities on the device
MAX_JSON_BYTES = 64 << 20  # a config.json is a few KB


class ConfigError(InputError):
    """A config file or dict that does not describe a supported model."""


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """Shape and hyper-parameters of a Qwen3.5/3.6 hybrid target (Gated DeltaNet + gated full attention)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int  # main-model layers; MTP blocks are counted in num_mtp_layers
    layer_types: tuple[str, ...]  # one of FULL_ATTENTION / LINEAR_ATTENTION per layer
    num_heads: int  # full-attention query heads
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_dim: int  # rotated dims per head (partial NeoX RoPE)
    rope_sections: tuple[int, ...]  # mRoPE sections; for text they do not change the result
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    conv_kernel: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    num_mtp_layers: int = 0

    def __post_init__(self):
        _check(len(self.layer_types) == self.num_layers,
               f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        bad = sorted(set(self.layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION})
        _check(not bad, f"unknown layer types {bad}; expected {FULL_ATTENTION!r} or {LINEAR_ATTENTION!r}")
        _check(self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads == 0,
               f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        _check(self.linear_num_key_heads > 0 and self.linear_num_value_heads % self.linear_num_key_heads == 0,
               f"linear value heads {self.linear_num_value_heads} are not a multiple of key heads "
               f"{self.linear_num_key_heads}")
        _check(0 < self.rope_dim <= self.head_dim and self.rope_dim % 2 == 0,
               f"rope_dim {self.rope_dim} must be even and at most head_dim {self.head_dim}")

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def key_dim(self) -> int:
        """Width of the GDN q (and k) projection: linear key heads x key head dim."""
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN causal conv: q, k and v together."""
        return 2 * self.key_dim + self.value_dim


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """Shape and hyper-parameters of a z-lab DFlash drafter (Qwen3-style layers, KV-injected context)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    layer_types: tuple[str, ...]  # FULL_ATTENTION (bidirectional) or SLIDING_ATTENTION (causal in block, windowed)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    sliding_window: int | None
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]  # target layers whose outputs feed the context features
    num_target_layers: int
    max_position_embeddings: int

    def __post_init__(self):
        _check(len(self.layer_types) == self.num_layers,
               f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        bad = sorted(set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
        _check(not bad, f"unknown drafter layer types {bad}")
        _check(SLIDING_ATTENTION not in self.layer_types or (self.sliding_window or 0) > 0,
               "sliding_attention layers need a positive sliding_window")
        _check(self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads == 0,
               f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        _check(self.block_size >= 2, f"block_size {self.block_size} must be at least 2")
        _check(0 <= self.mask_token_id < self.vocab_size,
               f"mask_token_id {self.mask_token_id} is outside the vocab of {self.vocab_size}")
        _check(len(self.target_layer_ids) > 0
               and all(0 <= i < self.num_target_layers for i in self.target_layer_ids),
               f"target_layer_ids {list(self.target_layer_ids)} must be in [0, {self.num_target_layers})")


IMPLS = ("reference", "pallas")
MGPU_LAYOUTS = ("off", "beside", "only")
KV_TYPES = tuple(_KV)  # f32, bf16, f16, q8_0, q4_0, rq3_0, rq4_0 (dflash_jax/kv_quant.py)
NUMERICS = ("exact", "fast")
DRAFT_RULES = ("coupled", "tempered", "plain")  # EngineConfig.draft_rule


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Every kernel choice of a loaded model: resolved once from the device and the user's flags
    (`dflash_jax.defaults.resolve_kernels`), carried with the model and passed to every jitted function as a static
    argument, so a different choice is a different compiled function (docs/architecture.md, "Kernel configuration")."""

    impl: str = "reference"  # "reference": plain jnp and XLA; "pallas": the Pallas GPU kernels
    interpret: bool = False  # the Pallas kernels in interpret mode (on a CPU: tests)
    # Q4_K and Q6_K matrices in the Mosaic GPU kernels' layout (Hopper): "off"; "beside" the Triton kernels' layout
    # (products of 2-64 tokens on Mosaic GPU, one token on the int8 GEMV; the quants held twice); "only" (every
    # product of those matrices on Mosaic GPU, one token padded to 8)
    mgpu: str = "off"
    # tree attention over bf16 and q8_0 caches (blocks of at most 64 tokens) on the Mosaic GPU kernel
    # (pallas_kernels/tree_attention_mgpu.py) instead of the Triton one; Hopper (or interpret mode, for tests)
    mgpu_attention: bool = False
    small_rows: int = 64  # with pallas, quantized matrices of fewer rows go to XLA's product as float32
    # "exact": every product rounds its operands the same way whatever the number of tokens, so a position's logits
    # do not depend on how many tokens share its forward and speculative decoding emits what AR emits
    # (docs/architecture.md, "Numerics"); "fast": one token of Q4_K/Q6_K on the int8-activation GEMV and the gated
    # delta rule's products in TF32 -- faster on a GPU, and NOT exact: a tree may then emit other tokens than AR
    numerics: str = "exact"

    def __post_init__(self):
        _check(self.impl in IMPLS, f"impl {self.impl!r} is not one of {', '.join(IMPLS)}")
        _check(self.mgpu in MGPU_LAYOUTS, f"mgpu layout {self.mgpu!r} is not one of {', '.join(MGPU_LAYOUTS)}")
        _check(self.mgpu == "off" or (self.impl == "pallas" and not self.interpret),
               f"the Mosaic GPU layout ({self.mgpu!r}) needs impl 'pallas' on a Hopper GPU (no interpret mode)")
        _check(not self.mgpu_attention or self.impl == "pallas",
               "the Mosaic GPU tree attention needs impl 'pallas' (on a Hopper GPU, or in interpret mode for tests)")
        _check(not self.interpret or self.impl == "pallas", "interpret mode is for the Pallas kernels (impl 'pallas')")
        _check(self.small_rows >= 0, f"small_rows {self.small_rows} must be at least 0")
        _check(self.numerics in NUMERICS, f"numerics {self.numerics!r} is not one of {', '.join(NUMERICS)}")

    @property
    def exact(self) -> bool:
        """Whether products round the same way at every row count (`numerics` "exact")."""
        return self.numerics == "exact"

    @property
    def drafter(self) -> "KernelConfig":
        """The drafter's kernels: these, in fast numerics. A drafter only proposes; the target's logits choose every
        emitted token, so the drafter's rounding changes how many tokens a step accepts, never which. Exact products
        in the drafter cost 4 ms of a 24.6 ms DDTree-22 step on an H200 (scripts/results/gpu_step_profile_h200_
        exact_nov27.txt: XLA's bf16 product of 16 rows runs at a fifth of the bf16-to-float32 one's speed)."""
        return dataclasses.replace(self, numerics="fast")

    def describe(self) -> str:
        """One line for --stats: the kernel set and its choices."""
        if self.impl == "reference":
            return "reference kernels (jnp and XLA)"
        layout = {"off": "Triton kernels", "beside": "Mosaic GPU beside Triton for Q4_K/Q6_K",
                  "only": "Mosaic GPU for Q4_K/Q6_K"}[self.mgpu]
        layout += ", tree attention on Mosaic GPU" if self.mgpu_attention else ""
        return (f"Pallas kernels{' in interpret mode' if self.interpret else ''}: {layout}, matrices under "
                f"{self.small_rows} rows on XLA, {self.numerics} numerics")


MODES = ("ar", "chain", "ddtree")
# The drafter's default context bound (EngineConfig.draft_ctx): the C++ engine's ring of 2048 tokens' target features.
# On the shipped pair, whose drafter was trained on 512-token sequences, a bound raises the acceptance at long contexts
# (chain AL 1.04 -> 1.14 at 3K tokens with 2048, 1.92 -> 5.29 at 1K with 512: docs/kv_cache.md)
DRAFT_CTX = 2048
MAX_TREE_NODES = 64  # verify width (root included) the kernels are built for
# The gated delta rule's inner block (reference.gdn_chunked, pallas_kernels/gdn.py): a prefill chunk is a multiple of
# it; the default chunk is one block (a larger one is one compiled shape per size, for throughput: issue 42)
PREFILL_BLOCK = 64
# Compile the decode step during the prefill (EngineConfig.compile_ahead): on an H200 the synthetic 27B pair's cold
# DDTree TTFT is 63.6 against 98.7 s, 4.0 against 6.8 s with a warm cache
# (scripts/results/ttft_compile_ahead_h200_nov29.txt)
COMPILE_AHEAD = True


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine decodes: mode, DDTree budget (non-root nodes), top-K per depth, chain seed, context size."""

    mode: str = "ddtree"
    budget: int = 22
    topk: int = 8
    # None: seed only when the budget exceeds the draft's depth (block size - 1). Within the depth a seeded tree is
    # the top-1 chain alone (every node goes to it), so a small budget would be chain decoding, not a tree.
    chain_seed: bool | None = None
    max_ctx: int = 4096  # committed tokens the caches hold (prompt + generated)
    kv_type: str = "f32"  # the KV caches' type (dflash_jax/kv_quant.py), K's and V's unless kv_type_k / kv_type_v
    # what a sampled step builds its tree from (dflash_jax.engine.sampling.draft_scores); greedy uses the logits
    draft_rule: str = "coupled"
    kv_type_k: str | None = None  # the keys' type (None: kv_type)
    kv_type_v: str | None = None  # the values' type (None: kv_type)
    # the drafter's full-attention layers see the last draft_ctx committed tokens (None: all of them), kept in a ring
    # (models/draft.py); it can change how many tokens a step accepts, never which
    draft_ctx: int | None = DRAFT_CTX
    # prompt tokens per compiled prefill call (one compiled shape per size, the last chunk padded)
    prefill_chunk: int = PREFILL_BLOCK
    # a folder where the step's and the prefill chunk's lowered programs are kept between processes
    # (dflash_jax/engine/programs.py; --program_cache puts it in --jit_cache's folder); "" keeps none
    program_cache: str = ""
    # compile the decode step on a thread while the prompt is prefilled (Engine._compile_ahead; one device), so that
    # a cold start's two largest compiles run side by side
    compile_ahead: bool = COMPILE_AHEAD

    def __post_init__(self):
        check_prefill_chunk(self.prefill_chunk)
        _check(self.mode in MODES, f"mode {self.mode!r} is not one of {', '.join(MODES)}")
        _check(1 <= self.budget <= MAX_TREE_NODES - 1,
               f"budget {self.budget} must be between 1 and {MAX_TREE_NODES - 1} (the tree verifies budget + 1 "
               f"tokens; at most {MAX_TREE_NODES} are supported)")
        _check(self.topk >= 1, f"topk {self.topk} must be at least 1 (a top-K wider than the budget is cut to it)")
        _check(self.max_ctx >= 2, f"max_ctx {self.max_ctx} must be at least 2")
        for name in ("kv_type", "kv_type_k", "kv_type_v"):
            value = getattr(self, name)
            _check(value in KV_TYPES or (value is None and name != "kv_type"),
                   f"{name} {value!r} is not one of {', '.join(KV_TYPES)}")
        _check(self.draft_ctx is None or self.draft_ctx >= 1,
               f"draft_ctx {self.draft_ctx} must be at least 1 (None: the whole context)")
        _check(self.draft_rule in DRAFT_RULES,
               f"draft_rule {self.draft_rule!r} is not one of {', '.join(DRAFT_RULES)}")

    @property
    def kv_types(self) -> tuple[str, str]:
        """The keys' and the values' KV types."""
        return self.kv_type_k or self.kv_type, self.kv_type_v or self.kv_type

    def seeds_chain(self, depth: int) -> bool:
        """Whether the DDTree starts from the top-1 chain, for a draft of `depth` rows."""
        return self.chain_seed if self.chain_seed is not None else self.budget > depth

    def step_config(self) -> "EngineConfig":
        """This configuration as the decode step sees it: the prefill chunk and compile-ahead, which the step does not
        read, at their defaults, so engines that differ only there share one jitted (and compiled) step."""
        return dataclasses.replace(self, prefill_chunk=PREFILL_BLOCK, compile_ahead=COMPILE_AHEAD)


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """The device mesh the target runs on: `devices` devices on one axis, the target tensor-parallel over them
    (dflash_jax/parallel.py; docs/architecture.md, "Several devices"). One device is the program without a mesh.
    With a `coordinator` the devices are those of `num_processes` processes (hosts) that run the same program, this
    one being `process_id` (dflash_jax/multihost.py; "Several hosts")."""

    devices: int = 1
    axis: str = "tp"  # the mesh axis's name, which the all-reduces name
    coordinator: str | None = None  # HOST:PORT of process 0's coordination service; None: one process
    num_processes: int = 1
    process_id: int = 0

    def __post_init__(self):
        _check(isinstance(self.devices, int) and self.devices >= 1, f"devices {self.devices!r} must be at least 1")
        if self.coordinator is None:
            _check((self.num_processes, self.process_id) == (1, 0),
                   f"num_processes {self.num_processes} / process_id {self.process_id} need a coordinator")
            return
        host, _, port = self.coordinator.rpartition(":")
        _check(bool(host) and port.isdigit() and 0 < int(port) < 65536,
               f"coordinator {self.coordinator!r} should be HOST:PORT (process 0's host, a free port)")
        _check(isinstance(self.num_processes, int) and self.num_processes >= 1,
               f"num_processes {self.num_processes!r} must be at least 1")
        _check(isinstance(self.process_id, int) and 0 <= self.process_id < self.num_processes,
               f"process_id {self.process_id!r} must be in 0..{self.num_processes - 1} (one per process)")

    @property
    def primary(self) -> bool:
        """Whether this process is the one that prints (process 0; the only one without a coordinator)."""
        return self.process_id == 0


def check_prefill_chunk(chunk: int) -> int:
    """The prefill chunk, after checking that it is a positive multiple of the delta rule's block (ConfigError)."""
    _check(isinstance(chunk, int) and chunk >= PREFILL_BLOCK and chunk % PREFILL_BLOCK == 0,
           f"prefill_chunk {chunk!r} must be a positive multiple of {PREFILL_BLOCK} (the gated delta rule's block)")
    return chunk


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


SINGLE_DEVICE = ParallelConfig()  # the default: the target on one device, no mesh


def _require(d: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in d or d[key] is None:
        raise ConfigError(f"{where}: missing required key {key!r}")
    return d[key]


def _entry(d: Mapping[str, Any], key: str, where: str, default: Any) -> Any:
    """d[key], or the default when it is absent or null (`...`: required)."""
    return _require(d, key, where) if default is ... else default if d.get(key) is None else d[key]


def _int(d: Mapping[str, Any], key: str, where: str, default: Any = ..., lo: int = 0, hi: int = MAX_SIZE) -> int:
    """An integer entry in [lo, hi] (a float that is a whole number, as JSON may write 1e3, counts)."""
    v = _entry(d, key, where, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise ConfigError(f"{where}: {key} should be an integer, found {brief(v)}")
    if not lo <= v <= hi:
        raise ConfigError(f"{where}: {key} is {brief(v)}, expected {lo} to {hi}")
    return int(v)


def _positive(d: Mapping[str, Any], key: str, where: str, default: Any = ..., hi: float = math.inf) -> float:
    """A finite number entry in (0, hi]."""
    v = _entry(d, key, where, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v <= hi and math.isfinite(v)):
        bound = "a finite positive number" if hi == math.inf else f"a number in (0, {hi}]"
        raise ConfigError(f"{where}: {key} should be {bound}, found {brief(v)}")
    return float(v)


def _ints(d: Mapping[str, Any], key: str, where: str, default: Any = ..., max_len: int = MAX_LAYERS) -> list[int]:
    """A list of at most max_len non-negative integers."""
    v = _entry(d, key, where, default)
    if not isinstance(v, (list, tuple)) or len(v) > max_len:
        raise ConfigError(f"{where}: {key} should be a list of at most {max_len} integers, found {brief(v)}")
    return [_int({key: x}, key, where) for x in v]


def _strings(d: Mapping[str, Any], key: str, where: str) -> list[str] | None:
    """A list of strings, or None when the entry is absent or null."""
    v = d.get(key)
    if v is not None and (not isinstance(v, list) or not all(isinstance(x, str) for x in v)):
        raise ConfigError(f"{where}: {key} should be a list of strings, found {brief(v)}")
    return v


def _mapping(d: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    """A JSON object entry ({} when absent or null)."""
    v = d.get(key)
    if v is not None and not isinstance(v, Mapping):
        raise ConfigError(f"{where}: {key} should be a JSON object, found {brief(v)}")
    return v or {}


def _bool(d: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
    v = _entry(d, key, where, default)
    if not isinstance(v, bool):
        raise ConfigError(f"{where}: {key} should be true or false, found {brief(v)}")
    return v


def _built(cls: type, where: str, **fields: Any) -> Any:
    """cls(**fields), its own consistency checks' errors prefixed with where."""
    try:
        return cls(**fields)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def rope_sections(sections: Any) -> tuple[int, ...]:
    """mRoPE sections padded to GGUF's four entries (HF configs list three, Ollama files too)."""
    sections = tuple(int(s) for s in sections)
    return sections + (0,) * (4 - len(sections))


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> tuple[int, ...]:
    """z-lab's default taps: spaced uniformly from layer 1 to layer L-3 (specs/dflash_ddtree.md §1.1)."""
    if num_taps == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(int(round(1 + i * span / (num_taps - 1))) for i in range(num_taps))


def _rope_params(d: Mapping[str, Any], where: str) -> dict[str, Any]:
    """rope_parameters (transformers 5) merged over the older rope_theta / rope_scaling keys."""
    params: dict[str, Any] = {}
    for key in ("rope_theta", "partial_rotary_factor"):
        if d.get(key) is not None:
            params[key] = d[key]
    for key in ("rope_scaling", "rope_parameters"):
        params.update({k: v for k, v in _mapping(d, key, where).items() if v is not None})
    return params


def _layer_types(d: Mapping[str, Any], where: str, num_layers: int) -> tuple[str, ...]:
    """layer_types, or every full_attention_interval-th layer full attention."""
    layer_types = _strings(d, "layer_types", where)
    if layer_types is None:
        interval = _int(d, "full_attention_interval", where, 4, lo=1, hi=num_layers)
        layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers)]
    return tuple(layer_types)


def _text_config(d: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    """The text model's config: the VLM's text_config (with the top level's tie_word_embeddings), or d itself."""
    if "text_config" not in d:
        return d
    tie = d.get("tie_word_embeddings")
    return {**_mapping(d, "text_config", where), **({"tie_word_embeddings": tie} if tie is not None else {})}


def target_config_from_hf(d: Mapping[str, Any], where: str = "config") -> TargetConfig:
    """TargetConfig from an HF Qwen3.5 config dict (`Qwen3_5ForCausalLM`, or the text part of the VLM config)."""
    d = _text_config(d, where)
    model_type = d.get("model_type")
    if model_type not in (None, "qwen3_5_text", "qwen3_5"):
        raise ConfigError(f"{where}: model_type {brief(model_type)} is not a Qwen3.5/3.6 text model "
                          f"(expected 'qwen3_5_text' or 'qwen3_5')")
    num_layers = _int(d, "num_hidden_layers", where, lo=1, hi=MAX_LAYERS)
    head_dim = _int(d, "head_dim", where, 256, lo=1)
    rope = _rope_params(d, where)
    if rope.get("rope_type", "default") not in ("default", "mrope"):
        raise ConfigError(f"{where}: rope_type {brief(rope['rope_type'])} is not supported (only plain RoPE)")
    return _built(
        TargetConfig, where,
        vocab_size=_int(d, "vocab_size", where, lo=1),
        hidden_size=_int(d, "hidden_size", where, lo=1),
        intermediate_size=_int(d, "intermediate_size", where, lo=1),
        num_layers=num_layers,
        layer_types=_layer_types(d, where, num_layers),
        num_heads=_int(d, "num_attention_heads", where, lo=1),
        num_kv_heads=_int(d, "num_key_value_heads", where, lo=1),
        head_dim=head_dim,
        rope_theta=_positive(rope, "rope_theta", where, 10000.0),
        rope_dim=int(head_dim * _positive(rope, "partial_rotary_factor", where, 0.25, hi=1.0)),
        rope_sections=rope_sections(_ints(rope, "mrope_section", where, (11, 11, 10), max_len=4)),
        linear_num_key_heads=_int(d, "linear_num_key_heads", where, 16, lo=1),
        linear_num_value_heads=_int(d, "linear_num_value_heads", where, 32, lo=1),
        linear_key_head_dim=_int(d, "linear_key_head_dim", where, 128, lo=1),
        linear_value_head_dim=_int(d, "linear_value_head_dim", where, 128, lo=1),
        conv_kernel=_int(d, "linear_conv_kernel_dim", where, 4, lo=1),
        rms_norm_eps=_positive(d, "rms_norm_eps", where, 1e-6),
        max_position_embeddings=_int(d, "max_position_embeddings", where, 32768, lo=1),
        tie_word_embeddings=_bool(d, "tie_word_embeddings", where, False),
        num_mtp_layers=_int(d, "mtp_num_hidden_layers", where, 0, hi=MAX_LAYERS),
    )


def target_config_to_hf(cfg: TargetConfig) -> dict[str, Any]:
    """The HF `Qwen3_5TextConfig` dict for a TargetConfig (inverse of target_config_from_hf)."""
    return {
        "model_type": "qwen3_5_text",
        "architectures": ["Qwen3_5ForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "layer_types": list(cfg.layer_types),
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": cfg.rope_theta,
            "partial_rotary_factor": cfg.rope_dim / cfg.head_dim,
            "mrope_section": list(cfg.rope_sections[:3]),
            "mrope_interleaved": True,
        },
        "linear_num_key_heads": cfg.linear_num_key_heads,
        "linear_num_value_heads": cfg.linear_num_value_heads,
        "linear_key_head_dim": cfg.linear_key_head_dim,
        "linear_value_head_dim": cfg.linear_value_head_dim,
        "linear_conv_kernel_dim": cfg.conv_kernel,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "mtp_num_hidden_layers": cfg.num_mtp_layers,
        "hidden_act": "silu",
        "attention_bias": False,
    }


def _either(d: Mapping[str, Any], dflash: Mapping[str, Any], key: str, first: str) -> dict[str, Any]:
    """{key: value} from the top level or dflash_config, `first` ("top" or "dflash") looked at first."""
    order = (d, dflash) if first == "top" else (dflash, d)
    return {key: next((src[key] for src in order if src.get(key) is not None), None)}


def draft_config_from_hf(d: Mapping[str, Any], where: str = "config") -> DraftConfig:
    """DraftConfig from a z-lab DFlash config.json (`DFlashDraftModel`)."""
    num_layers = _int(d, "num_hidden_layers", where, lo=1, hi=MAX_LAYERS)
    dflash = _mapping(d, "dflash_config", where)
    num_target_layers = _int(d, "num_target_layers", where, lo=1, hi=MAX_LAYERS)
    taps = _ints(dflash, "target_layer_ids", f"{where}: dflash_config",
                 default_target_layer_ids(num_target_layers, num_layers))
    hidden = _int(d, "hidden_size", where, lo=1)
    heads = _int(d, "num_attention_heads", where, lo=1)
    window = d.get("sliding_window")
    return _built(
        DraftConfig, where,
        vocab_size=_int(d, "vocab_size", where, lo=1),
        hidden_size=hidden,
        intermediate_size=_int(d, "intermediate_size", where, lo=1),
        num_layers=num_layers,
        layer_types=tuple(_strings(d, "layer_types", where) or [FULL_ATTENTION] * num_layers),
        num_heads=heads,
        num_kv_heads=_int(d, "num_key_value_heads", where, heads, lo=1),
        head_dim=_int(d, "head_dim", where, hidden // heads, lo=1),
        rope_theta=_positive(_rope_params(d, where), "rope_theta", where, 10000.0),
        rms_norm_eps=_positive(d, "rms_norm_eps", where, 1e-6),
        sliding_window=None if window is None else _int(d, "sliding_window", where),
        block_size=_int(_either(d, dflash, "block_size", "top"), "block_size", where, hi=MAX_TREE_NODES),
        mask_token_id=_int(_either(d, dflash, "mask_token_id", "dflash"), "mask_token_id", where),
        target_layer_ids=tuple(taps),
        num_target_layers=num_target_layers,
        max_position_embeddings=_int(d, "max_position_embeddings", where, 32768, lo=1),
    )


def draft_config_to_hf(cfg: DraftConfig) -> dict[str, Any]:
    """A z-lab DFlash config.json (`DFlashDraftModel`) for cfg; inverse of `draft_config_from_hf`."""
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "dtype": "bfloat16",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "layer_types": list(cfg.layer_types),
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps,
        "sliding_window": cfg.sliding_window, "use_sliding_window": cfg.sliding_window is not None,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": False,
        "attention_bias": False, "block_size": cfg.block_size, "num_target_layers": cfg.num_target_layers,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)},
    }


def read_json(path: str | os.PathLike) -> dict[str, Any]:
    """A JSON object from a file, with a one-line error naming the file for a missing, oversized, non-UTF-8,
    malformed or too deeply nested one."""
    try:
        if os.path.getsize(path) > MAX_JSON_BYTES:
            raise ConfigError(f"{path}: {os.path.getsize(path)} bytes is too large for a JSON config "
                              f"(at most {MAX_JSON_BYTES})")
        with open(path, "rb") as f:
            d = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise ConfigError(f"{path}: JSON nested too deeply") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: expected a JSON object, found {type(d).__name__}")
    return d


def load_target_config(path: str | os.PathLike) -> TargetConfig:
    """TargetConfig from an HF-style config.json (e.g. configs/qwen3.5-27b.json)."""
    return target_config_from_hf(read_json(path), where=str(path))


def load_draft_config(path: str | os.PathLike) -> DraftConfig:
    """DraftConfig from a z-lab drafter config.json (e.g. configs/qwen3.5-27b-dflash.json)."""
    return draft_config_from_hf(read_json(path), where=str(path))
