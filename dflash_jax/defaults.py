"""The defaults of each device class, in one table, and the one resolution of the user's flags against them.

Every command (`generate`, `chat`, `serve`, `score`) and every script (`scripts/bench.py`, `acceptance.py`, ...)
turns its flags into an EngineConfig and a KernelConfig here, so that with no flags a benchmark runs exactly what a
user runs. docs/architecture.md ("Kernel configuration") explains each choice and the measurement behind it.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax

from dflash_jax.config import (COMPILE_AHEAD, DRAFT_CTX, DRAFT_RULES, IMPLS, KV_TYPES, NUMERICS, PREFILL_BLOCK,
                               ConfigError, EngineConfig, KernelConfig)

DEVICE_CLASSES = ("cpu", "gpu", "hopper")


@dataclasses.dataclass(frozen=True)
class DeviceDefaults:
    """What a device class gets when the user asks for nothing."""

    impl: str  # KernelConfig.impl
    mgpu_ar: str  # KernelConfig.mgpu in ar mode, whose products are of one token but for the prompt's
    mgpu_tree: str  # KernelConfig.mgpu in chain and ddtree modes (one-token products only at a prompt's end)
    kv_type: str  # EngineConfig.kv_type
    budget: int  # EngineConfig.budget: DDTree nodes besides the root
    numerics: str  # KernelConfig.numerics
    mgpu_attention: bool = False  # KernelConfig.mgpu_attention


DEVICE_DEFAULTS = {
    # The reference path, float32 throughout (exact at no cost); budgets 4-12 without the chain seed beat 22 with it on
    # two CPU cores (docs/benchmarks.md)
    "cpu": DeviceDefaults(impl="reference", mgpu_ar="off", mgpu_tree="off", kv_type="f32", budget=8,
                          numerics="exact"),
    # GPUs before Hopper: the Triton kernels alone. Numerics "exact" everywhere: speculative decoding emits what AR
    # emits; it costs the 27B's steps on an H200 about 11 % (AR) and 25 % (DDTree-22), mostly the gated delta rule's
    # float32 products (docs/architecture.md, "Numerics"); `--numerics fast` trades that exactness for the speed
    "gpu": DeviceDefaults(impl="pallas", mgpu_ar="off", mgpu_tree="off", kv_type="bf16", budget=22,
                          numerics="exact"),
    # Hopper (compute capability 9.x): every Q4_K/Q6_K product on the Mosaic GPU kernels alone, ar too (its step
    # 9.76 ms against 10.44 ms on the Triton layout's GEMV, H200: scripts/results/bench_27b_h200_config_mgpu_nov27.txt
    # and bench_27b_h200_config_triton_nov27.txt), so that every mode multiplies the same rounded weights
    # The tree attention over bf16 and q8_0 caches on Mosaic GPU: 128K q8_0 steps AR 14.06 / DDTree-22 31.87 ms
    # against 18.38 / 41.97 on the Triton kernel, 4K steps equal (scripts/results/mgpu_attention_h200_nov29.txt)
    "hopper": DeviceDefaults(impl="pallas", mgpu_ar="only", mgpu_tree="only", kv_type="bf16", budget=22,
                             numerics="exact", mgpu_attention=True),
}


def device_class(device: jax.Device | None = None) -> str:
    """`cpu`, `gpu` or `hopper` (a CUDA GPU of compute capability 9.x) for a device (default: JAX's first)."""
    device = device or jax.devices()[0]
    if device.platform != "gpu":
        return "cpu"
    return "hopper" if str(getattr(device, "compute_capability", "")).startswith("9") else "gpu"


def host_memory() -> int | None:
    """Bytes of host memory available to allocate now (/proc/meminfo's MemAvailable; None where it cannot be read)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def free_memory(device: jax.Device | None = None) -> int | None:
    """Bytes a device (default: JAX's first) can still allocate: its allocator's limit less what is in use on a GPU,
    the host's available memory on a CPU (None where neither is known)."""
    device = device or jax.local_devices()[0]
    stats = device.memory_stats()
    if stats and "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return host_memory() if device.platform == "cpu" else None


def least_free(devices: Sequence[jax.Device]) -> tuple[int | None, jax.Device]:
    """The least free memory of some devices (`free_memory`; None where none reports it; another process's devices,
    which report to it, left out) and that device."""
    known = [(free, d) for d in devices
             if d.process_index == jax.process_index() and (free := free_memory(d)) is not None]
    return min(known, key=lambda fd: fd[0]) if known else (None, devices[0])


def resolve_kernels(mode: str = "ddtree", *, impl: str = "auto", mgpu: bool | None = None,
                    small_rows: int | None = None, numerics: str | None = None, device: str | None = None,
                    mgpu_attention: bool | None = None) -> KernelConfig:
    """The KernelConfig for a decoding mode on a device class (default: this machine's) from the user's choices.

    impl: `auto` (the device's), `reference` or `pallas` (on a CPU: in interpret mode). mgpu: None (the device's),
    True (every Q4_K/Q6_K matrix in the Mosaic GPU layout alone; Hopper only) or False. numerics: None
    (the device's), "exact" (speculative decoding emits what AR emits) or "fast" (KernelConfig.numerics).
    mgpu_attention: None (the device's: on on Hopper), True (tree attention over bf16 and q8_0 caches on the Mosaic
    GPU kernel; Hopper only) or False (the Triton kernel)."""
    device = device or device_class()
    if device not in DEVICE_CLASSES:
        raise ConfigError(f"device class {device!r} is not one of {', '.join(DEVICE_CLASSES)}")
    if impl != "auto" and impl not in IMPLS:
        raise ConfigError(f"impl must be one of auto, {', '.join(IMPLS)}; got {impl!r}")
    if numerics is not None and numerics not in NUMERICS:
        raise ConfigError(f"numerics must be one of {', '.join(NUMERICS)}; got {numerics!r}")
    defaults = DEVICE_DEFAULTS[device]
    impl = defaults.impl if impl == "auto" else impl
    numerics = numerics or defaults.numerics
    layout = defaults.mgpu_ar if mode == "ar" else defaults.mgpu_tree
    if mgpu is not None:
        if mgpu and device != "hopper":
            raise ConfigError("the Mosaic GPU layout (--mgpu) needs a Hopper GPU (compute capability 9.x)")
        layout = "only" if mgpu else "off"
    if mgpu_attention and (device != "hopper" or impl != "pallas"):
        raise ConfigError("the Mosaic GPU tree attention (--mgpu_attention) needs a Hopper GPU and the Pallas kernels")
    if mgpu_attention is None:
        mgpu_attention = defaults.mgpu_attention
    if impl == "reference":
        layout, mgpu_attention = "off", False
    return KernelConfig(impl=impl, interpret=impl == "pallas" and device == "cpu", mgpu=layout, numerics=numerics,
                        mgpu_attention=mgpu_attention,
                        **({} if small_rows is None else {"small_rows": small_rows}))


def resolve_engine(mode: str = "ddtree", *, budget: int | None = None, topk: int = 8, chain_seed: bool | None = None,
                   max_ctx: int = 4096, kv_type: str | None = None, kv_type_k: str | None = None,
                   kv_type_v: str | None = None, draft_ctx: int | None = None, draft_rule: str = "coupled",
                   prefill_chunk: int | None = None, program_cache: str = "", compile_ahead: bool = COMPILE_AHEAD,
                   device: str | None = None) -> EngineConfig:
    """The EngineConfig of the decoding flags, a None taking the device class's default (budget, KV type; K's and
    V's types default to kv_type; the drafter's context bound EngineConfig's, 0 for the whole context; the prefill
    chunk the delta rule's block, PREFILL_BLOCK tokens, on every device until a GPU measurement picks another);
    `program_cache` the folder of kept lowered programs (EngineConfig.program_cache); `compile_ahead` compiles the
    step on a thread during the prefill (EngineConfig.compile_ahead)."""
    defaults = DEVICE_DEFAULTS[device or device_class()]
    for name, value in (("kv_type", kv_type), ("kv_type_k", kv_type_k), ("kv_type_v", kv_type_v)):
        if value is not None and value not in KV_TYPES:
            raise ConfigError(f"{name} must be one of {', '.join(KV_TYPES)}; got {value!r}")
    if draft_ctx is not None and draft_ctx < 0:
        raise ConfigError(f"draft_ctx must be at least 0 (0: the whole context); got {draft_ctx}")
    if draft_rule not in DRAFT_RULES:
        raise ConfigError(f"draft_rule must be one of {', '.join(DRAFT_RULES)}; got {draft_rule!r}")
    kv_type = kv_type or defaults.kv_type
    return EngineConfig(mode=mode, budget=defaults.budget if budget is None else budget, topk=topk,
                        chain_seed=chain_seed, max_ctx=max_ctx, kv_type=kv_type,
                        draft_rule=draft_rule, kv_type_k=None if kv_type_k == kv_type else kv_type_k,
                        kv_type_v=None if kv_type_v == kv_type else kv_type_v,
                        draft_ctx=DRAFT_CTX if draft_ctx is None else draft_ctx or None,
                        prefill_chunk=PREFILL_BLOCK if prefill_chunk is None else prefill_chunk,
                        program_cache=program_cache, compile_ahead=compile_ahead)
