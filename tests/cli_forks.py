"""Run many `python -m dflash_jax.<module> args` command lines cheaply: this process imports the commands' modules
once, then forks a child for each command line, which runs the module as `__main__` (runpy) as a fresh interpreter
would after its imports. tests/bad_inputs_corpus.py starts it as its own process (`python tests/cli_forks.py
REQUESTS`), so that no XLA backend or thread of a test process is forked; it prints one JSON object per line, in
the requests' order: the child's exit code, stderr, seconds from fork to exit and peak resident bytes (wait4).

REQUESTS is a JSON file: {"jobs": P, "time_limit_s": T, "address_limit_kb": A, "runs": [{"module", "args",
"stdin_file"}]}. At most P children run at once; one past T seconds is killed; each child's address space is capped
at A KiB (a runaway allocation fails in the child instead of starving the machine), as `ulimit -v` would."""

import importlib
import json
import os
import resource
import runpy
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["JAX_PLATFORMS"] = "cpu"

# imported before forking; `inspect` defines its absl flags at import, so only what it imports (gguf) is
MODULES = ("gguf", "generate", "score", "chat", "serve", "train_draft", "testing.tiny")


def _child(run: dict, err_path: str, address_limit_kb: int) -> None:
    """In the forked child: fds 0-2 to the run's stdin, /dev/null and its stderr file, then the module as __main__;
    never returns."""
    code = 1
    try:
        resource.setrlimit(resource.RLIMIT_AS, (address_limit_kb << 10, address_limit_kb << 10))
        os.chdir(ROOT)
        for fd, path, flags in ((0, run["stdin_file"], os.O_RDONLY), (1, os.devnull, os.O_WRONLY),
                                (2, err_path, os.O_WRONLY)):
            opened = os.open(path, flags)
            os.dup2(opened, fd)
            os.close(opened)
        sys.stdin = open(0, "r", encoding="utf-8", closefd=False)
        sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
        sys.stderr = open(2, "w", encoding="utf-8", closefd=False, buffering=1)
        module = f"dflash_jax.{run['module']}"
        sys.modules.pop(module, None)  # runs as __main__ from its source, as in a fresh interpreter (no runpy warning)
        sys.argv = [module, *run["args"]]
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:  # as the interpreter turns it into an exit status
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
    except BaseException:  # noqa: BLE001 - what an uncaught exception prints, as a fresh interpreter would
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def main(requests_path: str) -> None:
    req = json.loads(Path(requests_path).read_text())
    for name in MODULES:  # the imports every child would otherwise repeat (their `__main__` runs again in it)
        importlib.import_module(f"dflash_jax.{name}")
    runs, limit = req["runs"], req["time_limit_s"]
    results: list = [None] * len(runs)
    running: dict[int, tuple[int, float, str]] = {}  # pid -> (index, start, stderr file)
    pending = list(range(len(runs)))[::-1]
    with tempfile.TemporaryDirectory(prefix="cli_forks_") as tmp:
        while pending or running:
            while pending and len(running) < req["jobs"]:
                i = pending.pop()
                err = os.path.join(tmp, f"{i}.err")
                Path(err).touch()
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(runs[i], err, req["address_limit_kb"])
                running[pid] = (i, time.monotonic(), err)
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if pid == 0:
                now = time.monotonic()
                for other, (_, start, _) in running.items():
                    if now - start > limit:
                        os.kill(other, signal.SIGKILL)
                time.sleep(0.01)
                continue
            i, start, err = running.pop(pid)
            results[i] = {"code": os.waitstatus_to_exitcode(status), "seconds": time.monotonic() - start,
                          "max_rss": usage.ru_maxrss * 1024,
                          "stderr": Path(err).read_bytes().decode("utf-8", "replace")}
    for r in results:
        print(json.dumps(r))


if __name__ == "__main__":
    main(sys.argv[1])
