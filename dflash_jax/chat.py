"""`python -m dflash_jax.chat`: a multi-turn chat REPL with streamed replies.

    python -m dflash_jax.chat [--target MODEL --draft DRAFT] [--system TEXT] [--temperature 0.7 --seed 1] [--stats]

The conversation's state stays on the device between turns: when the next turn's rendered prompt extends the text
the state already holds (the usual case with ChatML-style templates), only the new tokens are prefilled. Otherwise
(a template that rewrites earlier turns) the whole conversation is prefilled again. Ctrl+C interrupts a reply (the
partial reply is kept, the next turn re-prefills); `/reset` starts over; Ctrl+D (or `/exit`) quits. With
`--temperature` the replies are sampled (one seed for the session, drawn and printed when `--seed` is not given;
each token's noise comes from its position in the conversation, so every mode replies the same).
"""

from __future__ import annotations

import sys
from typing import Callable, Sequence

from dflash_jax.engine.sampling import GREEDY, SamplingParams
from dflash_jax.errors import InputError, run_main
from dflash_jax.generate import define_model_flags, engine_from_flags, parse_flags, sampling_from_flags
from dflash_jax.tokenizer import Tokenizer, require_utf8

PROMPT = ">>> "


class Conversation:
    """The messages so far, and the device state after the last reply with the text of the reply's tokens."""

    def __init__(self, engine, tokenizer: Tokenizer, *, system: str | None = None, thinking: bool = False,
                 n_gen: int = 512, sampling: SamplingParams = GREEDY):
        self.engine, self.tokenizer, self.n_gen, self.thinking = engine, tokenizer, n_gen, thinking
        self.sampling = sampling
        self.system = system
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.state, self.stopped = None, False

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.render_chat(messages, generation_prompt, self.thinking)

    def _continuation(self, prompt: str) -> str | None:
        """The text to prefill after the state's tokens, or None when the state cannot be continued.

        The state holds the previous prompt and the reply's tokens (the stop token that ended it still pending, to
        be dropped). The template renders that reply into history as `... content + tail` (e.g. `<|im_end|>\n`),
        then the new turn; what the state lacks is the tail and the new turn."""
        if self.state is None:
            return None
        content = self.messages[-2]["content"]
        history = self._render(self.messages[:-1], False)
        at = history.rfind(content)
        if not content or at < 0 or not prompt.startswith(history):
            return None
        return history[at + len(content):] + prompt[len(history):]

    def reply(self, text: str, on_text: Callable[[str], None]):
        """Generate the assistant's reply to a user message, streaming its text; returns (Generation, tokens
        prefilled). A KeyboardInterrupt keeps the partial reply and drops the device state."""
        tok = self.tokenizer
        self.messages.append({"role": "user", "content": text})
        prompt = self._render(self.messages, True)
        rest = self._continuation(prompt)
        ids = tok.encode(prompt if rest is None else rest)
        after, keep = (self.state, not self.stopped) if rest is not None else (None, True)
        previous, self.state = self.state, None  # consumed (or dropped) unless the engine refuses the turn
        decoder, got = tok.stream(skip_stops=True), []

        def stream(new: list[int]) -> None:
            got.extend(new)
            piece = decoder.push(new)
            if piece:
                on_text(piece)

        try:
            gen = self.engine.generate(ids, self.n_gen, tok.stop_ids, on_tokens=stream, after=after,
                                       keep_pending=keep, sampling=self.sampling)
        except InputError:  # refused before any compute (e.g. the context is full): nothing changed
            self.messages.pop()
            self.state = previous
            raise
        except KeyboardInterrupt:
            self.messages.append({"role": "assistant", "content": tok.decode(got, skip_stops=True)})
            raise
        finally:
            on_text(decoder.flush())
        self.messages.append({"role": "assistant", "content": tok.decode(gen.tokens, skip_stops=True)})
        self.state, self.stopped = gen.state, gen.stopped
        return gen, len(ids) + (1 if after is not None and keep else 0)


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def run(argv: Sequence[str]) -> int:
    """The REPL; returns its exit code."""
    from absl import flags

    f = flags.FLAGS
    if f.system is not None:
        require_utf8(f.system, "--system")
    sampling = sampling_from_flags(f)
    engine, models, target_path = engine_from_flags(argv, "chat")
    chat = Conversation(engine, models.tokenizer, system=f.system, thinking=f.thinking, n_gen=f.n_gen,
                        sampling=sampling)
    print(f"dflash-jax chat: {target_path} ({f.mode}, {sampling.describe()}); Ctrl+C stops a reply, /reset starts "
          "over, Ctrl+D quits.", file=sys.stderr)
    sys.stdin.reconfigure(errors="surrogateescape")  # a line that is not UTF-8 is refused below, not a traceback
    while True:
        try:
            line = input(PROMPT)
        except EOFError:
            _write("\n")
            return 0
        except KeyboardInterrupt:
            _write("\n")
            continue
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            chat.reset()
            print("(conversation cleared)", file=sys.stderr)
            continue
        if not line.strip():
            continue
        try:
            require_utf8(line, "the line")
        except InputError as e:
            print(f"chat: {e}", file=sys.stderr)
            continue
        try:
            gen, prefilled = chat.reply(line, _write)
        except KeyboardInterrupt:
            _write("\n[interrupted]\n")
            continue
        except InputError as e:
            print(f"chat: {e}; /reset to start over", file=sys.stderr)
            continue
        _write("\n")
        if f.stats:
            print(f"[{f.mode}] prefilled {prefilled} tokens in {gen.prefill_s:.2f} s; {sum(gen.accept_lengths)} "
                  f"more in {gen.decode_s:.2f} s over {gen.steps} steps, acceptance length "
                  f"{gen.mean_accept_length:.2f}, {gen.steady_tokens_per_s:.1f} tok/s after the first step; "
                  f"context {int(gen.state.target.length)} / {f.max_ctx}", file=sys.stderr)


def main(argv: Sequence[str]) -> None:
    run_main("chat", run, argv)


if __name__ == "__main__":
    from absl import app

    define_model_flags(512, "Context of the whole conversation, in tokens.", max_ctx=4096)
    app.run(main, flags_parser=lambda argv: parse_flags(argv, "chat"))
