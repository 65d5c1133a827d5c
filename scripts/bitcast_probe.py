"""Does XLA on the GPU pass a u8 -> u32 `bitcast_convert_type` to a Pallas call as a bitcast (no copy)?

    python scripts/bitcast_probe.py > scripts/results/bitcast_probe_<device>.txt

The int8-activation GEMV (pallas_kernels/gemv_int8.py) reads the packed quant bytes as 32-bit words through such a
bitcast in its wrapper; a copy there would stream the weight twice. Prints the optimized HLO's bitcast, fusion and
custom-call lines (cut at 200 characters: the custom call carries the kernel's IR) and the time of a call that sums
a 64 MiB u8 array read as words.
"""

import time

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

N, K = 16384, 4096  # 64 MiB of bytes, read as 1024 words a row


def kernel(w_ref, o_ref):
    o_ref[...] = jnp.sum(w_ref[...].astype(jnp.float32), axis=1)[:, None] * jnp.ones((1, 32), jnp.float32)


def words_then_kernel(a: jax.Array) -> jax.Array:
    w = jax.lax.bitcast_convert_type(a.reshape(N, K // 4, 4), jnp.uint32)
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((N, 32), jnp.float32), grid=(N // 16,),
                          in_specs=[pl.BlockSpec((16, K // 4), lambda i: (i, 0))],
                          out_specs=pl.BlockSpec((16, 32), lambda i: (i, 0)))(w)


def main() -> None:
    if jax.default_backend() != "gpu":
        raise SystemExit("bitcast_probe.py asks what XLA's GPU compiler does: run it on a GPU")
    a = jax.random.randint(jax.random.key(0), (N, K), 0, 255).astype(jnp.uint8)
    run = jax.jit(words_then_kernel)
    hlo = run.lower(a).compile().as_text()
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}")
    wanted = ("bitcast", "fusion", "custom-call")
    print("\n".join(line[:200] for line in hlo.splitlines() if any(w in line for w in wanted)))
    run(a).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(20):
        out = run(a)
    out.block_until_ready()
    print(f"per call: {(time.perf_counter() - t0) / 20 * 1e6:.1f} us for {N * K / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
