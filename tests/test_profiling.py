"""dflash_jax.profiling: compile seconds per jitted function, profiler traces of decode steps, and the
`generate --profile/--compile_report` flags that use them."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np

from conftest import TINY
from dflash_jax.profiling import CompileLog, StepTrace
from test_generate import generate


def _traces(directory) -> list:
    return sorted([*directory.rglob("*.trace.json.gz"), *directory.rglob("*.xplane.pb")])


def test_compile_log_records_compiles_while_active():
    def _compile_log_probe_inside(x):
        return jnp.sin(x) * 3 + 1

    def _compile_log_probe_after(x):
        return jnp.cos(x) - 2

    with CompileLog() as log:
        jax.block_until_ready(jax.jit(_compile_log_probe_inside)(jnp.arange(7.0)))
    jax.block_until_ready(jax.jit(_compile_log_probe_after)(jnp.arange(7.0)))  # after the context: not recorded

    rows = {r["name"]: r for r in log.rows()}
    inside = [r for name, r in rows.items() if "_compile_log_probe_inside" in name]
    assert len(inside) == 1 and inside[0]["compiles"] >= 1, rows  # a persistent-cache hit still counts
    assert inside[0]["compile_s"] >= 0 and inside[0]["lower_s"] >= 0
    assert not any("_compile_log_probe_after" in name for name in rows), rows
    assert set(inside[0]) == {"name", "compiles", "trace_s", "lower_s", "compile_s"}
    table = log.table().splitlines()
    assert table[0].split()[:2] == ["jitted", "function"] and len(table) == len(rows) + 1
    assert any("_compile_log_probe_inside" in line for line in table[1:])


def _drive(tracer, steps: int, halt_at: int | None = None) -> list:
    """Call on_tokens as Engine.generate does: first with the prefill's token, then once per decode step (each one
    a jitted call on the device); stops early when on_tokens returns True. Returns what each call returned."""
    work = jax.jit(lambda x: jnp.tanh(x @ x.T).sum(axis=0))
    x = jnp.ones((16, 16))
    returned = [tracer([0])]
    for i in range(steps):
        if returned[-1]:
            break
        x = x + work(x)[0]
        jax.block_until_ready(x)
        returned.append(tracer([i + 1, i + 2] if i != halt_at else [-1]))
    return returned


def test_step_trace_traces_the_steps_after_the_first(tmp_path):
    seen = []

    def inner(tokens):
        seen.append(tokens)
        return tokens == [-1]  # a stop string: halt here

    tracer = StepTrace(str(tmp_path / "full"), steps=2, inner=inner)
    assert _drive(tracer, 6) == [False] * 7 and len(seen) == 7 and seen[1] == [1, 2]
    assert tracer.traced_steps == 2
    assert _traces(tmp_path / "full"), "the trace stops by itself after its steps"
    tracer.close()  # already stopped: nothing to do
    assert tracer.traced_steps == 2

    short = StepTrace(str(tmp_path / "short"), steps=8, inner=inner)  # generation ends before 8 steps
    assert _drive(short, 4, halt_at=3) == [False] * 4 + [True]  # inner's True (halt) comes through
    assert short.traced_steps == 3 and not _traces(tmp_path / "short")  # steps 2, 3 and 4; still recording
    short.close()
    assert _traces(tmp_path / "short")

    none = StepTrace(str(tmp_path / "none"), steps=2)  # n_gen 1: only the prefill's token
    assert _drive(none, 0) == [None]
    none.close()
    assert none.traced_steps == 0 and not (tmp_path / "none").exists()


def test_generate_profile_and_compile_report(tiny_gguf_path, jit_cache, tmp_path):
    profile = tmp_path / "profile"
    proc = generate("--target", str(tiny_gguf_path), "--prompt_ids", str(TINY / "tokens.npy"), "--mode", "ar",
                    "--n_gen", "6", "--profile", str(profile), "--profile_steps", "2", "--compile_report", "--json",
                    jit_cache=jit_cache)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["tokens"] == np.load(TINY / "ref.npz")["hf_q_greedy"][:6].tolist()  # tracing changes nothing
    assert out["profile_steps"] == 2 and _traces(profile)
    steps = [r for r in out["compile"] if "_step" in r["name"]]
    assert steps and steps[0]["compiles"] >= 1, out["compile"]
    assert re.search(f"^profile: 2 steps traced into {re.escape(str(profile))} \\(open the .trace.json.gz",
                     proc.stderr, re.MULTILINE), proc.stderr
    assert re.search(r"^jitted function +n +trace s", proc.stderr, re.MULTILINE), proc.stderr
