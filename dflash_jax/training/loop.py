"""The training loop shared by the target and the drafter: AdamW with warmup and cosine decay, global-norm clipping,
float32 weights and optimizer state, a jitted step over (params, frozen, tokens, key), progress lines, held-out
checks and checkpoints. Deterministic: the batch order and each step's key come from the seed and the step number,
so a run resumed from a checkpoint is the same run."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dflash_jax.training.data import DataError

LossFn = Callable[[Any, Any, jax.Array, jax.Array], tuple[jax.Array, dict[str, jax.Array]]]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Steps, batch shape and optimizer settings (specs/dflash_training.md §4)."""

    steps: int = 2000
    batch: int = 8  # sequences per step
    seq_len: int = 256  # a multiple of the target's prefill chunk (64)
    lr: float = 6e-4
    warmup: float = 0.04  # fraction of the steps
    clip: float = 1.0
    weight_decay: float = 0.0
    seed: int = 0


def optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """AdamW (0.9, 0.999), linear warmup then cosine to zero, global-norm clipping."""
    warmup = max(1, int(round(tc.warmup * tc.steps)))
    schedule = optax.warmup_cosine_decay_schedule(0.0, tc.lr, warmup, max(tc.steps, warmup + 1), 0.0)
    return optax.chain(optax.clip_by_global_norm(tc.clip),
                       optax.adamw(schedule, 0.9, 0.999, weight_decay=tc.weight_decay))


class Trainer:
    """loss_fn(params, frozen, tokens [batch, S], key) -> (loss, metrics) trained from init_fn(key)'s params;
    `frozen` (e.g. the target under a drafter) is passed to every step, never differentiated."""

    def __init__(self, loss_fn: LossFn, init_fn: Callable[[jax.Array], Any], tc: TrainConfig, frozen: Any = None):
        self.loss_fn, self.init_fn, self.tc, self.frozen = loss_fn, init_fn, tc, frozen
        self.opt = optimizer(tc)

        def step(params, opt_state, frozen, tokens, key):
            (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, frozen, tokens, key)
            updates, opt_state = self.opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, {**metrics, "grad_norm": optax.tree.norm(grads)}

        self.step_fn = jax.jit(step, donate_argnums=(0, 1))
        self.eval_fn = jax.jit(lambda params, frozen, tokens, key: loss_fn(params, frozen, tokens, key)[1])

    def init(self) -> tuple[Any, optax.OptState]:
        params = self.init_fn(jax.random.key(self.tc.seed))
        return params, self.opt.init(params)

    def evaluate(self, params: Any, held_out: np.ndarray) -> dict[str, float]:
        """Mean metrics over the held-out sequences (whole batches; the same keys every time)."""
        rows = len(held_out) - len(held_out) % self.tc.batch
        if rows == 0:
            raise DataError(f"{len(held_out)} held-out sequences do not fill one batch of {self.tc.batch}")
        sums: dict[str, float] = {}
        for i in range(0, rows, self.tc.batch):
            m = self.eval_fn(params, self.frozen, jnp.asarray(held_out[i:i + self.tc.batch]),
                             jax.random.key(10_000 + i))
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        return {k: v / (rows // self.tc.batch) for k, v in sums.items()}

    def run(self, params: Any, opt_state, batches: Iterator[np.ndarray], start: int = 0,
            log: Callable[[str], None] = print, every: int = 50,
            on_checkpoint: Callable[[int, Any, optax.OptState], None] | None = None, save_every: int = 0,
            held_out: np.ndarray | None = None, eval_every: int = 0,
            history: list[dict] | None = None) -> tuple[Any, optax.OptState]:
        """Train from step `start` (the last step also checkpoints); returns the params and optimizer state. Logged
        metrics are appended to `history` as they come."""
        history = [] if history is None else history
        t0, seen = time.perf_counter(), 0
        for step in range(start, self.tc.steps):
            key = jax.random.fold_in(jax.random.key(self.tc.seed + 1), step)
            params, opt_state, metrics = self.step_fn(params, opt_state, self.frozen, jnp.asarray(next(batches)),
                                                      key)
            seen += 1
            done = step + 1
            if done % every == 0 or done == self.tc.steps:
                m = {k: float(metrics[k]) for k in sorted(metrics, key=lambda k: (k != "loss", k))}  # loss first
                if not all(map(math.isfinite, m.values())):
                    raise FloatingPointError(f"step {done}: non-finite metrics {m}")
                rate = seen * self.tc.batch / (time.perf_counter() - t0)
                eta = (self.tc.steps - done) * self.tc.batch / rate
                shown = "  ".join(f"{k} {v:.4g}" for k, v in m.items())
                log(f"step {done}/{self.tc.steps}  {shown}  {rate:.1f} seq/s  eta {eta:.0f} s")
                history.append({"step": done, **m})
            if held_out is not None and len(held_out) >= self.tc.batch and eval_every and \
                    (done % eval_every == 0 or done == self.tc.steps):
                e = self.evaluate(params, held_out)
                e = {k: e[k] for k in sorted(e, key=lambda k: (k != "loss", k))}
                log(f"step {done}: held-out " + "  ".join(f"{k} {v:.4g}" for k, v in e.items()))
                history.append({"step": done, **{f"eval_{k}": v for k, v in e.items()}})
            if on_checkpoint and (save_every and done % save_every == 0 or done == self.tc.steps):
                on_checkpoint(done, params, opt_state)
        return params, opt_state
