"""The prefix cache: snapshots of decode states that later prompts continue from. The cache's lookup and eviction
alone; snapshots restored bit for bit, and a run from one equal to a fresh run (greedy and sampled; a q8_0 cache's
blocks too); the server with the real `openai` and `anthropic` clients: conversations that share a system prompt
(chat, Messages, Responses), a conversation that comes back after another, eviction under a small budget; serve's
budget flag."""

import anthropic
import jax
import numpy as np
import openai
import pytest

from dflash_jax import kv_quant as kvq
from dflash_jax.chat_template import render
from dflash_jax.config import EngineConfig
from dflash_jax.engine.generate import Engine
from dflash_jax.engine.sampling import SamplingParams
from dflash_jax.engine.state import PAGE, Mark, Snapshot
from dflash_jax.generate import UsageError
from dflash_jax.load import load_draft, load_target
from dflash_jax.serve import prefix_cache_bytes
from dflash_jax.server import budget
from dflash_jax.server.prefix_cache import PrefixCache
from dflash_jax.server.reply import THINK_CLOSE
from test_engine import TCFG, random_drafters, tparams  # noqa: F401 (fixtures)
from test_server import Server, claude, oai  # noqa: F401 (fixtures, on this module's server)
from test_server_tools import QWEN35, blocks

SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, seed=11)


# ---------------------------------------------------------------------------------------------------------------
# The cache alone


def fake_snapshot(length: int, nbytes: int) -> Snapshot:
    """A snapshot of `length` ids holding `nbytes` bytes (a 4-byte length, the rest in its conv state; host arrays,
    which the cache counts as it counts device ones)."""
    mark = Mark(conv=np.zeros((nbytes - 4) // 4, np.float32), ssm=np.zeros(0, np.float32), length=np.int32(length))
    return Snapshot(length, mark, ())


def test_lookup_takes_the_longest_snapshot_that_is_a_strict_prefix():
    cache = PrefixCache(10_000)
    for ids in ([1, 2], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [1, 9, 9]):
        assert cache.add(ids, fake_snapshot(len(ids), 100))
    assert cache.lookup([1, 2, 3, 4, 5, 7]).length == 4
    assert cache.lookup([1, 2, 3, 4, 5, 6, 0]).length == 6
    assert cache.lookup([1, 2, 3, 4, 5, 6]).length == 4  # not the whole prompt: its last id must run
    assert cache.lookup([1, 2, 3, 4, 5, 6, 0], longer_than=6) is None  # the live state holds as much
    assert cache.lookup([1, 2, 3, 4, 5, 6, 0], longer_than=3).length == 6
    assert cache.lookup([1, 9, 9, 9]).length == 3 and cache.lookup([2, 1, 2, 3]) is None
    assert cache.lookup([1]) is None and [1, 2, 3, 4] in cache and [1, 2, 3] not in cache
    with pytest.raises(ValueError, match="a snapshot of 3 tokens filed under 2 ids"):
        cache.add([5, 6], fake_snapshot(3, 100))


def test_the_least_recently_used_go_first_and_the_bytes_stay_within_the_budget():
    cache = PrefixCache(1000)
    for i in range(3):
        assert cache.add([i] * 5, fake_snapshot(5, 300))
    assert cache.nbytes == 900 and len(cache) == 3
    assert cache.lookup([0] * 6).length == 5  # a use: [0]*5 is now the most recent
    assert cache.add([7] * 5, fake_snapshot(5, 300))  # 1200 > 1000: the least recently used, [1]*5, goes
    assert cache.keys() == [(2,) * 5, (0,) * 5, (7,) * 5] and cache.nbytes == 900
    assert cache.add([8] * 5, fake_snapshot(5, 700))  # two must go for it
    assert cache.keys() == [(7,) * 5, (8,) * 5] and cache.nbytes == 1000
    assert not cache.add([9] * 5, fake_snapshot(5, 1004))  # larger than the budget: not kept, nothing dropped
    assert cache.keys() == [(7,) * 5, (8,) * 5]
    assert cache.add([7] * 5, fake_snapshot(5, 100))  # the same ids: replaced, now the most recent
    assert cache.keys() == [(8,) * 5, (7,) * 5] and cache.nbytes == 800
    rng, sizes = np.random.default_rng(0), {(8,) * 5: 700, (7,) * 5: 100}
    for _ in range(200):
        ids, size = tuple(rng.integers(0, 3, int(rng.integers(1, 6))).tolist()), int(rng.integers(1, 250)) * 4 + 4
        assert cache.add(ids, fake_snapshot(len(ids), size)) and cache.keys()[-1] == ids
        sizes[ids] = size
        assert cache.nbytes == sum(sizes[k] for k in cache.keys()) <= 1000
    assert not PrefixCache(0).enabled and not PrefixCache(0).add([1], fake_snapshot(1, 4))


# ---------------------------------------------------------------------------------------------------------------
# Snapshots of the engine's state

CTX = 640  # room for prompts over a page of PAGE slots


def engine_for(mode, tparams, random_drafters):
    ecfg = EngineConfig(mode=mode, budget=8, topk=4, max_ctx=CTX)
    return Engine(TCFG, tparams, ecfg, *random_drafters["full"]) if mode != "ar" else Engine(TCFG, tparams, ecfg)


def rows(cache, n: int) -> np.ndarray:
    """Slots 0..n-1 of a cache: a float cache's values, a block cache's blocks as llama.cpp's bytes (every field)."""
    if isinstance(cache, kvq.KVBlocks):
        return kvq.block_bytes(jax.tree.map(lambda x: x[:, :n], cache))
    return np.asarray(cache[:, :n])


def held(state) -> dict:
    """What a later step reads of a state's caches: the target's and the drafter's (if any) slots below the committed
    length, the recurrent state and the lengths."""
    t, n = state.target, int(state.target.length)
    out = dict(k=rows(t.k, n), v=rows(t.v, n), conv=t.conv, ssm=t.ssm, length=t.length)
    if state.draft is not None:
        d, m = state.draft, int(state.draft.length)
        out.update({f"d{name}{g}": rows(c, m) for name in "kv" for g, c in enumerate(getattr(d, name))})
        out.update(dlength=d.length, dstart=d.start)
    return {name: np.asarray(x) for name, x in out.items()}


def assert_same(got, want):
    """`held` of two states is equal bit for bit."""
    got, want = held(got), held(want)
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def ids_of(seed, n):
    return np.random.default_rng(seed).integers(10, TCFG.vocab_size, n)


@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_a_snapshot_restores_the_state_bit_for_bit(tparams, random_drafters, mode):
    """Snapshots inside a prompt (one page, and two with the second partly used) and at a reply's end hold exactly the
    state at their point, cost the rows they hold, and a state restored from one is zero past its length."""
    assert PAGE == 256
    engine = engine_for(mode, tparams, random_drafters)
    ids = ids_of(1, 300)
    gen = engine.generate(ids, 8, snapshot_at=(100, 300), mark_at=100)
    short, long = gen.snapshots
    assert (short.length, long.length) == (100, 300) and short.mark is gen.mark and len(long.pages) == 2
    empty = engine.restore(short)
    row_bytes = sum(c.nbytes // c.shape[1] for c in (empty.target.k, empty.target.v) + (
        () if mode == "ar" else (*empty.draft.k, *empty.draft.v)))
    starts = 0 if mode == "ar" else empty.draft.start.nbytes
    for snap, pages in ((short, 1), (long, 2)):
        assert snap.nbytes == gen.mark.conv.nbytes + gen.mark.ssm.nbytes + 4 + starts + pages * PAGE * row_bytes
    assert_same(engine.restore(short), engine.start(ids[:100], 1)[0])
    split = engine.generate(ids, 1, mark_at=100).state  # prefilled in the same two parts
    restored = engine.restore(long)
    assert_same(restored, split)
    assert not np.asarray(restored.target.k[:, 300:]).any() and not np.asarray(restored.target.v[:, 300:]).any()
    end = engine.snapshot(gen.state)
    assert end.length == 300 + 7  # the last generated token is pending, not committed
    assert_same(engine.restore(end), gen.state)
    with pytest.raises(ValueError, match="snapshot_at 301 is outside the prompt of 300 ids"):
        engine.generate(ids, 2, snapshot_at=(301,))


@pytest.mark.parametrize("sampling", [None, SAMPLED], ids=["greedy", "sampled"])
def test_a_run_from_a_snapshot_says_what_a_fresh_run_says(tparams, random_drafters, sampling):
    """A prompt that parts from an earlier one after its snapshot prefills only the rest, to the state a fresh prefill
    gives (the drafter's context cache too; to float rounding: the chunks split elsewhere), and generates what a fresh
    run generates, greedy or sampled (the noise is drawn by absolute position)."""
    engine = engine_for("ddtree", tparams, random_drafters)
    sampling = sampling or SamplingParams()
    first = ids_of(2, 150)
    gen = engine.generate(first, 6, snapshot_at=(90,), sampling=sampling)
    snap, = gen.snapshots
    for tail in (ids_of(3, 40), ids_of(4, 7)):  # the snapshot stays usable
        ids = np.concatenate([first[:90], tail])
        state, token = engine.start(tail, 8, after=engine.restore(snap), keep_pending=False, sampling=sampling)
        fresh, fresh_token = engine.start(ids, 8, sampling=sampling)
        got, want = held(state), held(fresh)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-4, err_msg=name)
        assert engine.decode(state, token, 8, sampling=sampling).tokens == engine.decode(
            fresh, fresh_token, 8, sampling=sampling).tokens
    end = engine.snapshot(gen.state)  # the reply's end: the next turn brings the pending token back
    more = np.concatenate([[gen.tokens[-1]], ids_of(5, 20)])
    resumed = engine.generate(more, 8, after=engine.restore(end), keep_pending=False, sampling=sampling)
    whole = np.concatenate([first, gen.tokens[:-1], more])
    assert resumed.tokens == engine.generate(whole, 8, sampling=sampling).tokens


@pytest.fixture(scope="module")
def q8_0_engine(tiny_gguf_path):
    target = load_target(tiny_gguf_path, progress=False)
    draft = load_draft(tiny_gguf_path.parent / "draft-full", target.config, progress=False)
    return Engine.from_loaded(target, draft, EngineConfig(mode="ddtree", budget=8, max_ctx=CTX, kv_type="q8_0"))


def test_a_snapshot_of_a_q8_0_cache_copies_its_blocks_and_decodes_alike(q8_0_engine):
    """Under q8_0 (the fixture pair, two blocks of 32 a row) the target's cache is a KVBlocks of scales and codes: a
    snapshot copies each field's rows, costs 34 bytes a block (the drafter's rows too), restores bit for
    bit and zero past its length, and a run from it generates what a fresh run generates, greedy and sampled."""
    engine = q8_0_engine
    ids = ids_of(6, 300)
    gen = engine.generate(ids, 8, snapshot_at=(100, 300), mark_at=100)
    short, long = gen.snapshots
    assert isinstance(short.pages[0][0], kvq.KVBlocks) and isinstance(gen.state.target.k, kvq.KVBlocks)
    t, d = engine.tcfg, engine.drafter.config
    row_bytes = (2 * len(t.full_attention_layers) * t.num_kv_heads * t.head_dim // 32 * 34
                 + 2 * d.num_layers * d.num_kv_heads * d.head_dim // 32 * 34)
    for snap, pages in ((short, 1), (long, 2)):  # 4 bytes of length, 4 of the drafter's ring start
        assert snap.nbytes == gen.mark.conv.nbytes + gen.mark.ssm.nbytes + 8 + pages * PAGE * row_bytes
    assert_same(engine.restore(short), engine.start(ids[:100], 1)[0])
    restored = engine.restore(long)
    assert_same(restored, engine.generate(ids, 1, mark_at=100).state)  # prefilled in the same two parts
    assert not any(np.asarray(x[:, 300:]).any() for x in jax.tree.leaves((restored.target.k, restored.target.v)))
    end = engine.snapshot(gen.state)
    assert_same(engine.restore(end), gen.state)
    for sampling in (SamplingParams(), SAMPLED):
        tail = ids_of(7, 40)
        resumed = engine.generate(tail, 8, after=engine.restore(short), keep_pending=False, sampling=sampling)
        assert resumed.tokens == engine.generate(np.concatenate([ids[:100], tail]), 8, sampling=sampling).tokens


# ---------------------------------------------------------------------------------------------------------------
# The server's prefix cache, through the clients

SERVER_CTX = 512


@pytest.fixture(scope="module")
def server(tiny_gguf_path):
    srv = Server(tiny_gguf_path, max_ctx=SERVER_CTX, prefix_cache_bytes=2**30)
    yield srv
    srv.close()


def system_prompt(topic: str) -> str:
    """A system prompt of over a hundred tokens of the fixture's vocabulary, its own per topic."""
    return f"You are a careful assistant for {topic}. " + "Answer briefly, check each step, say what you assume. " * 3


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


def cached(response) -> int:
    return response.usage.prompt_tokens_details.cached_tokens


def test_conversations_sharing_a_system_prompt_prefill_only_their_own_part(server, oai, claude):
    """The first conversation leaves a snapshot where its system turn ends; the next ones (OpenAI, Anthropic) continue
    from it, prefill only their own messages, and answer what a fresh run answers."""
    system = system_prompt("sorting")
    convs = [[{"role": "system", "content": system}, {"role": "user", "content": text}]
             for text in ("Write a merge sort.", "Explain quicksort.", "Name a stable sort.")]
    ids = [server.chat_ids(c) for c in convs]
    common = shared_prefix(ids[0], ids[1])
    assert common == shared_prefix(ids[0], ids[2]) > 100  # the system turn and the user turn's opening
    first = oai.chat.completions.create(model="tiny", messages=convs[0], max_tokens=6)
    assert first.choices[0].message.content == server.expect(ids[0], 6)[0] and cached(first) == 0
    second = oai.chat.completions.create(model="tiny", messages=convs[1], max_tokens=6)
    assert second.choices[0].message.content == server.expect(ids[1], 6)[0] and cached(second) == common
    assert f"{len(ids[1])} prompt tokens ({common} reused, {len(ids[1]) - common} prefilled" in server.logs[-1]
    third = claude.messages.create(model="tiny", system=system, messages=convs[2][1:], max_tokens=6)
    assert third.content[0].text == server.expect(ids[2], 6)[0]
    assert third.usage.cache_read_input_tokens == common and third.usage.input_tokens == len(ids[2]) - common


def test_responses_sharing_instructions_prefill_only_their_own_part(server, oai):
    """The Responses API takes snapshots where chat does: a second request with the same instructions (or the same
    text as a leading developer item) continues from the first one's system-turn snapshot and answers what a fresh run
    answers."""
    system = system_prompt("queues")
    texts = ("Write a queue.", "Explain a deque.", "Name a priority queue.")
    ids = [server.chat_ids([{"role": "system", "content": system}, {"role": "user", "content": t}]) for t in texts]
    common = shared_prefix(ids[0], ids[1])
    assert common == shared_prefix(ids[0], ids[2]) > 100
    first = oai.responses.create(model="tiny", instructions=system, input=texts[0], max_output_tokens=6)
    assert first.output_text == server.expect(ids[0], 6)[0] and first.usage.input_tokens_details.cached_tokens == 0
    second = oai.responses.create(model="tiny", instructions=system, input=texts[1], max_output_tokens=6)
    assert second.output_text == server.expect(ids[1], 6)[0]
    assert second.usage.input_tokens_details.cached_tokens == common
    assert f"{len(ids[1])} prompt tokens ({common} reused, {len(ids[1]) - common} prefilled" in server.logs[-1]
    third = oai.responses.create(model="tiny", input=[{"role": "developer", "content": system},
                                                      {"role": "user", "content": texts[2]}], max_output_tokens=6)
    assert third.output_text == server.expect(ids[2], 6)[0]
    assert third.usage.input_tokens_details.cached_tokens == common


@pytest.mark.parametrize("sampling", [None, SAMPLED], ids=["greedy", "sampled"])
def test_a_conversation_comes_back_after_another_to_its_snapshot(server, oai, sampling):
    """A's first turn, then another conversation, then A's next turn: A continues from the snapshot at its reply's end
    when the reply encodes back to the tokens generated, else from the one at its prompt's end, and answers what a
    fresh run answers, greedy or sampled with a seed."""
    extra = {} if sampling is None else dict(temperature=SAMPLED.temperature, top_p=SAMPLED.top_p, seed=SAMPLED.seed)
    turn1 = [{"role": "system", "content": system_prompt(f"stacks, {sampling is None}")},
             {"role": "user", "content": "Write a stack."}]
    ids1 = server.chat_ids(turn1)
    want, tokens = server.expect(ids1, 6, sampling)
    reply = oai.chat.completions.create(model="tiny", messages=turn1, max_tokens=6, **extra).choices[0].message.content
    assert reply == want
    other = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello there."}],
                                        max_tokens=4)
    assert cached(other) == 0
    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Now a queue."}]
    ids2 = server.chat_ids(turn2)
    again = oai.chat.completions.create(model="tiny", messages=turn2, max_tokens=6, **extra)
    assert again.choices[0].message.content == server.expect(ids2, 6, sampling)[0]
    round_trip = server.tok.encode(reply) == [t for t in tokens if t not in server.tok.stop_ids]
    assert cached(again) == (len(ids1) + len(tokens) - 1 if round_trip else len(ids1))


def test_a_completion_comes_back_to_where_its_reply_ended(server, oai):
    """Token ids that extend an earlier prompt and its completion continue from that completion's end, kept when
    another prompt took the device's state."""
    prompt = server.tok.encode("class Queue:\n")
    want, tokens = server.expect(prompt, 6)
    assert oai.completions.create(model="tiny", prompt=prompt, max_tokens=6).choices[0].text == want
    assert cached(oai.completions.create(model="tiny", prompt=server.tok.encode("import os\n"), max_tokens=4)) == 0
    longer = prompt + tokens + server.tok.encode("    def put(self, x):")
    r = oai.completions.create(model="tiny", prompt=longer, max_tokens=6)
    assert r.choices[0].text == server.expect(longer, 6)[0] and cached(r) == len(prompt) + len(tokens) - 1


def budgeted(srv, ids, n, limit) -> list[dict]:
    """The content blocks of a reply whose think block a budget of n closes: the engine's first n tokens, then its
    continuation of the prompt, those tokens and the closing text (as test_server_reasoning)."""
    close = srv.tok.encode(budget.CLOSE_TEXT)
    first = srv.engine.generate(ids, n, srv.tok.stop_ids)
    assert len(first.tokens) == n and THINK_CLOSE not in srv.tok.decode(first.tokens)
    rest = srv.engine.generate(ids + first.tokens + close, limit - n - len(close), srv.tok.stop_ids)
    return [{"type": "thinking", "thinking": srv.tok.decode(first.tokens).strip(), "signature": ""},
            {"type": "text", "text": srv.tok.decode(rest.tokens, skip_stops=True).lstrip(), "citations": None}]


def test_snapshots_of_a_reply_under_a_reasoning_budget_serve_later_requests(qwen35_gguf_path):
    """A reply whose think block the budget closes runs the engine twice; the snapshots of its prompt (taken by the
    first run) serve another conversation with the same system prompt, then the conversation's own next turn, both
    answering what fresh runs answer (Qwen3.5's template, thinking on)."""
    srv = Server(qwen35_gguf_path, max_ctx=SERVER_CTX, prefix_cache_bytes=2**30)
    try:
        client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
        system, n, limit = system_prompt("heaps"), 4, 14
        thinking = {"type": "enabled", "budget_tokens": n}

        def ask(messages):
            return client.messages.create(model="tiny", system=system, messages=messages, max_tokens=limit,
                                          thinking=thinking)

        def ids(messages):
            return srv.tok.encode(render([{"role": "system", "content": system}] + messages, QWEN35,
                                         enable_thinking=True))

        turn1 = [{"role": "user", "content": "Write a heap."}]
        first = ask(turn1)
        assert blocks(first) == budgeted(srv, ids(turn1), n, limit) and first.usage.cache_read_input_tokens == 0
        other = [{"role": "user", "content": "Explain a trie."}]
        second = ask(other)
        assert blocks(second) == budgeted(srv, ids(other), n, limit)
        assert second.usage.cache_read_input_tokens == shared_prefix(ids(turn1), ids(other)) > 100
        turn2 = turn1 + [{"role": "assistant", "content": first.content[1].text}, {"role": "user", "content": "More."}]
        third = ask(turn2)  # from the snapshot where turn 1's prompt parts from its next turn
        assert blocks(third) == budgeted(srv, ids(turn2), n, limit)
        assert third.usage.cache_read_input_tokens == shared_prefix(ids(turn1), ids(turn2)) > shared_prefix(
            ids(turn1), ids(other))
    finally:
        srv.close()


def test_snapshots_are_evicted_least_recently_used_first_within_the_budget(server, tiny_gguf_path, oai):
    """With room for two snapshots, the one used longest ago goes first; a prompt whose snapshot went is prefilled
    afresh, one whose snapshot stayed is not; the bytes never pass the budget."""
    size = server.engine.snapshot(server.engine.start([1, 2, 3], 1)[0]).nbytes  # any snapshot of one page
    small = Server(tiny_gguf_path, max_ctx=SERVER_CTX, prefix_cache_bytes=size * 5 // 2)
    try:
        client = openai.OpenAI(base_url=small.url + "/v1", api_key="unused", max_retries=0)
        cache, ends = small.worker.cache, []

        def complete(ids):
            r = client.completions.create(model="tiny", prompt=ids, max_tokens=4)
            assert r.choices[0].text == small.expect(ids, 4)[0] and cache.nbytes <= cache.budget
            return cached(r)

        prompts = [small.tok.encode(f"def function_{i}(x):") for i in range(4)]
        for p in prompts:  # each request's state is kept at its completion's end when the next one takes over
            assert complete(p) == 0
            ends.append(tuple(p + small.expect(p, 4)[1][:-1]))
        assert cache.keys() == [ends[1], ends[2]]  # ends[0] went for ends[2]
        assert complete(list(ends[1]) + [17]) == len(ends[1])  # used, so ends[3] coming in pushes out ends[2]
        assert cache.keys() == [ends[1], ends[3]] and cache.nbytes == 2 * size
        assert complete(list(ends[2]) + [17]) == 0  # gone: prefilled afresh
        assert complete(list(ends[3]) + [17]) == len(ends[3])  # the last request's end pushed out ends[1]
        assert cache.keys()[0] == ends[3] and ends[1] not in cache
    finally:
        small.close()


def test_serve_sizes_the_cache_by_the_flag_and_the_free_memory():
    gib = 2**30
    assert prefix_cache_bytes(None, gib, None) == 4 * gib  # the default where free memory is unknown
    assert prefix_cache_bytes(None, gib, 100 * gib) == 4 * gib
    assert prefix_cache_bytes(None, gib, 5 * gib) == 2 * gib  # half of what a context's caches leave
    assert prefix_cache_bytes(0.5, gib, 2 * gib) == gib // 2 and prefix_cache_bytes(0, gib, 0) == 0
    with pytest.raises(UsageError, match="--prefix_cache_gb 2 does not fit: the device has 1.00 GiB free beside"):
        prefix_cache_bytes(2, gib, 2 * gib)
