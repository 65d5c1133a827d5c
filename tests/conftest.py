"""Shared test setup: fixture paths, the `gpu` marker, CPU-only JAX unless a GPU run is asked for."""

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers must not look for hub kernels: no network here or in CI

ROOT = Path(__file__).resolve().parents[1]
# The reference fixtures live in ../shared/fixtures beside the checkout; a GPU run carries a copy in .fixtures/.
FIXTURES = Path(os.environ.get("DFLASH_FIXTURES", ROOT.parent / "shared" / "fixtures"))
if not FIXTURES.exists() and (ROOT / ".fixtures").exists():
    FIXTURES = ROOT / ".fixtures"
TINY = FIXTURES / "tiny-qwen35"
TINY_GGUF = TINY / "model-q4_k_m.gguf"


def pytest_collection_modifyitems(config, items):
    import jax

    if jax.default_backend() == "gpu":
        # The references are float32 oracles checked to 1e-4: GPUs default to TF32 matmuls, which alone move the
        # fixture's logits by ~1e-3 (seen on an H100, jax 0.11.2), so tests ask for full float32 products.
        jax.config.update("jax_default_matmul_precision", "highest")
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def jit_cache(tmp_path_factory) -> str:
    """One persistent compilation cache for every command a test runs in a subprocess: what one command compiled,
    the next one loads (the cache is keyed by the program, so this shares time, not results)."""
    return str(tmp_path_factory.mktemp("jit"))


@pytest.fixture(scope="session")
def tiny_gguf_path() -> Path:
    if not TINY_GGUF.exists():
        pytest.skip(f"reference fixture {TINY_GGUF} is not present")
    return TINY_GGUF
