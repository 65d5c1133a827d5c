"""The decode state's size for the 27B pair in each KV type: the target's KV cache and the drafter's context cache per
1K tokens, what stays fixed (the GDN state, the drafter's rings), and totals at a long context, for both 27B drafters
(Qwen3.5's 5 full-attention layers, Qwen3.6's 4 sliding-window + 1 full), with the drafter's whole context and with a
bounded one (--draft_ctx).

    python scripts/state_sizes.py --out scripts/results/state_sizes_27b.txt

Every size comes from `jax.eval_shape` of the functions that allocate the state (`models.target.init_state`,
`models.draft.init_draft_state`, as `Engine.state_bytes` counts them): nothing is allocated. The target's cache has
64 slots of tree slack beyond the context; "per 1K tokens" is the growth from one context to 1,024 tokens more, and
"fixed" is the rest (the GDN state; a ring of a sliding window or a --draft_ctx bound).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchlib import environment  # noqa: E402

from dflash_jax.config import KV_TYPES, MAX_TREE_NODES, load_draft_config, load_target_config  # noqa: E402
from dflash_jax.models.draft import init_draft_state  # noqa: E402
from dflash_jax.models.target import init_state  # noqa: E402
from dflash_jax.engine.state import tree_bytes  # noqa: E402
from dflash_jax.testing.synthetic import DRAFT_27B, TARGET_27B  # noqa: E402
from dflash_jax.testing.tiny import CONFIG_DIR  # noqa: E402

DRAFTERS = {"3.5 (5 full)": DRAFT_27B, "3.6 (4 SWA + 1 full)": str(Path(CONFIG_DIR) / "qwen3.6-27b-dflash.json")}
MIB = 2**20


def parts(tcfg, dcfg, ctx: int, kv_type: str, draft_ctx: int | None) -> dict[str, int]:
    """Bytes of each part of the state for a context of ctx tokens (K and V both of kv_type)."""
    target = jax.eval_shape(lambda: init_state(tcfg, ctx + MAX_TREE_NODES, kv_type))
    draft = jax.eval_shape(lambda: init_draft_state(dcfg, ctx, (kv_type, kv_type), draft_ctx))
    return {"target_kv": tree_bytes((target.k, target.v)), "gdn": tree_bytes((target.conv, target.ssm)),
            "drafter": tree_bytes((draft.k, draft.v))}


def growth(tcfg, dcfg, ctx: int, kv_type: str, draft_ctx: int | None) -> dict[str, tuple[float, float]]:
    """Per part: (MiB per 1K tokens, fixed MiB) at a context of ctx tokens (ctx a multiple of 1,024)."""
    at, before = parts(tcfg, dcfg, ctx, kv_type, draft_ctx), parts(tcfg, dcfg, ctx - 1024, kv_type, draft_ctx)
    return {name: ((at[name] - before[name]) / MIB, (at[name] - ctx // 1024 * (at[name] - before[name])) / MIB)
            for name in at}


def cell(per_1k: float, fixed: float) -> str:
    """MiB per 1K tokens, with what stays fixed beside it."""
    return (f"{per_1k:.1f}" if per_1k else "-") + (f" (+ {fixed:.0f})" if fixed else "")


def table(ctx: int, draft_ctx: int) -> str:
    """The sizes as markdown tables: per 1K tokens and fixed, then totals at ctx tokens."""
    tcfg = load_target_config(TARGET_27B)
    drafters = {name: load_draft_config(path) for name, path in DRAFTERS.items()}
    bounds = (None, draft_ctx)
    cols = [(n, b) for n in drafters for b in bounds]
    name = lambda n, b: f"drafter {n}, draft_ctx {b or '0 (all)'}"  # noqa: E731
    lines = [f"## MiB per 1K tokens (+ fixed MiB), at a context of {ctx:,} tokens", "",
             "| KV type | target KV | GDN state | " + " | ".join(name(n, b) for n, b in cols) + " |",
             "|---" * (3 + len(cols)) + "|"]
    totals = [f"## The whole state at {ctx:,} tokens (GiB)", "",
              "| KV type | " + " | ".join(name(n, b) for n, b in cols) + " |", "|---" * (1 + len(cols)) + "|"]
    for kv_type in KV_TYPES:
        sizes = {(n, b): growth(tcfg, drafters[n], ctx, kv_type, b) for n, b in cols}
        first = sizes[cols[0]]
        lines.append("| " + " | ".join([kv_type, cell(*first["target_kv"]), cell(*first["gdn"])]
                                       + [cell(*sizes[c]["drafter"]) for c in cols]) + " |")
        whole = [sum(parts(tcfg, drafters[n], ctx, kv_type, b).values()) / 2**30 for n, b in cols]
        totals.append("| " + " | ".join([kv_type] + [f"{x:.2f}" for x in whole]) + " |")
    return "\n".join(lines + [""] + totals) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=262144, help="the context the sizes are taken at (a multiple of 1,024)")
    ap.add_argument("--draft_ctx", type=int, default=2048, help="the drafter's context bound of the bounded columns")
    ap.add_argument("--out", type=Path, default=None, help="also write the tables to this file")
    args = ap.parse_args(argv)
    if args.ctx % 1024 or args.ctx < 2048:
        ap.error(f"--ctx {args.ctx}: a multiple of 1,024, at least 2,048")
    env = environment()
    command = " ".join(["python", "scripts/state_sizes.py", *(argv if argv is not None else sys.argv[1:])])
    text = f"# {env['date']}, jax {env['jax']} (shapes only: jax.eval_shape)\n# {command}\n\n" + table(
        args.ctx, args.draft_ctx)
    if args.out:
        args.out.write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
