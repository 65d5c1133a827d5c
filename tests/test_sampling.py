"""Sampling: the coupled Gumbel rule draws from the filtered softmax, its filters keep what they should, and chain and
DDTree emit exactly AR's sampled tokens for a seed (oracle and random drafters, every mode and budget)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.config import EngineConfig
from dflash_jax.engine.generate import Engine
from dflash_jax.engine.sampling import (GREEDY, SamplingError, SamplingParams, filtered_scores, gumbel_noise,
                                        sample)
from test_engine import (BLOCK, MAX_CTX, N_GEN, SEEDS, TCFG, oracle_engine, prompt,  # noqa: F401 (fixtures)
                         random_drafters, tparams)

# a chi-square statistic above this for 7 degrees of freedom happens by chance about once in 10^5
CHI2_LIMIT = 36.0


def draws(logits: np.ndarray, sp: SamplingParams, seeds: int, position: int = 11) -> np.ndarray:
    """The token one row of logits draws at `position` for seeds 0..seeds-1."""
    row = jnp.asarray(logits, jnp.float32)[None]
    dev = sp.device()

    @jax.jit
    def one(seed):
        noise = gumbel_noise(seed, jnp.asarray([position]), row.shape[-1])
        return sample(row, noise, dataclasses.replace(dev, seed=seed))[0]

    return np.asarray(jax.vmap(one)(jnp.arange(seeds, dtype=jnp.uint32)))


def filtered_softmax(logits: np.ndarray, sp: SamplingParams) -> np.ndarray:
    z = np.asarray(filtered_scores(jnp.asarray(logits, jnp.float32)[None], sp.device()))[0]
    p = np.exp(z - z.max())
    return p / p.sum()


@pytest.mark.parametrize("name,logits,sp", [
    ("peaked", np.array([4.0, 2.5, 2.0, 1.0, 0.0, -1.0, -3.0, 0.5]), SamplingParams(temperature=0.7)),
    ("flat", np.array([0.1, 0.0, -0.1, 0.05, 0.0, -0.05, 0.2, 0.1]), SamplingParams(temperature=1.0)),
    ("hot", np.array([4.0, 2.5, 2.0, 1.0, 0.0, -1.0, -3.0, 0.5]), SamplingParams(temperature=1.5)),
])
def test_frequencies_follow_the_softmax(name, logits, sp):
    """Over 20,000 seeds at one position the drawn tokens' frequencies match softmax(logits / T)."""
    n = 20000
    counts = np.bincount(draws(logits, sp, n), minlength=len(logits))
    expected = n * filtered_softmax(logits, sp)
    chi2 = float(np.sum((counts - expected) ** 2 / expected))
    assert chi2 < CHI2_LIMIT, (name, chi2, counts, expected.round())


def test_filters_keep_exactly_their_tokens():
    """top-k keeps the k largest (ties at the k-th all kept), top-p the smallest head reaching p (ties at its last
    all kept), min-p those at least min_p as likely as the best; each draw lands in the kept set."""
    logits = np.array([3.0, 2.0, 2.0, 1.0, 1.0, 1.0, 0.0, -1.0])
    kept = lambda sp: set(np.flatnonzero(np.isfinite(np.asarray(  # noqa: E731
        filtered_scores(jnp.asarray(logits)[None], sp.device()))[0])).tolist())
    assert kept(SamplingParams(temperature=1.0)) == set(range(8))
    assert kept(SamplingParams(temperature=1.0, top_k=1)) == {0}
    assert kept(SamplingParams(temperature=1.0, top_k=2)) == {0, 1, 2}  # a tie at the 2nd
    assert kept(SamplingParams(temperature=1.0, top_k=4)) == {0, 1, 2, 3, 4, 5}
    p = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    assert kept(SamplingParams(temperature=1.0, top_p=float(p[0]) * 0.99)) == {0}
    assert kept(SamplingParams(temperature=1.0, top_p=float(p[0] + p[1]) * 0.99)) == {0, 1, 2}  # its tie kept
    assert kept(SamplingParams(temperature=1.0, top_p=float(p[:3].sum()) * 1.01)) == {0, 1, 2, 3, 4, 5}
    assert kept(SamplingParams(temperature=1.0, top_k=2, top_p=0.5)) == {0}  # top-p over top-k's renormalised set
    assert kept(SamplingParams(temperature=1.0, min_p=float(np.exp(-1.0)) * 0.99)) == {0, 1, 2}
    sp = SamplingParams(temperature=1.0, top_k=3)
    assert set(draws(logits, sp, 2000).tolist()) == {0, 1, 2}


def test_low_temperature_is_greedy_and_positions_draw_apart():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 300)).astype(np.float32)
    noise = gumbel_noise(jnp.uint32(5), jnp.arange(6), 300)
    cold = sample(jnp.asarray(logits), noise, SamplingParams(temperature=1e-4, seed=5).device())
    assert np.array_equal(np.asarray(cold), logits.argmax(-1))
    assert np.array_equal(np.asarray(sample(jnp.asarray(logits), None, None)), logits.argmax(-1))
    # a position's noise is its own: drawn alone or among others, and different at another position or seed
    alone = gumbel_noise(jnp.uint32(5), jnp.asarray([3]), 300)
    np.testing.assert_array_equal(np.asarray(alone[0]), np.asarray(noise[3]))
    assert not np.allclose(noise[2], noise[3])
    assert not np.allclose(gumbel_noise(jnp.uint32(6), jnp.asarray([3]), 300)[0], noise[3])


def test_bad_parameters_are_refused():
    for kwargs, message in [(dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "finite"),
                            (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"),
                            (dict(min_p=1.0), "min_p"), (dict(seed=-1), "seed"), (dict(seed=2 ** 32), "seed"),
                            (dict(top_k=2.5), "integer"), (dict(temperature=True), "finite number")]:
        with pytest.raises(SamplingError, match=message):
            SamplingParams(**kwargs)
    assert GREEDY.greedy and GREEDY.device() is None


# every temperature x filter, one combination a prompt, so that each mode meets all twelve over the 20 prompts
SETTINGS = [SamplingParams(temperature=t, seed=s, **f) for s, (t, f) in enumerate(
    (t, f) for t in (0.3, 0.7, 1.0, 1.5) for f in ({"top_p": 0.9}, {"top_k": 20}, {}))]
SAMPLED_MODES = [EngineConfig(mode="chain", max_ctx=MAX_CTX)] + [
    EngineConfig(mode="ddtree", budget=b, topk=k, max_ctx=MAX_CTX) for b, k in [(4, 4), (8, 8), (22, 8), (40, 4)]]


def setting(seed: int) -> SamplingParams:
    return SETTINGS[seed % len(SETTINGS)]


@pytest.fixture(scope="module")
def sampled(tparams):
    """AR's sampled output for every prompt under its setting: the reference."""
    ar = Engine(TCFG, tparams, EngineConfig(mode="ar", max_ctx=MAX_CTX))
    return {seed: ar.generate(prompt(seed), N_GEN, sampling=setting(seed)).tokens for seed in SEEDS}


@pytest.mark.parametrize("ecfg", SAMPLED_MODES, ids=lambda e: e.mode if e.mode == "chain" else f"B{e.budget}")
def test_sampled_speculation_equals_sampled_ar(tparams, sampled, random_drafters, ecfg):
    """The oracle (proposing AR's sampled tokens, with errors) and a random DFlash drafter, each over 20 prompts:
    every token equal to AR's; the oracle's trees accept deep paths, so the equality covers deep nodes' draws."""
    oracle = oracle_engine(tparams, ecfg)
    lengths = []
    for seed in SEEDS:
        ids = prompt(seed)
        sequence = np.zeros(MAX_CTX, np.int32)
        sequence[:len(ids) + N_GEN] = np.concatenate([ids, sampled[seed]])
        oracle.dparams = {"sequence": jnp.asarray(sequence)}
        out = oracle.generate(ids, N_GEN, sampling=setting(seed))
        assert out.tokens == sampled[seed], seed
        lengths += out.accept_lengths
    assert np.mean(lengths) > 1.5, lengths
    engine = Engine(TCFG, tparams, ecfg, *random_drafters["full"])
    for seed in SEEDS:
        assert engine.generate(prompt(seed), N_GEN, sampling=setting(seed)).tokens == sampled[seed], seed


@pytest.mark.parametrize("rule", ["tempered", "plain"])
def test_every_draft_rule_is_exact(tparams, sampled, random_drafters, rule):
    ecfg = EngineConfig(mode="ddtree", budget=8, topk=4, max_ctx=MAX_CTX, draft_rule=rule)
    engine = Engine(TCFG, tparams, ecfg, *random_drafters["swa"])
    for seed in SEEDS[:8]:
        assert engine.generate(prompt(seed), N_GEN, sampling=setting(seed)).tokens == sampled[seed], seed


def test_a_seed_reproduces_and_another_differs(tparams):
    ar = Engine(TCFG, tparams, EngineConfig(mode="ar", max_ctx=MAX_CTX))
    a, b, c = (ar.generate(prompt(2), N_GEN, sampling=SamplingParams(temperature=1.0, seed=s)).tokens
               for s in (4, 4, 5))
    assert a == b and a != c


def test_a_sampled_chat_replies_the_same_in_every_mode():
    """Two turns of a chat on the shipped pair, sampled with one seed: ar and ddtree give the same replies (each
    token's noise comes from its position in the conversation, the second turn continuing the first's state)."""
    from dflash_jax import assets
    from dflash_jax.chat import Conversation
    from dflash_jax.defaults import resolve_engine, resolve_kernels
    from dflash_jax.generate import load_models

    replies = {}
    for mode in ("ar", "ddtree"):
        models = load_models(assets.DEFAULT_TARGET, assets.DEFAULT_DRAFT, mode, resolve_kernels(mode), progress=False)
        engine = Engine.from_loaded(models.target, models.draft if mode != "ar" else None,
                                    resolve_engine(mode, max_ctx=512))
        chat = Conversation(engine, models.tokenizer, n_gen=24, sampling=SamplingParams(temperature=0.8, seed=3))
        texts = []
        for line in ("Hello", "And again"):
            chat.reply(line, texts.append)
        replies[mode] = [m["content"] for m in chat.messages if m["role"] == "assistant"]
    assert replies["ar"] == replies["ddtree"] and all(replies["ar"]), replies
