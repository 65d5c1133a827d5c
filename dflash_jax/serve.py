"""`python -m dflash_jax.serve`: an OpenAI- and Anthropic-compatible HTTP server over one model pair.

    python -m dflash_jax.serve --target Qwen3.5-27B-Q4_K_M.gguf --draft Qwen3.5-27B-DFlash --port 8000

Endpoints: GET /health, GET /v1/models, POST /v1/chat/completions, POST /v1/completions, POST /v1/responses, POST
/v1/messages and POST /v1/messages/count_tokens, streaming as server-sent events. Requests are served one at a time
(batch 1) from a bounded queue; a request that extends the previous one's conversation continues from its state on
the device, and one that extends an earlier snapshot (--prefix_cache_gb) from a copy of it. Requests may sample
(temperature, top_p, top_k, min_p, seed; n choices); --temperature, --top_p, --top_k, --min_p and --seed are the
defaults of requests that leave them out; --reasoning_budget N closes a reply's think block after N tokens. Needs the
`server` extra (`pip install "dflash-jax[server]"`).
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Sequence

from dflash_jax.defaults import least_free
from dflash_jax.engine.sampling import SamplingParams
from dflash_jax.errors import run_main
from dflash_jax.generate import UsageError, define_model_flags, engine_from_flags, parse_flags


def _log(line: str) -> None:
    print(f"serve: {line}", file=sys.stderr, flush=True)


def model_name(target_path: str) -> str:
    """What /v1/models lists: the target's file or directory name without a .gguf suffix."""
    name = os.path.basename(os.path.normpath(target_path))
    return name[:-5] if name.endswith(".gguf") else name


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, made before the model loads: one that cannot be bound is a UsageError."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (OSError, UnicodeError) as e:  # an unknown host name; one that cannot be encoded
        raise UsageError(f"cannot listen on {host}:{port}: {getattr(e, 'strerror', None) or e}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: no wait after a restart
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def default_sampling(f) -> SamplingParams:
    """What requests that leave out temperature, top_p, top_k or min_p get: the sampling flags, checked (--seed too,
    which `Settings.seed` carries: a sampled request without a seed gets it, else one drawn for it)."""
    return SamplingParams(temperature=f.temperature, top_p=f.top_p, top_k=f.top_k, min_p=f.min_p,
                          seed=0 if f.seed is None else f.seed)


DEFAULT_PREFIX_CACHE_GB = 4.0  # about five snapshots of an 8K-token context of the 27B pair (0.8 GiB each)


def prefix_cache_bytes(gb: float | None, state_bytes: int, free: int | None) -> int:
    """The prefix cache's budget: --prefix_cache_gb GiB, refused if it does not fit the device's free memory beside a
    context's caches (`state_bytes`); unset, the default or half of that room, whichever is less."""
    room = None if free is None else max(free - state_bytes, 0)
    if gb is None:
        default = int(DEFAULT_PREFIX_CACHE_GB * 2**30)
        return default if room is None else min(default, room // 2)
    asked = int(gb * 2**30)
    if room is not None and asked > room:
        raise UsageError(f"--prefix_cache_gb {gb:g} does not fit: the device has {room / 2**30:.2f} GiB free beside a "
                         "context's caches (lower --prefix_cache_gb or --max_ctx; 0 turns the cache off)")
    return asked


def run(argv: Sequence[str]) -> int:
    """Bind the address, load the pair, compile, serve until interrupted; returns the exit code."""
    from absl import flags

    try:
        import uvicorn

        from dflash_jax.server.app import build_app
    except ImportError as e:
        raise UsageError(f"the server needs the 'server' extra ({e.name} is missing): pip install "
                         "\"dflash-jax[server]\"") from None
    from dflash_jax.server.request import Settings
    from dflash_jax.server.worker import Worker

    f = flags.FLAGS
    sampling = default_sampling(f)  # a bad value ends here, before the address is bound
    with listen(f.host, f.port) as sock:  # a port in use or a bad host ends here, not after loading and compiling
        engine, models, target_path = engine_from_flags(argv, "serve")
        if f.warmup:
            _log("compiling (one short generation)...")
            engine.generate([0], 2)
        settings = Settings(models.tokenizer, f.model_name or model_name(target_path), f.max_ctx,
                            models.target.config.vocab_size, f.n_gen, f.thinking, sampling, f.seed,
                            f.reasoning_budget)
        cache = prefix_cache_bytes(f.prefix_cache_gb, engine.state_bytes(per_device=True),
                                   least_free(engine.devices)[0])
        worker = Worker(engine, models.tokenizer, f.max_queue, log=_log if f.stats else lambda _: None,
                        prefix_cache_bytes=cache)
        port = sock.getsockname()[1]  # the one the system chose for --port 0
        host = f"[{f.host}]" if ":" in f.host else f.host  # an IPv6 address
        _log(f"{settings.model} ({f.mode}, context {f.max_ctx}, prefix cache {cache / 2**30:.2f} GiB) on "
             f"http://{host}:{port}")
        config = uvicorn.Config(build_app(worker, settings), host=f.host, port=port, log_level="info",
                                timeout_graceful_shutdown=5)
        try:
            uvicorn.Server(config).run(sockets=[sock])
        except KeyboardInterrupt:  # uvicorn shuts down cleanly on Ctrl+C, then raises it again (uvicorn.run hides it)
            pass
        finally:
            worker.close()
    return 0


def main(argv: Sequence[str]) -> None:
    run_main("serve", run, argv)


def define_flags() -> None:
    """The server's absl flags: the shared model flags and the HTTP ones."""
    from absl import flags

    define_model_flags(0, "Context of a request, prompt and reply together, in tokens.", max_ctx=8192,
                       n_gen_help="max_tokens for requests that give none (0: the rest of the context).")
    flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0 for every interface).")
    flags.DEFINE_integer("port", 8000, "Port to listen on.", lower_bound=0, upper_bound=65535)
    flags.DEFINE_string("model_name", None, "Model id that /v1/models lists and responses carry (default: the "
                        "target's file name).")
    flags.DEFINE_integer("max_queue", 16, "Requests that may wait while one runs; more get HTTP 429.", lower_bound=1)
    flags.DEFINE_float("prefix_cache_gb", None, "GiB of device memory for snapshots of earlier prompts and replies, "
                       "which later requests continue from (0: off, only the last request's state is reused; default: "
                       f"{DEFAULT_PREFIX_CACHE_GB:g}, or half the free memory if less).", lower_bound=0)
    flags.DEFINE_integer("reasoning_budget", None, "Close the think block of a reply after this many tokens, for "
                         "requests that give no budget (default: no limit).", lower_bound=1)
    flags.DEFINE_boolean("warmup", True, "Compile before listening, so the first request does not wait for it.")


if __name__ == "__main__":
    from absl import app

    define_flags()
    app.run(main, flags_parser=lambda argv: parse_flags(argv, "serve"))
