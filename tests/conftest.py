"""Shared test setup: fixture paths (tests/fixtures), the tiny target with Qwen3.5's chat template, the `gpu` marker
(skipped, and counted, without a GPU), one compilation cache for the run."""

import os
import shutil
import tempfile
from pathlib import Path

import jax
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers must not look for hub kernels: no network here or in CI
# The tests draw random inputs of many distinct shapes, and jax compiles its default generator (threefry) anew for
# each shape: about half a second on a CPU, over a fifth of the suite's compile time. The RBG generator compiles in
# a fraction of that; its keys work everywhere the default ones do (the CLI commands the tests start keep theirs).
jax.config.update("jax_default_prng_impl", "unsafe_rbg")

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"  # the reference data, committed (tests/fixtures/README.md)
TINY = FIXTURES / "tiny-qwen35"
TINY_GGUF = TINY / "model-q4_k_m.gguf"
QWEN35_TEMPLATE = FIXTURES / "templates" / "qwen3.5.jinja"  # the published Qwen3.5 template (templates/README.md)


def pytest_configure(config):
    # One persistent compilation cache for the whole run: the xdist workers (started by this, the controller, with
    # its environment), the tests in them and the commands they start. Many tests build an engine anew, whose jitted
    # functions then compile programs another test compiled already; keyed by the program, the cache shares compile
    # time, not results.
    if not hasattr(config, "workerinput"):
        os.environ["DFLASH_TEST_JIT_CACHE"] = tempfile.mkdtemp(prefix="dflash-test-jit-")
        config.add_cleanup(lambda: shutil.rmtree(os.environ.pop("DFLASH_TEST_JIT_CACHE"), ignore_errors=True))
    jax.config.update("jax_compilation_cache_dir", os.environ["DFLASH_TEST_JIT_CACHE"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    """After each test file, drop jax's in-memory compiled programs: a worker that kept every file's programs grew
    to several GiB over the run, two of them beside the commands the tests start on a 24 GiB machine. A later file
    that needs one again reads it back from the persistent cache."""
    yield
    jax.clear_caches()


NO_GPU = "needs a CUDA GPU (run `pytest -m gpu` on the device)"


def pytest_collection_modifyitems(config, items):
    if jax.default_backend() == "gpu":
        # The references are float32 oracles checked to 1e-4: GPUs default to TF32 matmuls, which alone move the
        # fixture's logits by ~1e-3 (seen on an H100, jax 0.11.2), so tests ask for full float32 products.
        jax.config.update("jax_default_matmul_precision", "highest")
        return
    skip = pytest.mark.skip(reason=NO_GPU)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    # Under xdist the workers mark the items; their reports reach the controller, which counts them here.
    n = sum(1 for r in terminalreporter.stats.get("skipped", []) if NO_GPU in str(r.longrepr))
    if n:
        terminalreporter.write_line(f"{n} GPU tests skipped: no CUDA GPU here (run `python -m pytest -m gpu` on a GPU "
                                    "machine)")


@pytest.fixture(scope="session")
def jit_cache() -> str:
    """The run's persistent compilation cache (`pytest_configure`), for the commands a test starts."""
    return os.environ["DFLASH_TEST_JIT_CACHE"]


@pytest.fixture(scope="session")
def tiny_gguf_path() -> Path:
    """The tiny Qwen3.5 target of the fixtures."""
    return TINY_GGUF


@pytest.fixture(scope="session")
def qwen35_gguf_path(tmp_path_factory) -> Path:
    """The tiny target with the published Qwen3.5 chat template as its `tokenizer.chat_template`, every other key and
    tensor the fixture's: a model whose own template renders tools, reasoning and tool results (docs/testing.md)."""
    from gguf import GGUFValueType as VT

    from dflash_jax.testing.gguf_writer import rewrite_gguf

    path = tmp_path_factory.mktemp("qwen35-template") / TINY_GGUF.name
    rewrite_gguf(TINY_GGUF, path, set_keys=[("tokenizer.chat_template", QWEN35_TEMPLATE.read_text(), VT.STRING, None)])
    return path
