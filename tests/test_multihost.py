"""Several processes running one program (dflash_jax/multihost.py): the process flags' checks, and `generate` over
two processes of two CPU devices each (JAX's CPU collectives between processes: gloo) emitting one device's greedy
ids; one process through a coordinator as without one."""

import argparse
import json
import os
import socket
import subprocess
import sys

import gguf
import pytest

from conftest import ROOT, TINY, TINY_GGUF
from dflash_jax.config import SINGLE_DEVICE, ConfigError, ParallelConfig
from dflash_jax.multihost import parallel_from_flags, processes
from dflash_jax.parallel import parallel_config
from dflash_jax.testing.gguf_writer import copy_metadata, write_gguf
from dflash_jax.testing.tiny import random_gguf_tensors, tiny_target_config

# the fixture's widths, layers and vocabulary (its drafter and tokenizer fit) with 4 KV heads and 4 Gated DeltaNet
# key heads: splits 4 ways, over the 2 x 2 devices of two processes
WIDE = tiny_target_config(num_layers=8, interval=4, vocab_size=1024, num_heads=4, num_kv_heads=4,
                          linear_num_key_heads=4, linear_num_value_heads=8)
PROMPT = ("--prompt_ids", "5,6,7,8,9,10,11,12", "--n_gen", "8", "--mode", "ddtree", "--draft",
          str(TINY / "draft-full"), "--json")
TIMEOUT = 120  # seconds a command may run; a process whose peer died waits at the coordinator


@pytest.fixture(scope="module")
def wide_gguf(tmp_path_factory) -> str:
    """A random 4-KV-head target with the fixture's tokenizer."""
    path = tmp_path_factory.mktemp("wide") / "wide.gguf"
    write_gguf(path, random_gguf_tensors(WIDE, seed=7), WIDE,
               metadata=copy_metadata(gguf.GGUFReader(TINY_GGUF), "tokenizer."))
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def start(args: list[str], devices: int, jit_cache: str) -> subprocess.Popen:
    """`generate` with args in a process of `devices` CPU devices."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    return subprocess.Popen([sys.executable, "-m", "dflash_jax.generate", f"--jit_cache={jit_cache}", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)


def finish(procs: list[subprocess.Popen]) -> list[tuple[int, str, str]]:
    """Each process's (exit code, stdout, stderr); all of them killed if one is not done within TIMEOUT."""
    try:
        outs = [p.communicate(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def over(n: int, port: int) -> list[list[str]]:
    """Each of n processes' flags: every device, process 0 the coordinator."""
    return [["--devices", "all", "--coordinator", f"localhost:{port}", "--num_processes", str(n), "--process_id",
             str(i)] for i in range(n)]


@pytest.fixture(scope="module")
def one_device(wide_gguf, jit_cache) -> dict:
    [(code, out, err)] = finish([start(["--target", wide_gguf, *PROMPT], 1, jit_cache)])
    assert code == 0, err[-3000:]
    return json.loads(out)


def test_two_processes_of_two_devices_decode_one_devices_greedy_ids(wide_gguf, one_device, jit_cache):
    """The target split 4 ways over two processes of 2 CPU devices each (each reads the GGUF and puts its own
    shards on its devices; the all-reduces and all-gathers between processes run on gloo): DDTree with the drafter
    replicated emits one device's greedy ids; process 0 prints the JSON alone (gloo's connection lines going to
    stderr), process 1 nothing."""
    procs = [start(["--target", wide_gguf, *PROMPT, *flags], 2, jit_cache) for flags in over(2, free_port())]
    (code0, out0, err0), (code1, out1, err1) = finish(procs)
    assert code0 == 0 and code1 == 0, (err0[-3000:], err1[-3000:])
    run = json.loads(out0)
    assert run["devices"] == 4 and run["mode"] == "ddtree"
    assert run["tokens"] == one_device["tokens"] and len(run["tokens"]) == 8
    assert out1 == ""
    assert "[Gloo] Rank" in err0 + err1


def test_one_process_through_a_coordinator_runs_as_without(wide_gguf, one_device, jit_cache):
    """--num_processes 1: the command joins a coordinator of its own, --devices all is its one device, and it emits
    what it emits without the flags."""
    [(code, out, err)] = finish([start(["--target", wide_gguf, *PROMPT, *over(1, free_port())[0]], 1, jit_cache)])
    assert code == 0, err[-3000:]
    run = json.loads(out)
    assert run["devices"] == 1 and run["tokens"] == one_device["tokens"]


def test_the_process_flags_go_together_and_are_checked():
    assert processes(None, None, None) == SINGLE_DEVICE
    pcfg = processes("host-0:1234", 2, 1)
    assert (pcfg.coordinator, pcfg.num_processes, pcfg.process_id, pcfg.primary) == ("host-0:1234", 2, 1, False)
    assert processes("localhost:1234", 2, 0).primary
    with pytest.raises(ConfigError, match="go together: --num_processes, --process_id missing"):
        processes("localhost:1234", None, None)
    with pytest.raises(ConfigError, match="go together: --coordinator missing"):
        processes(None, 2, 0)
    for bad, match in ((("localhost", 2, 0), "should be HOST:PORT"), (("localhost:99999", 2, 0), "HOST:PORT"),
                       ((":80", 2, 0), "HOST:PORT"), (("h:80", 0, 0), "num_processes 0 must be at least 1"),
                       (("h:80", 2, 2), r"process_id 2 must be in 0\.\.1"), (("h:80", 2, -1), "process_id -1")):
        with pytest.raises(ConfigError, match=f"--coordinator / --num_processes / --process_id: .*{match}"):
            processes(*bad)
    with pytest.raises(ConfigError, match="need a coordinator"):
        ParallelConfig(num_processes=2, process_id=1)


def test_a_count_other_than_every_processs_devices_is_refused():
    """With processes, --devices is every device of every process (this test's process has 1): another count is
    refused, 'all' takes them."""
    joined = ParallelConfig(coordinator="localhost:1234")
    with pytest.raises(ConfigError, match=r"--devices 2: over 1 process\(es\) the target is split over every device "
                                          r"of every process, 1 here \(pass --devices all\)"):
        parallel_config("2", joined)
    assert parallel_config("all", joined) == ParallelConfig(1, coordinator="localhost:1234")


def test_commands_that_run_in_one_process_refuse_several_before_joining():
    """score, chat, serve and bench.py refuse --num_processes 2 at once (no process waits for a peer)."""
    flags = argparse.Namespace(devices="all", coordinator="localhost:1", num_processes=2, process_id=0)
    with pytest.raises(ConfigError, match="score over several processes \\(--num_processes 2\\) is not implemented: "
                                          "generate runs over several hosts"):
        parallel_from_flags(flags, "score")
