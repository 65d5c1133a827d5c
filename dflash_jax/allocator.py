"""JAX's GPU memory allocator for this process, chosen before JAX starts its backends (`--allocator`).

JAX reads XLA_PYTHON_CLIENT_ALLOCATOR once, when its GPU backend starts. Its default, a best-fit-with-coalescing (BFC)
pool, hands a request a whole free chunk when splitting would leave less than 128 MB, so the load's repacking
temporaries leave holes that the next weights fill with slack: 3.9 GB of the synthetic 27B's 20.4 GB on an H200.
CUDA's stream-ordered pool (cuda_async) left none (scripts/results/allocator_h200_nov29.txt) and decodes as fast, so
the commands take it on one device (scripts/results/allocator_step_ttft_h200_nov29.txt); over several devices they keep
JAX's pool until cuda_async is measured with NCCL's collectives.
"""

from __future__ import annotations

import os

from jax._src import xla_bridge  # backends_are_initialized: no public API says whether JAX has started

from dflash_jax.config import ConfigError

ENV = "XLA_PYTHON_CLIENT_ALLOCATOR"
ALLOCATORS = ("bfc", "cuda_async")  # JAX's default pool; CUDA's cudaMallocAsync pool
DEFAULT = "bfc"  # what JAX takes when the environment names none ("default")
ONE_DEVICE = "cuda_async"  # the commands' default on one device in one process


def current_allocator() -> str:
    """The allocator this process's GPU backend takes (or took): the environment's, JAX's default named "bfc"."""
    name = os.environ.get(ENV, "").lower()
    return DEFAULT if name in ("", "default") else name


def select_allocator(name: str | None) -> str:
    """Make `name` (one of ALLOCATORS; None keeps the environment's) the GPU allocator of this process and return the
    one in force. Call it before anything starts JAX's backends; a different choice after that is refused, since JAX
    would go on with the one it started with. It matters on CUDA GPUs only."""
    if name is None:
        return current_allocator()
    if name not in ALLOCATORS:
        raise ConfigError(f"allocator must be one of {', '.join(ALLOCATORS)}; got {name!r}")
    if name == current_allocator():
        return name
    if xla_bridge.backends_are_initialized():
        raise ConfigError(f"--allocator {name}: JAX's backends have started with the {current_allocator()} "
                          f"allocator; choose it before any use of JAX (or set {ENV}={name})")
    os.environ[ENV] = name
    return name


def command_default(one_device: bool) -> str:
    """The allocator a command takes without --allocator: cuda_async for one device in one process, JAX's pool for
    several (the environment's choice, where it names one, is kept: `choose_allocator`)."""
    return ONE_DEVICE if one_device else DEFAULT


def choose_allocator(flag: str | None, one_device: bool) -> str:
    """A command's allocator, made this process's and returned: --allocator's where given (`select_allocator`),
    else the environment's where it names one, else `command_default` where JAX has not started, else the one JAX
    took (a command run in a process that already uses JAX, as the tests do)."""
    if flag is not None:
        return select_allocator(flag)
    if os.environ.get(ENV) or xla_bridge.backends_are_initialized():
        return current_allocator()
    return select_allocator(command_default(one_device))
