"""The server's pure parts: stop strings over streamed text, request checking, and dashed flag spellings."""

import pytest

from conftest import TINY_GGUF
from dflash_jax.generate import _underscored
from dflash_jax.server.request import BadRequest, Settings, check_greedy, max_tokens, stop_strings, text_of
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


@pytest.mark.parametrize("body", [{}, {"temperature": 0}, {"temperature": 0, "top_p": 0.5}, {"top_k": 1},
                                  {"temperature": 0.8, "top_k": 1}, {"top_p": 1}, {"frequency_penalty": 0},
                                  {"repetition_penalty": 1}])
def test_greedy_requests_pass(settings, body):
    check_greedy(body, settings)


@pytest.mark.parametrize("body, named", [({"temperature": 0.7}, "temperature 0.7"), ({"top_p": 0.9}, "top_p 0.9"),
                                         ({"top_k": 40}, "top_k 40"), ({"presence_penalty": 0.5}, "presence_penalty"),
                                         ({"repetition_penalty": 1.1}, "repetition_penalty"),
                                         ({"logit_bias": {"5": 10}}, "logit_bias")])
def test_sampling_requests_are_refused_unless_the_server_falls_back(settings, body, named):
    with pytest.raises(BadRequest, match=f"cannot honour {named}.*--allow_greedy_fallback"):
        check_greedy(body, settings)
    check_greedy(body, Settings(**{**settings.__dict__, "allow_greedy_fallback": True}))


@pytest.mark.parametrize("body, message", [({"temperature": 3}, "between 0 and 2"), ({"temperature": "hot"}, "number"),
                                           ({"top_p": True}, "number"), ({"top_k": 2.5}, "integer")])
def test_sampling_fields_of_the_wrong_type_or_range_are_refused_even_with_fallback(settings, body, message):
    with pytest.raises(BadRequest, match=message):
        check_greedy(body, Settings(**{**settings.__dict__, "allow_greedy_fallback": True}))


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
    known = {"allow_greedy_fallback", "max_ctx", "stats", "prompt"}
    assert _underscored("--allow-greedy-fallback", known) == "--allow_greedy_fallback"
    assert _underscored("--max-ctx=1024", known) == "--max_ctx=1024"
    assert _underscored("--no-stats", known) == "--nostats"  # absl's negation
    assert _underscored("--nostats", known) == "--nostats"
    assert _underscored("--not-a-flag", known) == "--not-a-flag"
    assert _underscored("--prompt=a-b", known) == "--prompt=a-b"
