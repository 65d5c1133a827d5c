"""dflash-jax: Qwen3.5/3.6 hybrid models with DFlash drafting and DDTree verification in JAX."""
