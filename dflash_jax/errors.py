"""Input errors and how the commands end on them: one line and exit code 2 for bad input, a traceback for a bug."""

from __future__ import annotations

import sys
from typing import Any, Callable, NoReturn, Sequence

USAGE_ERROR = 2
INTERRUPTED = 130
# A file the user named that cannot be opened is bad input; other OSErrors (a full disk, a failing device) are not.
UNREADABLE = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


class InputError(ValueError):
    """Bad input (flags, files, models, prompts, requests): the base of every input error the package raises."""


def brief(value: Any, limit: int = 60) -> str:
    """A value's repr cut to `limit` characters, for one-line messages about values read from a file."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 3]}..."


def one_line(e: BaseException) -> str:
    """An input error as one line; an unreadable file as `PATH: reason`."""
    if isinstance(e, OSError) and e.filename is not None:
        return f"{e.filename}: {e.strerror}"
    return str(e).replace("\n", " ")


def run_main(command: str, run_command: Callable[[Sequence[str]], int], argv: Sequence[str]) -> NoReturn:
    """Run a command and exit with its code: bad input is one line on stderr and exit code 2, an interrupt 130.

    Anything else is a bug: it propagates, so Python prints its traceback and exits with 1."""
    try:
        code = run_command(argv)
    except KeyboardInterrupt:
        print(f"\n{command}: interrupted", file=sys.stderr)
        code = INTERRUPTED
    except (InputError, *UNREADABLE) as e:
        print(f"{command}: {one_line(e)}", file=sys.stderr)
        code = USAGE_ERROR
    sys.exit(code)
