"""The defaults of each device class, in one table, and the one resolution of the user's flags against them.

Every command (`generate`, `chat`, `serve`, `score`) and every script (`scripts/bench.py`, `acceptance.py`, ...)
turns its flags into an EngineConfig and a KernelConfig here, so that with no flags a benchmark runs exactly what a
user runs. docs/architecture.md ("Kernel configuration") explains each choice and the measurement behind it.
"""

from __future__ import annotations

import dataclasses

import jax

from dflash_jax.config import IMPLS, KV_DTYPES, ConfigError, EngineConfig, KernelConfig

DEVICE_CLASSES = ("cpu", "gpu", "hopper")


@dataclasses.dataclass(frozen=True)
class DeviceDefaults:
    """What a device class gets when the user asks for nothing."""

    impl: str  # KernelConfig.impl
    mgpu_ar: str  # KernelConfig.mgpu in ar mode, whose products are of one token but for the prompt's
    mgpu_tree: str  # KernelConfig.mgpu in chain and ddtree modes (one-token products only at a prompt's end)
    kv_dtype: str  # EngineConfig.kv_dtype
    budget: int  # EngineConfig.budget: DDTree nodes besides the root


DEVICE_DEFAULTS = {
    # The reference path; budgets 4-12 without the chain seed beat 22 with it on two CPU cores (docs/benchmarks.md)
    "cpu": DeviceDefaults(impl="reference", mgpu_ar="off", mgpu_tree="off", kv_dtype="float32", budget=8),
    # GPUs before Hopper: the Triton kernels alone
    "gpu": DeviceDefaults(impl="pallas", mgpu_ar="off", mgpu_tree="off", kv_dtype="bfloat16", budget=22),
    # Hopper (compute capability 9.x): the speculative modes' Q4_K/Q6_K products on the Mosaic GPU kernels alone; ar
    # keeps the Triton layout only, its one-token products on the int8 GEMV ("beside" would hold the quants twice)
    "hopper": DeviceDefaults(impl="pallas", mgpu_ar="off", mgpu_tree="only", kv_dtype="bfloat16", budget=22),
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
    device = device or jax.devices()[0]
    stats = device.memory_stats()
    if stats and "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return host_memory() if device.platform == "cpu" else None


def resolve_kernels(mode: str = "ddtree", *, impl: str = "auto", mgpu: bool | None = None,
                    small_rows: int | None = None, device: str | None = None) -> KernelConfig:
    """The KernelConfig for a decoding mode on a device class (default: this machine's) from the user's choices.

    impl: `auto` (the device's), `reference` or `pallas` (on a CPU: in interpret mode). mgpu: None (the device's),
    True (the Mosaic GPU layout, "beside" for ar and "only" for chain/ddtree; Hopper only) or False."""
    device = device or device_class()
    if device not in DEVICE_CLASSES:
        raise ConfigError(f"device class {device!r} is not one of {', '.join(DEVICE_CLASSES)}")
    if impl != "auto" and impl not in IMPLS:
        raise ConfigError(f"impl must be one of auto, {', '.join(IMPLS)}; got {impl!r}")
    defaults = DEVICE_DEFAULTS[device]
    impl = defaults.impl if impl == "auto" else impl
    layout = defaults.mgpu_ar if mode == "ar" else defaults.mgpu_tree
    if mgpu is not None:
        if mgpu and device != "hopper":
            raise ConfigError("the Mosaic GPU layout (--mgpu) needs a Hopper GPU (compute capability 9.x)")
        layout = ("beside" if mode == "ar" else "only") if mgpu else "off"
    if impl == "reference":
        layout = "off"
    return KernelConfig(impl=impl, interpret=impl == "pallas" and device == "cpu", mgpu=layout,
                        **({} if small_rows is None else {"small_rows": small_rows}))


def resolve_engine(mode: str = "ddtree", *, budget: int | None = None, topk: int = 8, chain_seed: bool | None = None,
                   max_ctx: int = 4096, kv_dtype: str | None = None, device: str | None = None) -> EngineConfig:
    """The EngineConfig of the decoding flags, a None taking the device class's default (budget, KV dtype)."""
    defaults = DEVICE_DEFAULTS[device or device_class()]
    if kv_dtype is not None and kv_dtype not in KV_DTYPES:
        raise ConfigError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}; got {kv_dtype!r}")
    return EngineConfig(mode=mode, budget=defaults.budget if budget is None else budget, topk=topk,
                        chain_seed=chain_seed, max_ctx=max_ctx, kv_dtype=kv_dtype or defaults.kv_dtype)
