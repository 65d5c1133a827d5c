"""The reasoning budget: a reply that starts inside a think block has it closed after N tokens.

The generation stops after N tokens; if the block is still open, the server forces the text `\\n</think>\\n\\n` into
the reply and the engine goes on from it: the continuation's prompt is the last generated token (still pending in the
state) and the closing text's ids, prefilled on the state the first part left, so nothing is prefilled twice. The
forced tokens are part of the reply and count against max_tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from dflash_jax.engine.generate import Generation
from dflash_jax.engine.sampling import GREEDY, SamplingParams
from dflash_jax.engine.state import DecodeState
from dflash_jax.server.reply import THINK_CLOSE
from dflash_jax.tokenizer import Tokenizer

CLOSE_TEXT = f"\n{THINK_CLOSE}\n\n"  # as Qwen3.5's template writes a closed think block


def _joined(first: Generation, forced: list[int], rest: Generation) -> Generation:
    """One generation of two parts with forced tokens between them."""
    return dataclasses.replace(
        rest, tokens=first.tokens + forced + rest.tokens, accept_lengths=first.accept_lengths + rest.accept_lengths,
        off_spine_steps=first.off_spine_steps + rest.off_spine_steps, prefill_s=first.prefill_s + rest.prefill_s,
        decode_s=first.decode_s + rest.decode_s, first_step_s=first.first_step_s, mark=first.mark,
        snapshots=first.snapshots)


def generate(engine, tokenizer: Tokenizer, budget: int | None, ids: Sequence[int], n_gen: int,
             on_tokens: Callable[[list[int]], bool], after: DecodeState | None = None, keep_pending: bool = True,
             mark_at: int = 0, sampling: SamplingParams = GREEDY, snapshot_at: Sequence[int] = ()) -> Generation:
    """`engine.generate` of a reply that starts inside a think block, closed after `budget` tokens (None: never).
    The budget applies when max_tokens (n_gen) leaves room for the closing text and a token after it; the result's
    tokens include the forced ones, its mark and snapshots (points of the prompt, all prefilled by the first part)
    are the first part's."""
    close = [] if budget is None else tokenizer.encode(CLOSE_TEXT)  # none without a budget: a tokenizer may lack text
    if budget is None or budget + len(close) >= n_gen:
        return engine.generate(ids, n_gen, tokenizer.stop_ids, on_tokens, after=after, keep_pending=keep_pending,
                               mark_at=mark_at, sampling=sampling, snapshot_at=snapshot_at)
    first = engine.generate(ids, budget, tokenizer.stop_ids, on_tokens, after=after, keep_pending=keep_pending,
                            mark_at=mark_at, sampling=sampling, snapshot_at=snapshot_at)
    if first.stopped or first.state is None:  # ended by a stop token, or halted (a stop string, a client gone)
        return first
    forced = [] if THINK_CLOSE in tokenizer.decode(first.tokens) else close
    if forced and on_tokens(forced):
        return dataclasses.replace(first, tokens=first.tokens + forced, state=None, halted=True)
    # the last token is pending in the state: it is prefilled with the forced ids (keep_pending would prefill it
    # too, but not alone when the block closed by itself and nothing is forced)
    rest = engine.generate([first.tokens[-1]] + forced, n_gen - budget - len(forced), tokenizer.stop_ids, on_tokens,
                           after=first.state, keep_pending=False, sampling=sampling)
    return _joined(first, forced, rest)
