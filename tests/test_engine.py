"""The speculative step: greedy chain and DDTree output equals greedy autoregressive output, one compilation."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.config import MAX_TREE_NODES, ConfigError, EngineConfig, KernelConfig
from dflash_jax.engine import prefill as prefill_module
from dflash_jax.engine.generate import AHEAD_THREAD, Engine
from dflash_jax.engine.prefill import InputError, split_weights
from dflash_jax.engine.sampling import SamplingParams
from dflash_jax.engine.state import DecodeState, rewind
from dflash_jax.engine.step import MAX_STOP_IDS, DFlashDrafter, make_step
from dflash_jax.kernels import REFERENCE
from dflash_jax.models.target import init_state
from dflash_jax.profiling import CompileLog
from dflash_jax.testing.oracle import OracleDrafter
from dflash_jax.engine.state import tree_bytes
from dflash_jax.testing.tiny import random_draft, random_target, tiny_draft_config, tiny_target_config

SHAPES = dict(interval=2, vocab_size=256, hidden_size=64, intermediate_size=128, num_heads=2, num_kv_heads=1,
              head_dim=32, rope_dim=8, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_value_heads=4)
TCFG = tiny_target_config(num_layers=4, **SHAPES)
BLOCK, N_GEN, MAX_CTX = 8, 24, 192
SEEDS = range(20)
STOP = 7  # a stop token for the stop tests


@pytest.fixture(scope="module")
def tparams():
    return random_target(TCFG, seed=4)


def prompt(seed):
    rng = np.random.default_rng(100 + seed)
    return rng.integers(10, TCFG.vocab_size, int(rng.choice([3, 17, 64, 90])))


@pytest.fixture(scope="module")
def greedy(tparams):
    """Greedy autoregressive output for every seed's prompt: the reference."""
    ar = Engine(TCFG, tparams, EngineConfig(mode="ar", max_ctx=MAX_CTX))
    return {seed: ar.generate(prompt(seed), N_GEN).tokens for seed in SEEDS}


def oracle_engine(tparams, ecfg, error_rate=0.25):
    return Engine(TCFG, tparams, ecfg, OracleDrafter(BLOCK, TCFG.vocab_size, error_rate, seed=1),
                  {"sequence": jnp.zeros(MAX_CTX, jnp.int32)})


def run_oracle(engine, seed, greedy_tokens, n_gen=N_GEN, stop_ids=()):
    ids = prompt(seed)
    sequence = np.zeros(MAX_CTX, np.int32)
    sequence[:len(ids) + N_GEN] = np.concatenate([ids, greedy_tokens])
    engine.dparams = {"sequence": jnp.asarray(sequence)}
    return engine.generate(ids, n_gen, stop_ids=stop_ids)


MODES = [EngineConfig(mode="chain", max_ctx=MAX_CTX)] + [
    EngineConfig(mode="ddtree", budget=b, topk=k, chain_seed=s, max_ctx=MAX_CTX)
    for b, k, s in [(4, 1, True), (4, 4, False), (8, 8, True), (22, 8, True), (22, 1, False), (40, 4, False)]]


@pytest.mark.parametrize("ecfg", MODES, ids=lambda e: e.mode if e.mode == "chain" else
                         f"B{e.budget}-K{e.topk}-{'seed' if e.chain_seed else 'paper'}")
def test_oracle_drafter_is_lossless_and_accepts_deep_paths(tparams, greedy, ecfg):
    engine = oracle_engine(tparams, ecfg)
    lengths, off_spine = [], 0
    for seed in SEEDS:
        out = run_oracle(engine, seed, greedy[seed])
        assert out.tokens == greedy[seed], seed
        lengths += out.accept_lengths
        off_spine += out.off_spine_steps
    deepest = BLOCK if ecfg.mode == "chain" else min(BLOCK, ecfg.budget + 1)  # a full-depth path was accepted
    assert max(lengths) >= deepest and np.mean(lengths) > 1.5, lengths
    # the oracle's errors put the true token at rank 2 or 3: a tree with room beside its spine (budget >= 8) and
    # top-K >= 3 takes some of them as branches; a chain, or a tree of one child a node, has none to take
    if ecfg.mode == "ddtree" and ecfg.topk >= 3 and ecfg.budget >= 8:
        assert off_spine > 0
    elif ecfg.mode == "chain" or ecfg.topk == 1:
        assert off_spine == 0


def test_trees_accept_more_than_the_chain_with_the_same_oracle(tparams, greedy):
    mean = {}
    for ecfg in (MODES[0], MODES[4]):  # chain vs DDTree budget 22, top-8, chain seed
        engine = oracle_engine(tparams, ecfg)
        mean[ecfg.mode] = np.mean([l for s in SEEDS for l in run_oracle(engine, s, greedy[s]).accept_lengths])
    assert mean["ddtree"] > mean["chain"] + 0.3, mean


@pytest.fixture(scope="module")
def random_drafters():
    out = {}
    for name, types, window in [("full", ("full_attention", "full_attention"), None),
                                ("swa", ("sliding_attention", "full_attention"), 5)]:
        dcfg = tiny_draft_config(TCFG, types, block_size=BLOCK, sliding_window=window, taps=(0, 2))
        out[name] = (DFlashDrafter(dcfg), random_draft(dcfg, seed=3))
    return out


@pytest.mark.parametrize("drafter, ecfg", [
    ("full", EngineConfig(mode="chain", max_ctx=MAX_CTX)),
    ("full", EngineConfig(mode="ddtree", budget=22, topk=8, chain_seed=True, max_ctx=MAX_CTX)),
    ("swa", EngineConfig(mode="ddtree", budget=8, topk=4, chain_seed=False, max_ctx=MAX_CTX)),
])
def test_random_dflash_drafter_is_lossless(tparams, greedy, random_drafters, drafter, ecfg):
    engine = Engine(TCFG, tparams, ecfg, *random_drafters[drafter])
    for seed in SEEDS:
        assert engine.generate(prompt(seed), N_GEN).tokens == greedy[seed], seed


COMPILES = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, secs, **kw: COMPILES.append(event) if event == "/jax/core/compile/backend_compile_duration" else None)


@pytest.mark.parametrize("mode", ["ar", "chain", "ddtree"])
def test_one_compilation_per_mode_for_any_prompt_length(tparams, greedy, mode):
    compiles = COMPILES
    engine = oracle_engine(tparams, EngineConfig(mode=mode, budget=12, topk=3, max_ctx=MAX_CTX))
    run_oracle(engine, 0, greedy[0])  # warm-up: compiles the step (and the prefill chunk if new)
    before = len(compiles)
    for seed in range(1, 8):  # prompt lengths 3, 17, 64, 90 and every acceptance pattern
        run_oracle(engine, seed, greedy[seed])
    assert len(compiles) == before, compiles[before:]
    assert engine.step._cache_size() == 1 and engine.tsplit.chunk._cache_size() >= 1


def test_engines_that_differ_only_in_their_prefill_chunk_share_one_step(tparams, greedy):
    """The step does not read the prefill chunk: a second engine with another chunk reuses the first's jitted (and
    compiled) step, and emits the same tokens."""
    a = oracle_engine(tparams, EngineConfig(mode="ddtree", budget=8, max_ctx=MAX_CTX))
    b = oracle_engine(tparams, EngineConfig(mode="ddtree", budget=8, max_ctx=MAX_CTX, prefill_chunk=128))
    assert a.step is b.step and a.tsplit.chunk is not None
    assert run_oracle(a, 3, greedy[3]).tokens == run_oracle(b, 3, greedy[3]).tokens == greedy[3]
    assert b.step._cache_size() == 1


def test_the_step_compiles_on_a_thread_while_the_prompt_is_prefilled(tparams, greedy):
    """With compile_ahead a fresh engine traces and lowers its step before the prefill and compiles it on a thread
    beside the prompt's chunks: the step's first call finds the executable (one compile, on that thread), and emits
    the greedy tokens; a sampled generation compiles the sampled step ahead too, once; a one-token generation
    compiles no step. Without it the step compiles at its first call, on the caller's thread."""
    ahead = dict(mode="ddtree", topk=2, max_ctx=MAX_CTX)  # compile_ahead is the default
    one = oracle_engine(tparams, EngineConfig(budget=11, **ahead))
    engine = oracle_engine(tparams, EngineConfig(budget=10, **ahead))
    plain = oracle_engine(tparams, EngineConfig(mode="ddtree", budget=13, topk=2, max_ctx=MAX_CTX, compile_ahead=False))
    with CompileLog() as log:
        assert run_oracle(plain, 3, greedy[3]).tokens == greedy[3]
        assert log.threads["jit(_step)"] == [threading.current_thread().name]
        log.threads.clear()
        assert len(run_oracle(one, 3, greedy[3], n_gen=1).tokens) == 1
        assert "jit(_step)" not in log.threads
        assert run_oracle(engine, 3, greedy[3]).tokens == greedy[3]
        assert run_oracle(engine, 4, greedy[4]).tokens == greedy[4]
        assert log.threads["jit(_step)"] == [AHEAD_THREAD]
        sampled = SamplingParams(temperature=0.8, seed=3)
        first = engine.generate(prompt(5), N_GEN, sampling=sampled).tokens
        assert engine.generate(prompt(5), N_GEN, sampling=sampled).tokens == first
        assert log.threads["jit(_step)"] == [AHEAD_THREAD, AHEAD_THREAD]


def test_stop_token_and_n_gen_cut_a_commit_mid_path(tparams, greedy):
    seed = next(s for s in SEEDS if STOP not in greedy[s][:1])
    ref = greedy[seed]
    engine = oracle_engine(tparams, EngineConfig(mode="ddtree", budget=22, max_ctx=MAX_CTX), error_rate=0.0)
    stop = ref[9]
    out = run_oracle(engine, seed, ref, stop_ids=[stop])
    assert out.stopped and out.tokens == ref[:ref.index(stop) + 1]
    out = run_oracle(engine, seed, ref, n_gen=11)
    assert out.tokens == ref[:11] and not out.stopped and sum(out.accept_lengths) + 1 == 11


def test_on_tokens_can_halt_a_generation(tparams, greedy):
    """A caller ends a run from its token callback (a stop string, a client gone): no more calls, no state."""
    ref = greedy[3]
    engine = oracle_engine(tparams, EngineConfig(mode="ddtree", budget=8, max_ctx=MAX_CTX), error_rate=0.3)
    engine.dparams = {"sequence": jnp.zeros(MAX_CTX, jnp.int32).at[:len(prompt(3)) + N_GEN].set(
        np.concatenate([prompt(3), ref]))}
    calls = []
    out = engine.generate(prompt(3), N_GEN, on_tokens=lambda new: calls.append(new) or sum(map(len, calls)) >= 5)
    assert out.halted and out.state is None and not out.stopped
    assert out.tokens == sum(calls, []) and len(out.tokens) >= 5 and out.tokens == ref[:len(out.tokens)]
    assert len(calls) == next(i + 1 for i in range(len(calls)) if sum(map(len, calls[:i + 1])) >= 5)
    out = engine.generate(prompt(3), N_GEN)  # the engine is still usable
    assert out.tokens == ref and not out.halted and out.state is not None


def test_bad_engine_input_is_refused_before_any_compute(tparams):
    for kwargs, message in [(dict(budget=0), "budget 0"), (dict(budget=64), "at most 64"), (dict(topk=0), "topk 0"),
                            (dict(mode="beam"), "mode 'beam'")]:
        with pytest.raises(ConfigError, match=message):
            EngineConfig(**kwargs)
    with pytest.raises(ValueError, match="needs a drafter"):
        Engine(TCFG, tparams, EngineConfig(mode="chain"))
    engine = Engine(TCFG, tparams, EngineConfig(mode="ar", max_ctx=32))
    with pytest.raises(InputError, match="exceeds the context of 32"):
        engine.generate(np.arange(20), 13)
    with pytest.raises(InputError, match="outside the vocabulary"):
        engine.generate([1, TCFG.vocab_size], 4)


@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_a_conversation_continues_from_its_state(tparams, random_drafters, mode):
    """Turn 2 prefills only the pending token and its new ids, and says what a fresh run of the whole context says."""
    ecfg = EngineConfig(mode=mode, budget=8, topk=4, max_ctx=MAX_CTX)
    engine = Engine(TCFG, tparams, ecfg, *random_drafters["full"]) if mode != "ar" else Engine(TCFG, tparams, ecfg)
    fresh = Engine(TCFG, tparams, EngineConfig(mode="ar", max_ctx=MAX_CTX))
    first, second = prompt(1), np.arange(20, 25)
    turn1 = engine.generate(first, 10)
    turn2 = engine.generate(second, 10, after=turn1.state)
    assert turn2.tokens == fresh.generate(np.concatenate([first, turn1.tokens, second]), 10).tokens
    assert int(turn2.state.target.length) == len(first) + 10 + len(second) + 9  # the last reply token is pending
    turn3 = engine.generate(second, 10, after=turn2.state, keep_pending=False)  # a chat drops a pending stop token
    context = np.concatenate([first, turn1.tokens, second, turn2.tokens[:-1], second])
    assert turn3.tokens == fresh.generate(context, 10).tokens
    with pytest.raises(InputError, match="committed tokens \\+ prompt of"):
        engine.generate(np.arange(10, 10 + MAX_CTX), 1, after=turn3.state)


def test_a_conversation_rewinds_to_a_mark_and_goes_on_as_a_fresh_run(tparams, random_drafters):
    """A mark taken inside turn 1's prompt outlives the turn: turns 2 and 3 set the last state back to it, prefill
    only what follows, and hold what a fresh prefill of their whole ids holds (to float rounding: the prefill's chunks
    split elsewhere), so they say what a fresh run says."""
    engine = Engine(TCFG, tparams, EngineConfig(mode="ddtree", budget=8, topk=4, max_ctx=MAX_CTX),
                    *random_drafters["full"])
    rng = np.random.default_rng(7)
    first, at = rng.integers(10, TCFG.vocab_size, 100), 70  # the mark inside the second prefill chunk
    turn1 = engine.generate(first, 10, mark_at=at)
    assert turn1.tokens == engine.generate(first, 10).tokens and int(turn1.mark.length) == at
    last = turn1.state
    for n_new in (12, 5):  # turn 2, then turn 3 back at the same mark
        ids = np.concatenate([first[:at], rng.integers(10, TCFG.vocab_size, n_new)])
        state, token = engine.start(ids[at:], 10, after=rewind(last, turn1.mark), keep_pending=False)
        got, want = committed(state), committed(engine.start(ids, 10)[0])
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=name)
        turn = engine.decode(state, token, 10)
        assert turn.tokens == engine.generate(ids, 10).tokens
        last = turn.state
    length = int(last.target.length)
    turn = engine.generate(first[:3], 4, after=last, mark_at=2)  # after the pending token and 2 of the prompt
    assert int(turn.mark.length) == length + 3


def test_a_step_after_done_emits_nothing_and_leaves_the_state(tparams, random_drafters):
    """The host loop queues one step past the end of a generation; its state continues a chat, so that step must
    leave it as it was."""
    engine = Engine(TCFG, tparams, EngineConfig(mode="ddtree", budget=8, topk=4, max_ctx=MAX_CTX),
                    *random_drafters["full"])
    state, _ = engine.start(prompt(1), 1)
    assert bool(state.done)
    state_copy = jax.tree.map(jnp.copy, state)  # the step consumes (donates) its state
    before = committed(state)
    after, out = engine.step(engine.tweights, engine.dweights, state, engine.stop_array(()))
    assert int(out.count) == 0 and not np.any(np.asarray(out.tokens))
    jax.tree.map(np.testing.assert_array_equal, committed(after), before)
    turn = engine.generate(prompt(2), 6, after=after)  # and the chat goes on as if that step had not run
    assert turn.tokens == engine.generate(prompt(2), 6, after=state_copy).tokens


def committed(state: DecodeState) -> dict:
    """What a later step reads of a decode state: every cache slot below the committed length, and the rest whole."""
    t, d = state.target, state.draft
    n, m = int(t.length), int(d.length)
    return dict(k=np.asarray(t.k[:, :n]), v=np.asarray(t.v[:, :n]), conv=np.asarray(t.conv), ssm=np.asarray(t.ssm),
                length=n, dk=[np.asarray(x[:, :m]) for x in d.k], dv=[np.asarray(x[:, :m]) for x in d.v], dlength=m,
                root=int(state.root), remaining=int(state.remaining), done=bool(state.done))


@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_the_step_updates_its_donated_state_in_place(mode):
    """The compiled step's temporaries stay well below the state it is given: no second copy of the caches. A
    lax.cond around the step, caches unstacked per layer and stacked back, and the KV commit's write not ordered
    after the reads of the cache each made XLA copy them (temporaries were 1.3-1.5x the state here)."""
    cfg = tiny_target_config(num_layers=8, **SHAPES)
    dcfg = tiny_draft_config(cfg, ("full_attention",) * 4, block_size=BLOCK, taps=(0, 2))
    drafter = DFlashDrafter(dcfg) if mode != "ar" else None
    max_ctx = 4096  # the caches dominate: each attention layer's own temporaries are a small part of the state
    state = DecodeState(target=init_state(cfg, max_ctx + MAX_TREE_NODES),
                        draft=drafter.init_state(max_ctx, ("f32", "f32"), None) if drafter else None,
                        root=jnp.int32(1), remaining=jnp.int32(10), done=jnp.bool_(False))
    (tgraph, tweights), (dgraph, dweights) = split_weights(random_target(cfg, seed=4)), split_weights(
        random_draft(dcfg, seed=3) if drafter else None)
    step = make_step(cfg, drafter, EngineConfig(mode=mode, budget=22, max_ctx=max_ctx), tgraph, dgraph)
    memory = step.lower(tweights, dweights, state,
                        jnp.full(MAX_STOP_IDS, -1, jnp.int32)).compile().memory_analysis()
    assert memory.alias_size_in_bytes == tree_bytes(state)
    assert memory.temp_size_in_bytes < 0.5 * tree_bytes(state), (memory.temp_size_in_bytes, tree_bytes(state))


def test_prefill_and_the_drafter_context_update_their_donated_state_in_place():
    """A prompt chunk and the drafter's context extension write the caches they are given: each compiled call
    aliases its whole state to its output, with temporaries well below it (without donation every 64-token chunk
    held a second copy of the caches: 2 x 4.3 GB at 32K for the 27B's float32 ones). Wide KV heads, so that the
    reference attention's scores over the cache ([64 queries, heads, slots] temporaries) stay below one copy."""
    cfg = tiny_target_config(num_layers=8, **{**SHAPES, "num_heads": 4, "num_kv_heads": 4, "head_dim": 128})
    dcfg = tiny_draft_config(cfg, ("full_attention",) * 4, block_size=BLOCK, taps=(0, 2))
    drafter, max_ctx = DFlashDrafter(dcfg), 4096
    engine = Engine(cfg, random_target(cfg, seed=4), EngineConfig(mode="ddtree", max_ctx=max_ctx), drafter,
                    random_draft(dcfg, seed=3))
    tstate, dstate = init_state(cfg, max_ctx), drafter.init_state(max_ctx, ("f32", "f32"), None)
    chunk = prefill_module.DEFAULT_CHUNK
    calls = [(engine.tsplit.chunk, (engine.tweights, cfg, tstate, jnp.zeros(chunk, jnp.int32), jnp.int32(chunk),
                                    drafter.taps, False), tstate),
             (engine.extend, (engine.dweights, dstate, jnp.zeros((chunk, 2, cfg.hidden_size)), jnp.int32(chunk)),
              dstate)]
    for fn, args, state in calls:
        memory = fn.lower(*args).compile().memory_analysis()
        assert memory.alias_size_in_bytes == tree_bytes(state)
        assert memory.temp_size_in_bytes < 0.5 * tree_bytes(state), (memory.temp_size_in_bytes, tree_bytes(state))


def test_two_kernel_configurations_in_one_process_give_their_own_results(tparams):
    """The KernelConfig is a static argument of the jitted functions, so one process runs two configurations side by
    side, each with its own result, no `jax.clear_caches()` between them (a module setting rebound after a first
    call was silently ignored). Here the reference and the Pallas (interpret mode) attention and delta-rule kernels
    over the same reference-product weights: close, not equal (the kernels multiply in bf16)."""
    ids = prompt(3)

    def logits(kcfg):
        out, _, _ = prefill_module.prefill(tparams, TCFG, init_state(TCFG, 128), ids, kcfg=kcfg)
        return np.asarray(out)

    reference, pallas = REFERENCE, KernelConfig(impl="pallas", interpret=True)
    runs = [logits(reference), logits(pallas), logits(reference), logits(pallas)]
    np.testing.assert_array_equal(runs[0], runs[2])
    np.testing.assert_array_equal(runs[1], runs[3])
    assert not np.array_equal(runs[0], runs[1])
    assert np.linalg.norm(runs[1] - runs[0]) / np.linalg.norm(runs[0]) < 2e-2
    assert int(np.argmax(runs[0])) == int(np.argmax(runs[1]))


def test_state_bytes_counts_what_a_generation_allocates(tparams, random_drafters):
    """The check against free memory (`generate`) counts, from shapes alone, the caches `start` then allocates."""
    engine = Engine(TCFG, tparams, EngineConfig(mode="ddtree", budget=8, max_ctx=MAX_CTX), *random_drafters["full"])
    state, _ = engine.start(prompt(1), 4)
    assert engine.state_bytes() == tree_bytes(state.target) + tree_bytes(state.draft)
