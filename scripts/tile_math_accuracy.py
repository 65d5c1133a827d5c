"""How far the fixture model's logits under `impl="pallas"` land from HF transformers' float32 logits on the same
dequantized weights (`hf_q_logits`), for each way the tensor-core kernel dequantizes Q4_K/Q6_K tiles (qmatmul's
`tile_math`), beside llama.cpp's own run of the file. The prefill of the fixture's 48 tokens runs through the
tensor-core kernel (on a CPU in interpret mode, where the inline PTX is replaced by its jnp emulation, which gives
the same tiles up to rounding ties).

    python scripts/tile_math_accuracy.py --out scripts/results/tile_math_accuracy_cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import environment, qmatmul_defaults, set_qmatmul_defaults  # noqa: E402

from dflash_jax.engine.prefill import prefill_chunks  # noqa: E402
from dflash_jax.engine.state import init_state  # noqa: E402
from dflash_jax.load import load_target  # noqa: E402
from pallas_kernels import qmatmul as qm  # noqa: E402

# (Q4_K, Q6_K) tile arithmetic per row
SETTINGS = [("f32", "f32"), ("bf16x2", "f32"), ("bf16x2", "bf16x2"), ("f16x2", "f32"), ("f16x2", "f16x2")]


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--fixtures", default=str(ROOT / "tests" / "fixtures" / "tiny-qwen35"))
    args = ap.parse_args()
    fx = Path(args.fixtures)
    refs, ids = np.load(fx / "ref.npz"), np.load(fx / "tokens.npy")
    want = refs["hf_q_logits"]
    model = load_target(str(fx / "model-q4_k_m.gguf"), progress=False, impl="pallas")
    rows = [dict(tiles="llama.cpp (CPU, 8-bit activations)", rel=rel(refs["llama_q4_k_m_logits"], want),
                 argmax_equal=float(np.mean(refs["llama_q4_k_m_logits"].argmax(-1) == want.argmax(-1))))]
    shipped = qmatmul_defaults()
    try:
        for q4, q6 in SETTINGS:
            qm.TILE_MATH.update(Q4_K=q4, Q6_K=q6)
            jax.clear_caches()  # the kernels read TILE_MATH when traced
            logits = np.concatenate([np.asarray(lg) for _, lg, _, _ in prefill_chunks(
                model.params, model.config, init_state(model.config, 160), ids, all_logits=True, impl=model.impl)])
            rows.append(dict(tiles=f"Q4_K {q4}, Q6_K {q6}", rel=rel(logits, want),
                             argmax_equal=float(np.mean(logits.argmax(-1) == want.argmax(-1)))))
            print(f"{rows[-1]['tiles']:40s} {rows[-1]['rel']:.2e}", flush=True)
    finally:
        set_qmatmul_defaults(shipped)
    Path(args.out).write_text(json.dumps(dict(**environment(), shipped=dict(qm.TILE_MATH), rows=rows), indent=1))
    print(f"\nfixture model vs hf_q_logits ({len(ids)} tokens; shipped tile_math {dict(qm.TILE_MATH)})")
    print(f"{'tiles':40s} {'rel. error':>10s} {'argmax equal':>13s}")
    for r in rows:
        print(f"{r['tiles']:40s} {r['rel']:10.2e} {r['argmax_equal']:13.3f}")


if __name__ == "__main__":
    main()
