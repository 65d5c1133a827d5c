"""The server's pure parts: stop strings over streamed text, request checking, and dashed flag spellings."""

import pytest

from conftest import TINY_GGUF
from dflash_jax.generate import _underscored
from dflash_jax.engine.sampling import SEED_LIMIT, SamplingParams
from dflash_jax.server.request import (BadRequest, GenRequest, Settings, choices, count, max_tokens, sampling,
                                       stop_strings, text_of)
from dflash_jax.server.stops import StopMatcher


def run_matcher(stops, pieces):
    m = StopMatcher(stops)
    out = [m.push(p) for p in pieces]
    return out, m.flush(), m.matched


def test_stop_strings_split_over_pieces_are_caught_and_nothing_after_them_is_sent():
    out, tail, matched = run_matcher(["END"], ["abc E", "N", "D more", " and more"])
    assert "".join(out) == "abc " and out[0] == "abc " and tail == "" and matched == "END"
    out, tail, matched = run_matcher(["END"], ["abc E", "nd"])  # a false start is released when it cannot match
    assert "".join(out) + tail == "abc End" and matched is None
    out, _, matched = run_matcher(["xyz", "b"], ["axyzb"])  # the earliest match wins
    assert out == ["a"] and matched == "xyz"
    out, tail, matched = run_matcher(["\n\n"], ["line\n", "\nnext"])
    assert out == ["line", ""] and matched == "\n\n"
    out, tail, matched = run_matcher([], ["a", "b"])
    assert out == ["a", "b"] and tail == "" and matched is None
    out, tail, matched = run_matcher(["ab"], ["xa"])  # held back to the end, then flushed
    assert out == ["x"] and tail == "a" and matched is None


@pytest.fixture(scope="module")
def settings():
    from dflash_jax.tokenizer import load_tokenizer
    return Settings(load_tokenizer(TINY_GGUF), "tiny", 100, 1024)


def test_sampling_fields_become_sampling_params_the_rest_the_servers(settings):
    got = sampling({"temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 7}, settings, 2)
    assert got == SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=7)
    assert sampling({}, settings, 2) == SamplingParams() and sampling({"top_k": 5}, settings, 2).greedy
    assert sampling({"temperature": 1, "top_k": 10 ** 30}, settings, 2).top_k == settings.vocab_size
    server = Settings(**{**settings.__dict__, "sampling": SamplingParams(temperature=0.5, top_p=0.8), "seed": 3})
    assert sampling({"top_p": 0.5}, server, 2) == SamplingParams(temperature=0.5, top_p=0.5, seed=3)
    assert sampling({"temperature": 0}, server, 2).greedy


def test_a_sampled_request_without_a_seed_draws_one():
    from dflash_jax.tokenizer import load_tokenizer
    settings = Settings(load_tokenizer(TINY_GGUF), "tiny", 100, 1024)
    seeds = {sampling({"temperature": 1}, settings, 2).seed for _ in range(8)}
    assert len(seeds) > 1 and all(0 <= s < SEED_LIMIT for s in seeds)


@pytest.mark.parametrize("body, message", [
    ({"temperature": 3}, "'temperature' must be between 0 and 2, got 3"), ({"temperature": "hot"}, "number"),
    ({"temperature": float("nan")}, "'temperature' must be between"), ({"temperature": -0.1}, "between 0 and 2"),
    ({"top_p": True}, "'top_p' must be a number"), ({"top_p": 0}, "'top_p' must be in \\(0, 1\\]"),
    ({"top_p": 1.5}, "'top_p' must be in"), ({"top_k": 2.5}, "'top_k' must be an integer"),
    ({"top_k": -1}, "'top_k' must be at least 0"), ({"min_p": 1}, "'min_p' must be in \\[0, 1\\)"),
    ({"seed": -1}, "'seed' must be in 0..2\\^32-1"), ({"seed": 1 << 32}, "'seed' must be in"),
    ({"seed": "1"}, "'seed' must be an integer"),
    ({"presence_penalty": 0.5}, "'presence_penalty' is not supported: penalties are not implemented"),
    ({"frequency_penalty": -1}, "'frequency_penalty' is not supported"),
    ({"repetition_penalty": 1.1}, "'repetition_penalty' is not supported"),
    ({"logit_bias": {"5": 10}}, "'logit_bias' is not supported: logit biases are not implemented")])
def test_bad_sampling_fields_are_refused_naming_the_field(settings, body, message):
    with pytest.raises(BadRequest, match=message) as e:
        sampling(body, settings, 2)
    assert e.value.param == next(iter(body))


def test_neutral_penalties_pass_and_anthropic_temperature_stops_at_1(settings):
    body = {"frequency_penalty": 0, "presence_penalty": 0.0, "repetition_penalty": 1, "logit_bias": {}}
    assert sampling(body, settings, 2).greedy
    with pytest.raises(BadRequest, match="'temperature' must be between 0 and 1, got 1.5"):
        sampling({"temperature": 1.5}, settings, 1)


def test_n_gives_choices_with_consecutive_seeds(settings):
    assert count({}) == 1 and count({"n": 3, "best_of": 3}) == 3
    for body, message in [({"n": 0}, "'n' must be between 1 and 16"), ({"n": 17}, "between 1 and 16"),
                          ({"n": 2, "best_of": 3}, "'best_of' must equal n"), ({"best_of": 2}, "must equal n \\(1\\)"),
                          ({"n": 2, "stream": True}, "stream with n > 1 is not supported")]:
        with pytest.raises(BadRequest, match=message):
            count(body)
    request = GenRequest([1, 2], 4, sampling=SamplingParams(temperature=1, seed=SEED_LIMIT - 1), n=3)
    assert [(c.n, c.sampling.seed) for c in choices(request)] == [(1, SEED_LIMIT - 1), (1, 0), (1, 1)]
    assert all(c.sampling.temperature == 1 and c.ids == [1, 2] for c in choices(request))


def test_max_tokens_fits_the_context_or_is_refused_with_the_numbers(settings):
    assert max_tokens(None, 30, settings) == 70  # the rest of the context by default
    assert max_tokens(None, 30, Settings(**{**settings.__dict__, "default_max_tokens": 16})) == 16
    assert max_tokens(70, 30, settings) == 70
    with pytest.raises(BadRequest, match="prompt of 30 tokens \\+ max_tokens 71 = 101 exceeds the context of 100"):
        max_tokens(71, 30, settings)
    with pytest.raises(BadRequest, match="prompt of 100 tokens leaves no room"):
        max_tokens(None, 100, settings)
    with pytest.raises(BadRequest, match="at least 1"):
        max_tokens(0, 3, settings)


def test_content_parts_and_stop_fields(settings):
    assert text_of([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "m") == "a\nb"
    with pytest.raises(BadRequest, match="content\\[0\\] is of type 'image_url': only text"):
        text_of([{"type": "image_url", "image_url": {"url": "x"}}], "messages[0]")
    with pytest.raises(BadRequest, match="string or an array"):
        text_of(5, "messages[0]")
    assert stop_strings({"stop": "x"}, "stop") == ("x",) and stop_strings({}, "stop") == ()
    for bad in ([""], [1], 3, ["a"] * 17):
        with pytest.raises(BadRequest):
            stop_strings({"stop": bad}, "stop")


def test_flags_may_be_spelled_with_dashes():
    known = {"top_p", "max_ctx", "stats", "prompt"}
    assert _underscored("--top-p", known) == "--top_p"
    assert _underscored("--max-ctx=1024", known) == "--max_ctx=1024"
    assert _underscored("--no-stats", known) == "--nostats"  # absl's negation
    assert _underscored("--nostats", known) == "--nostats"
    assert _underscored("--not-a-flag", known) == "--not-a-flag"
    assert _underscored("--prompt=a-b", known) == "--prompt=a-b"
