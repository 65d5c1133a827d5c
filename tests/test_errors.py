"""How the commands end: the package's input errors and unreadable files as one line and exit code 2, any other error
(a bug) with its traceback and exit code 1, an interrupt with 130."""

import errno
import subprocess
import sys

import pytest

from conftest import ROOT
from dflash_jax.errors import InputError, run_main


def test_every_input_error_of_the_package_is_an_input_error():
    from dflash_jax import chat_template, config, generate, gguf, load, prompt_sets, quant, tokenizer, weights
    from dflash_jax.engine import prefill
    from dflash_jax.server import request
    from dflash_jax.training import checkpoint, data

    for cls in (chat_template.TemplateError, config.ConfigError, generate.UsageError, gguf.GGUFError, load.LoadError,
                prompt_sets.PromptSetError, quant.Unsupported, tokenizer.TokenizerError, weights.WeightsError,
                prefill.InputError, request.BadRequest, checkpoint.CheckpointError, data.DataError):
        assert issubclass(cls, InputError) and issubclass(cls, ValueError), cls
    assert issubclass(quant.Unsupported, NotImplementedError)


def run(command, capsys):
    """(exit code, stderr lines) of run_main over command."""
    with pytest.raises(SystemExit) as exit_:
        run_main("cmd", command, ["cmd"])
    return exit_.value.code, capsys.readouterr().err.strip().splitlines()


def _raise(e):
    def command(argv):
        raise e
    return command


@pytest.mark.parametrize("error", [InputError("--n_gen 9 does not fit\n--max_ctx 8"),
                                   FileNotFoundError(errno.ENOENT, "No such file or directory", "/no/such.gguf"),
                                   PermissionError(errno.EACCES, "Permission denied", "/root/model.gguf"),
                                   IsADirectoryError(errno.EISDIR, "Is a directory", "/tmp")])
def test_bad_input_is_one_line_and_exit_code_2(error, capsys):
    code, lines = run(_raise(error), capsys)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("cmd: ")
    if isinstance(error, OSError):
        assert lines[0] == f"cmd: {error.filename}: {error.strerror}"


def test_a_missing_file_opened_by_the_command_names_the_file(tmp_path, capsys):
    missing = tmp_path / "prompt.txt"
    code, lines = run(lambda argv: len(open(missing).read()), capsys)
    assert code == 2 and lines == [f"cmd: {missing}: No such file or directory"]


def test_exit_codes_of_a_command_and_of_an_interrupt(capsys):
    assert run(lambda argv: 0, capsys) == (0, [])
    assert run(lambda argv: 3, capsys) == (3, [])
    assert run(_raise(KeyboardInterrupt()), capsys) == (130, ["cmd: interrupted"])


@pytest.mark.parametrize("error", [ValueError("deep inside jax"), OSError(errno.ENOSPC, "No space left on device"),
                                   KeyError("layer")])
def test_other_errors_are_bugs_and_propagate(error):
    with pytest.raises(type(error)):
        run_main("cmd", _raise(error), ["cmd"])


def test_an_internal_error_exits_1_with_its_traceback():
    script = ("from dflash_jax.errors import run_main\n"
              "def command(argv):\n"
              "    raise ValueError('an internal bug, not bad input')\n"
              "run_main('cmd', command, ['cmd'])\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr and 'line 3, in command' in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "ValueError: an internal bug, not bad input"
