"""Several processes (hosts) running one program over all their devices: the flags that name the processes, joining
them (`jax.distributed.initialize`) before anything else touches JAX, and `--devices` resolved over every process's
devices (docs/architecture.md, "Several hosts"); with them the process's GPU allocator (`--allocator`), which must
also be chosen before JAX starts."""

from __future__ import annotations

import os
import sys
from typing import Any, TextIO

import jax

from dflash_jax.allocator import ALLOCATORS, choose_allocator
from dflash_jax.config import SINGLE_DEVICE, ConfigError, ParallelConfig
from dflash_jax.parallel import device_count_flag, parallel_config

PROCESS_FLAGS = ("coordinator", "num_processes", "process_id")


def define_process_flags(fv=None) -> None:
    """--coordinator, --num_processes, --process_id and --allocator in `fv` (default: absl's global FLAGS)."""
    from absl import flags

    fv = flags.FLAGS if fv is None else fv
    flags.DEFINE_string("coordinator", None, "Several hosts: HOST:PORT of process 0, where every process meets (a "
                        "free port there); with --num_processes and --process_id the target is split over the devices "
                        "of every process (--devices all; docs/architecture.md, \"Several hosts\").", flag_values=fv)
    flags.DEFINE_integer("num_processes", None, "Several hosts: how many processes run the program (one a host).",
                         flag_values=fv)
    flags.DEFINE_integer("process_id", None, "Several hosts: this process's number, 0 to --num_processes - 1; "
                         "process 0 prints the output.", flag_values=fv)
    flags.DEFINE_enum("allocator", None, list(ALLOCATORS), "JAX's GPU memory allocator for this process: bfc (JAX's "
                      "pool) or cuda_async (CUDA's stream-ordered pool, which leaves no slack after the load). "
                      "Default: XLA_PYTHON_CLIENT_ALLOCATOR's, else cuda_async on one device and bfc over several.",
                      flag_values=fv)


def add_process_arguments(parser: Any) -> None:
    """The same four flags on an argparse parser (scripts/bench.py)."""
    parser.add_argument("--coordinator", default=None, help="several hosts: HOST:PORT of process 0, as generate's")
    parser.add_argument("--num_processes", type=int, default=None, help="several hosts: how many processes")
    parser.add_argument("--process_id", type=int, default=None, help="several hosts: this process's number")
    parser.add_argument("--allocator", choices=ALLOCATORS, default=None,
                        help="JAX's GPU memory allocator, as generate's (default: the environment's, else cuda_async "
                        "on one device, bfc over several)")


def processes(coordinator: str | None, num_processes: int | None, process_id: int | None) -> ParallelConfig:
    """The processes the three flags name (all three or none), as a ParallelConfig of one device; checked, JAX
    untouched."""
    given = {name: value for name, value in zip(PROCESS_FLAGS, (coordinator, num_processes, process_id))
             if value is not None}
    if not given:
        return SINGLE_DEVICE
    if len(given) < len(PROCESS_FLAGS):
        missing = ", ".join(f"--{name}" for name in PROCESS_FLAGS if name not in given)
        raise ConfigError(f"--coordinator, --num_processes and --process_id go together: {missing} missing")
    try:
        return ParallelConfig(coordinator=coordinator, num_processes=num_processes, process_id=process_id)
    except ConfigError as e:
        raise ConfigError(f"--coordinator / --num_processes / --process_id: {e}") from None


def join(pcfg: ParallelConfig) -> None:
    """Join the processes `pcfg` names (nothing for one without a coordinator): each waits for all of them at the
    coordinator. Call it once, before any other use of JAX (which would start the devices of this process alone)."""
    if pcfg.coordinator is None or jax.distributed.is_initialized():
        return
    jax.distributed.initialize(coordinator_address=pcfg.coordinator, num_processes=pcfg.num_processes,
                               process_id=pcfg.process_id)


def parallel_from_flags(f: Any, command: str, several: bool = False) -> ParallelConfig:
    """The ParallelConfig of the flags `devices`, `coordinator`, `num_processes` and `process_id` (absl's or
    argparse's), the GPU allocator of `allocator` chosen and the processes joined first (`join`): the one place a
    command resolves them. A command that does not run over several processes (not `several`) is refused them before
    any process waits for another."""
    base = processes(f.coordinator, f.num_processes, f.process_id)
    choose_allocator(getattr(f, "allocator", None),
                     one_device=base.coordinator is None and device_count_flag(f.devices) == 1)
    if base.num_processes > 1 and not several:
        raise ConfigError(f"{command} over several processes (--num_processes {base.num_processes}) is not "
                          f"implemented: generate runs over several hosts; {command} takes --num_processes 1")
    join(base)
    return parallel_config(f.devices, base)


def own_stdout(pcfg: ParallelConfig) -> TextIO:
    """Where a command writes its output: standard output; with a coordinator, a copy of it, file descriptor 1 itself
    then going to stderr, because the CPU collectives' gloo writes a line per device ("[Gloo] Rank i is connected to
    n peer ranks...") to it from native code, which would land in the text or the --json object."""
    if pcfg.coordinator is None:
        return sys.stdout
    sys.stdout.flush()
    kept = os.dup(1)
    os.dup2(2, 1)
    return os.fdopen(kept, "w", encoding="utf-8")
