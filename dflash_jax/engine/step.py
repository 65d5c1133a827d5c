"""One speculative decoding step as a single jitted function (DESIGN.md "One step"), state donated.

draft -> tree -> target verify -> acceptance walk -> commit, all on the device. The pending root token (the
previous step's bonus) is verified as node 0; the step emits the accepted nodes' tokens and the new bonus.
Modes: `ar` (the root alone), `chain` (the draft's block as a chain), `ddtree` (best-first tree).

Each node draws the token after it: the target's argmax (greedy) or, with a `Sampling` argument, the coupled Gumbel
rule of dflash_jax/engine/sampling.py with the noise of that token's absolute position. The walk follows the child
equal to its parent's draw, so every emitted token is the one AR would emit.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.config import DraftConfig, EngineConfig, KernelConfig, TargetConfig
from dflash_jax.engine import programs
from dflash_jax.engine.sampling import Sampling, draft_scores, gumbel_noise, sample
from dflash_jax.engine.state import DecodeState
from dflash_jax.engine.tree import Tree, accept, build_tree, chain_tree
from dflash_jax.kernels import REFERENCE
from dflash_jax.models import draft as draft_model
from dflash_jax.models import target

MAX_STOP_IDS = 8  # stop tokens are passed as a fixed-size array (padded with -1) so a new set does not recompile


class Drafter(Protocol):
    """What the step needs from a drafter: a hashable static description with two pure functions."""

    block_size: int
    taps: tuple[int, ...]  # target layers whose outputs the drafter reads

    def propose(self, params: Any, state: Any, target_model: target.Target, root: jax.Array, position: jax.Array,
                depth: int) -> jax.Array:
        """Logits [depth, V] for depths 1..depth (static, at most block_size - 1) below the root, which sits at
        `position`."""

    def extend(self, params: Any, state: Any, taps: jax.Array, n_valid: jax.Array) -> Any:
        """The drafter state after committing the first n_valid rows of taps [n, n_taps, H]."""

    def init_state(self, slots: int, kv_types: tuple[str, str], context: int | None) -> Any:
        """An empty drafter state with room for `slots` committed tokens, its keys and values for KV types
        kv_types (K, V), seeing at most the last `context` of them (None: all)."""


@dataclasses.dataclass(frozen=True)
class DFlashDrafter:
    """The z-lab DFlash drafter (models/draft.py) behind the Drafter protocol; `kcfg` picks its kernels."""

    config: DraftConfig
    kcfg: KernelConfig = REFERENCE

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def taps(self) -> tuple[int, ...]:
        return self.config.target_layer_ids

    def propose(self, params, state, target_model, root, position, depth):
        # the head only on the rows the tree can use: it is most of a small drafter's step on a CPU
        hidden = draft_model.draft_hidden(params, self.config, state, target_model, root, self.kcfg)
        return target_model.lm_head(hidden[1:depth + 1], self.kcfg)

    def extend(self, params, state, taps, n_valid):
        return draft_model.extend_context(params, self.config, state, taps, n_valid, self.kcfg)

    def init_state(self, slots, kv_types, context):
        return draft_model.init_draft_state(self.config, slots, kv_types, context)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOut:
    """The tokens a step emits (accepted draft tokens, then the bonus) and how many of them are real."""

    tokens: jax.Array  # [width] int32
    count: jax.Array  # [] int32, 0 when the step did nothing
    off_spine: jax.Array  # [] bool: the accepted path took a draft token that was not the draft's top-1


def emit_width(ecfg: EngineConfig, block_size: int) -> int:
    """Most tokens one step can emit: the deepest accepted path plus the bonus."""
    if ecfg.mode == "ar":
        return 1
    depth = block_size - 1 if ecfg.mode == "chain" else min(block_size - 1, ecfg.budget)
    return depth + 1


def step_tree(ecfg: EngineConfig, root: jax.Array, logits: jax.Array | None, spmd: bool = False) -> Tree:
    """The tree a step verifies: the root alone (ar), the draft's chain, or the DDTree of the draft logits (`spmd`:
    in a program over several devices, `tree.build_tree`)."""
    if ecfg.mode == "ar":
        return Tree(tokens=root[None], parents=jnp.full(1, -1, jnp.int32), depths=jnp.zeros(1, jnp.int32),
                    valid=jnp.ones(1, bool), logw=jnp.zeros(1, jnp.float32))
    if ecfg.mode == "chain":
        return chain_tree(root, logits)
    return build_tree(root, logits, ecfg.budget, min(ecfg.topk, ecfg.budget), ecfg.seeds_chain(logits.shape[0]), spmd)


def _step(tweights: nnx.State, dweights: nnx.State, state: DecodeState, stop_ids: jax.Array,
          sampling: Sampling | None = None, *, tgraph: nnx.GraphDef, dgraph: nnx.GraphDef, tcfg: TargetConfig,
          drafter: Drafter | None, ecfg: EngineConfig, kcfg: KernelConfig, axis: str | None = None
          ) -> tuple[DecodeState, StepOut]:
    # the models as modules again, at trace time only: the compiled step takes their weights as arrays (with `axis`,
    # one shard's weights and local config, inside the mesh's shard_map: dflash_jax/parallel.py)
    tparams, dparams = nnx.merge(tgraph, tweights), nnx.merge(dgraph, dweights)
    width = emit_width(ecfg, drafter.block_size if drafter else 1)
    taps = drafter.taps if drafter else ()

    # A step after `done` (the host loop queues one past the end) runs but changes nothing a later step reads: the
    # commit keeps the GDN state and the length, so only cache slots past the committed length (scratch) are written.
    # A lax.cond that skipped the work made XLA copy the whole state every step (a conditional's result is a new
    # buffer); a while loop of at most one trip avoided the copy but measured 8 ms slower a step on an H100 (likely
    # the host reading back its condition, which stops it queueing the next step).
    done = state.done
    position = state.target.length
    # the noise of the tokens at positions position + 1 .. position + width, drawn by the nodes at depths 0..width-1
    noise = None if sampling is None else gumbel_noise(sampling.seed, position + 1 + jnp.arange(width), tcfg.vocab_size)
    logits = None
    if ecfg.mode != "ar":
        logits = drafter.propose(dparams, state.draft, tparams, state.root, position, width - 1)
        if sampling is not None:
            logits = draft_scores(logits, noise[:width - 1], sampling, ecfg.draft_rule)
    tree = step_tree(ecfg, state.root, logits, spmd=axis is not None)
    tlogits, tapped, tstate, verified = target.verify(tparams, tcfg, state.target, tree.tokens, tree.parents, taps,
                                                      kcfg, axis=axis)
    posterior = sample(tlogits, None if noise is None else noise[tree.depths], sampling)
    leaf = accept(tree, verified.block.anc, posterior, state.remaining - 1, stop_ids)
    tstate = target.commit(tstate, verified, leaf, kcfg, skip=done)
    depth = tree.depths[leaf]
    # path[d] = the accepted node at depth d (d <= depth), in path order
    path = target.path_nodes(verified.block, leaf, width)
    bonus = posterior[leaf]
    count = jnp.where(done, 0, depth + 1)
    out = jnp.where(jnp.arange(width) < depth, tree.tokens[path[jnp.minimum(jnp.arange(width) + 1, width - 1)]],
                    bonus)
    out = jnp.where(done, 0, out)
    off_spine = jnp.bool_(False)
    if logits is not None:
        on_path_nodes = jnp.arange(width) < depth  # out[:depth] are the accepted draft tokens
        top1 = jnp.argmax(logits, axis=-1)[:width - 1]
        off_spine = ~done & jnp.any(on_path_nodes[:width - 1] & (out[:width - 1] != top1))
    dstate = state.draft
    if drafter is not None:
        dstate = drafter.extend(dparams, state.draft, tapped[path], count)
    emitted_stop = jnp.any(jnp.isin(out, stop_ids) & (jnp.arange(width) < count))
    remaining = state.remaining - count
    new = DecodeState(target=tstate, draft=dstate, root=jnp.where(done, state.root, bonus), remaining=remaining,
                      done=done | emitted_stop | (remaining <= 0))
    return new, StepOut(tokens=out, count=count, off_spine=off_spine)


@functools.lru_cache(maxsize=None)
def make_step(tcfg: TargetConfig, drafter: Drafter | None, ecfg: EngineConfig, tgraph: nnx.GraphDef,
              dgraph: nnx.GraphDef, kcfg: KernelConfig = REFERENCE, parallel: Any = None):
    """The jitted step for one (target, drafter, engine, kernel) configuration and the graphs of the target and the
    drafter's params (`nnx.split`): (tweights, dweights, state, stop_ids, sampling) -> (state, StepOut), the state
    donated; sampling None (greedy) and a Sampling compile apart. With `parallel` (a dflash_jax.parallel.
    TargetParallel) the step is one program over its mesh, tgraph one shard's graph and tweights all shards'. With
    `ecfg.program_cache` (one device) its lowered program is kept there between processes (engine/programs.py)."""
    if ecfg.mode != "ar" and drafter is None:
        raise ValueError(f"mode {ecfg.mode!r} needs a drafter")
    if parallel is None:
        step = jax.jit(functools.partial(_step, tgraph=tgraph, dgraph=dgraph, tcfg=tcfg, drafter=drafter, ecfg=ecfg,
                                         kcfg=kcfg), donate_argnums=(2,))
        if not ecfg.program_cache:
            return step
        describe = (f"step {tcfg!r} {drafter!r} {dataclasses.replace(ecfg, program_cache='')!r} {kcfg!r} "
                    f"graphs {programs.graph_digest(tgraph, dgraph)}")
        return programs.stored(step, describe, ecfg.program_cache, donate=(2,), weights=(0, 1))
    step = functools.partial(_step, tgraph=tgraph, dgraph=dgraph, tcfg=parallel.local, drafter=drafter, ecfg=ecfg,
                             kcfg=kcfg, axis=parallel.axis)
    return jax.jit(parallel.step(step), donate_argnums=(2,))
