"""--allocator: JAX's GPU allocator chosen before the backends start, a late change refused, a bad name refused; a
command's default (cuda_async on one device, JAX's pool over several, the environment's where it names one)."""

import os
import subprocess
import sys

import pytest

from conftest import ROOT
from dflash_jax.allocator import ENV, choose_allocator, current_allocator, select_allocator
from dflash_jax.config import ConfigError

PROBE = """
import os, jax
from dflash_jax.allocator import ENV, select_allocator
from dflash_jax.config import ConfigError
print(select_allocator(None), select_allocator("cuda_async"), os.environ[ENV])
jax.devices()
print(select_allocator("cuda_async"))
try:
    select_allocator("bfc")
except ConfigError as e:
    print("refused:", e)
"""


def test_the_allocator_is_chosen_before_jax_starts_and_kept_after():
    env = {**{k: v for k, v in os.environ.items() if k != ENV}, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "bfc cuda_async cuda_async" and lines[1] == "cuda_async"
    assert lines[2].startswith("refused: --allocator bfc: JAX's backends have started with the cuda_async allocator")


DEFAULTS = """
import os, jax
from dflash_jax.allocator import ENV, choose_allocator
print(choose_allocator(None, one_device=False), os.environ.get(ENV))
print(choose_allocator(None, one_device=True), os.environ[ENV])
os.environ[ENV] = "bfc"
print(choose_allocator(None, one_device=True), choose_allocator("cuda_async", one_device=False), os.environ[ENV])
jax.devices()
print(choose_allocator(None, one_device=False))
"""


def test_a_commands_default_allocator():
    """Before JAX starts, no flag and no environment: cuda_async on one device, bfc (JAX's own) over several; the
    environment's choice is kept, --allocator overrides it; once JAX has started, the one it took."""
    env = {**{k: v for k, v in os.environ.items() if k != ENV}, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", DEFAULTS], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["bfc None", "cuda_async cuda_async", "bfc cuda_async cuda_async", "cuda_async"]


FLAGS = """
import os, sys, types
from dflash_jax.allocator import ENV
from dflash_jax.multihost import parallel_from_flags
f = types.SimpleNamespace(devices=sys.argv[1], coordinator=None, num_processes=None, process_id=None, allocator=None)
print(parallel_from_flags(f, "test").devices, os.environ.get(ENV))
"""


@pytest.mark.parametrize("devices,want", [("1", "1 cuda_async"), ("2", "2 None"), ("all", "2 None")])
def test_the_commands_flags_pick_the_default(devices, want):
    """parallel_from_flags, as every command resolves its flags: one device takes cuda_async, --devices 2 or all
    leave JAX's pool."""
    env = {**{k: v for k, v in os.environ.items() if k != ENV}, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    proc = subprocess.run([sys.executable, "-c", FLAGS, devices], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == want.split()


def test_a_bad_or_late_allocator_is_refused_in_process():
    """Here JAX has started (the suite's other tests): the allocator in force is kept, another is refused, and an
    unknown name is refused before anything else."""
    import jax

    jax.devices()
    now = current_allocator()
    assert select_allocator(None) == now == select_allocator(now)
    other = "bfc" if now != "bfc" else "cuda_async"
    with pytest.raises(ConfigError, match=f"--allocator {other}: JAX's backends have started"):
        select_allocator(other)
    with pytest.raises(ConfigError, match="allocator must be one of bfc, cuda_async; got 'vmm'"):
        select_allocator("vmm")
    assert current_allocator() == now
    assert choose_allocator(None, one_device=True) == choose_allocator(None, one_device=False) == now
