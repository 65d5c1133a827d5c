"""`python -m dflash_jax.chat` driven through a pseudo-terminal, as a user types: turns reuse the device state,
Ctrl+C stops a reply and leaves the model usable, Ctrl+D exits."""

import os
import pty
import re
import select
import signal
import sys
import time

import pytest

from conftest import ROOT, TINY

pytestmark = pytest.mark.skipif(not hasattr(pty, "fork"), reason="needs a POSIX pseudo-terminal")


class Terminal:
    def __init__(self, *args):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the chat command, with the pty as its controlling terminal
            # a shell starts the command with SIGINT at its default and unblocked; in the whole suite the worker
            # that forks here had SIGINT ignored (SIG_IGN), which exec passes on, so Ctrl+C did nothing
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
            os.chdir(ROOT)
            os.execvpe(sys.executable, [sys.executable, "-m", "dflash_jax.chat", *args],
                       {**os.environ, "JAX_PLATFORMS": "cpu", "TERM": "dumb"})
        self.out = ""

    def read_until(self, pattern: str, timeout: float = 240.0) -> str:
        """Output up to and including the first match of pattern after what was already consumed."""
        deadline = time.monotonic() + timeout
        while not (found := re.search(pattern, self.out)):
            left = deadline - time.monotonic()
            assert left > 0, f"no {pattern!r} in {self.out[-2000:]!r}"
            if select.select([self.fd], [], [], min(left, 1.0))[0]:
                try:
                    self.out += os.read(self.fd, 4096).decode("utf-8", "replace")
                except OSError:  # the child closed the terminal
                    assert re.search(pattern, self.out), f"no {pattern!r} in {self.out[-2000:]!r}"
        seen, self.out = self.out[:found.end()], self.out[found.end():]
        return seen

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def exit_code(self) -> int:
        _, status = os.waitpid(self.pid, 0)
        return os.waitstatus_to_exitcode(status)


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # the child execs at once; no JAX thread runs in it
def test_turns_reuse_state_interrupt_and_exit(tiny_gguf_path, jit_cache):
    """On the fixture pair, whose random weights give replies of tens to hundreds of tokens."""
    term = Terminal("--target", str(tiny_gguf_path), "--draft", str(TINY / "draft-full"), f"--jit_cache={jit_cache}",
                    "--stats")
    term.read_until(">>> ")
    term.type("Hello\r")
    first = term.read_until(r"context (\d+) / 4096[^\n]*\n(.|\n)*?>>> ")
    context1 = int(re.search(r"context (\d+) / 4096", first)[1])
    term.type("And again\r")
    second = term.read_until(r"context (\d+) / 4096[^\n]*\n(.|\n)*?>>> ")
    prefilled2 = int(re.search(r"prefilled (\d+) tokens", second)[1])
    assert prefilled2 < context1  # only the new turn, not the whole conversation
    # a reply of 350 tokens on this fixture (about 3 s on two cores), so that Ctrl+C lands inside it
    term.type("Tell me more\r")
    term.read_until(r"more\r?\n.{8}")  # the reply has started streaming
    term.type("\x03")
    term.read_until(r"\[interrupted\](.|\n)*?>>> ")
    term.type("Hello\r")
    assert re.search(r"prefilled \d+ tokens", term.read_until(r"context \d+ / 4096[^\n]*\n(.|\n)*?>>> "))
    term.type("\x04")
    assert term.exit_code() == 0
