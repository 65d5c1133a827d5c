"""Lowered programs kept between processes (dflash_jax/engine/programs.py): a stored program is called instead of
tracing the function again, gives its results and donates what it donated; anything that cannot be kept falls back
to the function; the engine's step and prefill chunk through it decode what they decode without it; and
`generate --program_cache` as users run it, twice."""

import json
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT, TINY
from dflash_jax.config import EngineConfig
from dflash_jax.defaults import resolve_kernels
from dflash_jax.engine import programs
from dflash_jax.engine.generate import Engine
from dflash_jax.load import load_draft, load_target
from dflash_jax.profiling import CompileLog


def counting():
    """A jitted function of (weights, state, x) that records each trace, its state donated."""
    traces = []

    def f(w, s, x):
        traces.append(1)
        return {"s": s + x @ w["a"], "n": jnp.sum(x)}, (x * 2,)

    return jax.jit(f, donate_argnums=(1,)), traces


def test_a_stored_program_replaces_tracing(tmp_path):
    w, x = {"a": jnp.arange(16.0).reshape(4, 4)}, jnp.arange(4.0)
    f, traces = counting()
    first = programs.stored(f, "f", str(tmp_path), donate=(1,))(w, jnp.ones(4), x)
    assert len(traces) == 1 and len(list(tmp_path.glob("*" + programs.SUFFIX))) == 1
    f, traces = counting()  # a new function: as a later process has it
    later = programs.stored(f, "f", str(tmp_path), donate=(1,))
    state = jnp.ones(4)
    again = later(w, state, x)
    assert traces == [] and state.is_deleted()
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), first, again))
    # another signature, another description: new programs
    later(w, jnp.ones(4), jnp.arange(4.0) + 1)
    programs.stored(counting()[0], "g", str(tmp_path), donate=(1,))(w, jnp.ones(4), x)
    assert len(list(tmp_path.glob("*" + programs.SUFFIX))) == 2
    assert programs.stored(f, "f", "") is f


def test_a_kept_program_compiled_ahead_is_what_its_call_runs(tmp_path):
    """`stored(...).lower` with abstract arguments lowers the program a call with such arguments runs: compiled
    ahead, the call compiles nothing more, and gives the function's results."""
    w, x = {"a": jnp.arange(16.0).reshape(4, 4) / 8}, jnp.arange(4.0)
    f, traces = counting()
    kept = programs.stored(f, "ahead", str(tmp_path), donate=(1,))
    with CompileLog() as log:
        kept.lower(w, jax.ShapeDtypeStruct((4,), jnp.float32), x).compile()
        assert log.compiles["jit(f)"] == 1
        out, _ = kept(w, jnp.ones(4), x)
        assert log.compiles["jit(f)"] == 1 and traces == [1]
    assert np.array_equal(np.asarray(out["s"]), np.ones(4) + np.asarray(x @ w["a"]))
    assert programs.stored(f, "ahead", "") is f  # no folder: the function itself, whose lower is jax's


def test_a_program_that_cannot_be_kept_is_traced(tmp_path):
    """A stored file that does not load (a truncated write of another version, say) warns and traces the function."""
    w, x = {"a": jnp.eye(4)}, jnp.arange(4.0)
    f, _ = counting()
    programs.stored(f, "f", str(tmp_path), donate=(1,))(w, jnp.ones(4), x)
    (path,) = tmp_path.glob("*" + programs.SUFFIX)
    path.write_bytes(b"not a program")
    f, traces = counting()
    with pytest.warns(UserWarning, match="not kept"):
        out, _ = programs.stored(f, "f", str(tmp_path), donate=(1,))(w, jnp.ones(4), x)
    assert traces == [1] and np.array_equal(np.asarray(out["s"]), np.ones(4) + np.arange(4.0))


def test_the_engine_decodes_the_same_through_kept_programs(tiny_gguf_path, tmp_path):
    """A DDTree engine with program_cache set keeps its step and prefill chunk and emits the tokens an engine
    without it emits."""
    target = load_target(tiny_gguf_path, progress=False)
    draft = load_draft(TINY / "draft-full", target.config, progress=False)
    ids = np.load(TINY / "tokens.npy")
    tokens = {}
    for folder in ("", str(tmp_path)):
        ecfg = EngineConfig(mode="ddtree", budget=8, max_ctx=256, program_cache=folder)
        engine = Engine.from_loaded(target, draft, ecfg)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # a program that was not kept would warn
            tokens[folder] = engine.generate(ids, 12).tokens
    assert tokens[""] == tokens[str(tmp_path)]
    assert len(list(tmp_path.glob("*" + programs.SUFFIX))) == 2  # the step and the prefill chunk


def test_generate_keeps_its_programs_between_runs(tiny_gguf_path, tmp_path):
    """`generate` twice with its defaults (--program_cache on): the first run writes the step's and the chunk's
    programs into --jit_cache's programs/, the second reads them (nothing rewritten) and prints the same ids;
    --noprogram_cache keeps none, and --program_cache given with --jit_cache off is refused."""
    cache = tmp_path / "jit"
    args = [sys.executable, "-m", "dflash_jax.generate", "--target", str(tiny_gguf_path), "--draft",
            str(TINY / "draft-full"), "--prompt_ids", str(TINY / "tokens.npy"), "--n_gen", "8", "--json"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    run = lambda *extra: subprocess.run(args + list(extra), capture_output=True, text=True, cwd=ROOT,  # noqa: E731
                                        env=env, timeout=300)

    def kept(folder):
        return {p: p.stat().st_mtime_ns for p in (folder / "programs").glob("*" + programs.SUFFIX)}

    first = run(f"--jit_cache={cache}")
    assert first.returncode == 0, first.stderr
    stored = kept(cache)
    assert len(stored) == 2
    second = run(f"--jit_cache={cache}")
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout)["tokens"] == json.loads(first.stdout)["tokens"]
    assert kept(cache) == stored
    off = run(f"--jit_cache={tmp_path / 'off'}", "--noprogram_cache")
    assert off.returncode == 0, off.stderr
    assert json.loads(off.stdout)["tokens"] == json.loads(first.stdout)["tokens"]
    assert not kept(tmp_path / "off")
    refused = run("--jit_cache=", "--program_cache")
    assert refused.returncode == 2 and "--program_cache" in refused.stderr


@pytest.mark.gpu
def test_kept_programs_on_the_gpu_kernels(tiny_gguf_path, tmp_path):
    """On the device's kernels (Pallas; on Hopper the Mosaic GPU products, custom calls the export must carry): a
    DDTree engine keeps its step and chunk and, running the exported programs, emits what one without them emits."""
    kcfg = resolve_kernels("ddtree")
    target = load_target(tiny_gguf_path, progress=False, kcfg=kcfg)
    draft = load_draft(TINY / "draft-full", target.config, progress=False, kcfg=kcfg)
    ids = np.load(TINY / "tokens.npy")
    tokens = {}
    for folder in ("", str(tmp_path)):
        engine = Engine.from_loaded(target, draft, EngineConfig(mode="ddtree", budget=8, max_ctx=256,
                                                                program_cache=folder), kcfg=kcfg)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            tokens[folder] = engine.generate(ids, 12).tokens
    assert tokens[""] == tokens[str(tmp_path)]
    assert len(list(tmp_path.glob("*" + programs.SUFFIX))) == 2
