"""Pallas GPU kernels of dflash-jax, each beside its jnp reference (quantized matmul, tree attention, gated delta
rule). The package imports only jax, numpy and itself."""
