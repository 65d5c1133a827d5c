"""The target tensor-parallel over a 1-D mesh of local devices: one SPMD program (docs/architecture.md, "Several
devices").

Each shard holds a slice of every layer (`shard_tensors`): attention by KV heads (the query heads of their groups),
the Gated DeltaNet by key heads with the value heads that read them, the MLP's gate/up by rows and down by
columns, the head by rows; the norms and the embedding are replicated. Inside `jax.shard_map` each shard runs the
model code on a local config (`local_config`: heads and intermediate size divided), the partial outputs of o_proj,
out_proj and down_proj are summed (`target._forward`'s all-reduces) and the head's logits gathered
(`layers.GatheredLinear`). The KV cache, the conv and the recurrent state live sharded by head; everything else
(tree, acceptance, drafter) runs replicated.

GGUF tiles value heads (value head h reads key head h mod nk), so a contiguous split of value heads would not follow
a contiguous split of key heads: shard s takes value heads t * nk + s * nk_l + m (t < nv / nk, m < nk_l = nk / n), in
that order, and its local tiling (value head j reads key head j mod nk_l) then reads the right ones. The sum over the
shards' out_proj columns undoes the permutation.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dflash_jax.config import FULL_ATTENTION, ConfigError, KernelConfig, ParallelConfig, TargetConfig
from dflash_jax.engine.prefill import SplitTarget, split_weights
from dflash_jax.kernels import REFERENCE
from dflash_jax.load import prepare_target
from dflash_jax.models import target
from dflash_jax.models.target import Target, TargetState, init_state, target_tensors
from dflash_jax.quant import FORMATS, QTensor

# module names whose weights every shard holds whole
REPLICATED = frozenset({"embed_tokens", "norm", "input_layernorm", "post_attention_layernorm", "q_norm", "k_norm"})


def check_present(n: int) -> None:
    """Raise ConfigError unless n local devices are present."""
    present = jax.local_device_count()
    if n > present:
        raise ConfigError(f"--devices {n}: only {present} local device(s) present ({jax.default_backend()})")


def parallel_config(devices: str | int) -> ParallelConfig:
    """The ParallelConfig of a `--devices` value: a count of local devices that are present, or "all"."""
    if devices == "all":
        return ParallelConfig(jax.local_device_count())
    try:
        count = int(devices)
    except (TypeError, ValueError):
        raise ConfigError(f"--devices {devices!r} should be a device count or 'all'") from None
    if count < 1:
        raise ConfigError(f"--devices {count} must be at least 1 (or 'all')")
    check_present(count)
    return ParallelConfig(count)


def load_layout(kcfg: KernelConfig, pcfg: ParallelConfig) -> KernelConfig:
    """The layout to load a target in: the kernels' own on one device; on several the reference one (matrices as
    stored), since the split comes first and each shard is laid out for `kcfg` after (`ShardedTarget.over`)."""
    return kcfg if pcfg.devices == 1 else REFERENCE


def split_target(model: Target, kcfg: KernelConfig, pcfg: ParallelConfig) -> SplitTarget:
    """The model split once for the jitted functions: on one device as it is (`SplitTarget.of`: its matrices
    already in `kcfg`'s layout), on several over a mesh (`ShardedTarget.over`)."""
    return SplitTarget.of(model) if pcfg.devices == 1 else ShardedTarget.over(model, kcfg, pcfg)


def local_config(cfg: TargetConfig, n: int) -> TargetConfig:
    """The config one of n shards runs: heads and intermediate size divided by n."""
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // n, num_kv_heads=cfg.num_kv_heads // n,
                               intermediate_size=cfg.intermediate_size // n,
                               linear_num_key_heads=cfg.linear_num_key_heads // n,
                               linear_num_value_heads=cfg.linear_num_value_heads // n)


def _block(x: Any) -> int:
    """Columns per block of a stored matrix: its quant's block, 1 for a dense one."""
    return FORMATS[x.fmt].block_size if isinstance(x, QTensor) else 1


def check_split(cfg: TargetConfig, tensors: dict[str, Any], n: int) -> None:
    """Raise ConfigError unless the target splits n ways: heads, intermediate size and vocabulary divide, and the
    column slices of each quantized o_proj, out_proj and down_proj start and end on its blocks."""
    for what, count in (("KV heads", cfg.num_kv_heads), ("Gated DeltaNet key heads", cfg.linear_num_key_heads),
                        ("Gated DeltaNet value heads", cfg.linear_num_value_heads),
                        ("intermediate size", cfg.intermediate_size), ("vocabulary", cfg.vocab_size)):
        if count % n:
            raise ConfigError(f"--devices {n}: the target's {count} {what} do not split {n} ways")
    if n == 1:
        return
    # the contiguous column runs each shard takes from the row-split projections' inputs
    runs = {"attn_output.weight": cfg.num_heads // n * cfg.head_dim, "ffn_down.weight": cfg.intermediate_size // n,
            "ssm_out.weight": cfg.linear_num_key_heads // n * cfg.linear_value_head_dim}
    for name, x in tensors.items():
        base = name.split(".", 2)[-1]
        if base in runs and runs[base] % _block(x):
            raise ConfigError(f"--devices {n}: {name} is {x.fmt}, whose blocks of {_block(x)} columns do not split "
                              f"into slices of {runs[base]} columns")


def _rows(x: Any, idx: np.ndarray) -> Any:
    """Rows idx of a matrix (a QTensor or an array; a vector's entries)."""
    if isinstance(x, QTensor):
        return QTensor({k: v[idx] for k, v in x.data.items()}, x.fmt, (len(idx), x.shape[1]))
    return x[idx]


def _cols(x: Any, idx: np.ndarray) -> Any:
    """Columns idx of a matrix, whole blocks of a QTensor (check_split has checked that they are)."""
    if not isinstance(x, QTensor):
        return x[:, idx]
    block = _block(x)
    runs = idx.reshape(-1, block)
    assert np.all(runs[:, 0] % block == 0) and np.all(np.diff(runs, axis=1) == 1), "columns off the blocks"
    take = idx if block == 1 else runs[:, 0] // block
    return QTensor({k: v[:, take] for k, v in x.data.items()}, x.fmt, (x.shape[0], len(idx)))


def _span(shard: int, width: int) -> np.ndarray:
    return np.arange(shard * width, (shard + 1) * width)


def value_heads(cfg: TargetConfig, n: int, shard: int) -> np.ndarray:
    """The global value heads of a shard in its local order: those that read its key heads (module docstring)."""
    nk, local = cfg.linear_num_key_heads, cfg.linear_num_key_heads // n
    reps = cfg.linear_num_value_heads // nk
    return (np.arange(reps)[:, None] * nk + shard * local + np.arange(local)[None, :]).ravel()


def _layer_slices(cfg: TargetConfig, n: int, s: int, layer_type: str) -> dict[str, tuple[str, np.ndarray]]:
    """GGUF tensor name in a block -> ("rows" or "cols", the indices shard s takes); absent names are replicated."""
    if layer_type == FULL_ATTENTION:
        heads, kv = cfg.num_heads // n, cfg.num_kv_heads // n
        hd = cfg.head_dim
        return {"attn_q.weight": ("rows", _span(s, heads * 2 * hd)), "attn_k.weight": ("rows", _span(s, kv * hd)),
                "attn_v.weight": ("rows", _span(s, kv * hd)), "attn_output.weight": ("cols", _span(s, heads * hd))}
    vh = value_heads(cfg, n, s)
    dv, key_dim = cfg.linear_value_head_dim, cfg.key_dim
    v_cols = (vh[:, None] * dv + np.arange(dv)[None, :]).ravel()
    keys = _span(s, cfg.linear_num_key_heads // n * cfg.linear_key_head_dim)
    channels = np.concatenate([keys, key_dim + keys, 2 * key_dim + v_cols])
    return {"attn_qkv.weight": ("rows", channels), "ssm_conv1d.weight": ("rows", channels),
            "attn_gate.weight": ("rows", v_cols), "ssm_beta.weight": ("rows", vh), "ssm_alpha.weight": ("rows", vh),
            "ssm_a": ("rows", vh), "ssm_dt.bias": ("rows", vh), "ssm_out.weight": ("cols", v_cols)}


def _mlp_slices(cfg: TargetConfig, n: int, s: int) -> dict[str, tuple[str, np.ndarray]]:
    inter = _span(s, cfg.intermediate_size // n)
    return {"ffn_gate.weight": ("rows", inter), "ffn_up.weight": ("rows", inter), "ffn_down.weight": ("cols", inter)}


def shard_tensors(cfg: TargetConfig, tensors: dict[str, Any], n: int, shard: int) -> dict[str, Any]:
    """One shard's tensors by GGUF name (`check_split` first): its slices of the split ones, the others as they are."""
    out = dict(tensors)
    out["output.weight"] = _rows(tensors["output.weight"], _span(shard, cfg.vocab_size // n))
    for i, layer_type in enumerate(cfg.layer_types):
        slices = {**_layer_slices(cfg, n, shard, layer_type), **_mlp_slices(cfg, n, shard)}
        for name, (how, idx) in slices.items():
            full = f"blk.{i}.{name}"
            out[full] = (_rows if how == "rows" else _cols)(tensors[full], idx)
    return out


def _replicated(path: tuple) -> bool:
    """Whether the weight at a pytree path of a Target's weights is whole on every shard."""
    return any(getattr(k, "key", None) in REPLICATED for k in path)


def weight_specs(weights: Any, axis: str) -> Any:
    """The PartitionSpec of each leaf of sharded weights: replicated ones whole, the others stacked on axis 0."""
    return jax.tree_util.tree_map_with_path(lambda p, _: P() if _replicated(p) else P(axis), weights)


def _local_weights(weights: Any) -> Any:
    """A shard's view of its block of the stacked weights (the stacking axis dropped)."""
    return jax.tree_util.tree_map_with_path(lambda p, x: x if _replicated(p) else x[0], weights)


def state_specs(state: TargetState, axis: str) -> TargetState:
    """The PartitionSpecs of a target state: caches and recurrent state by head, the length replicated."""
    heads = lambda c: jax.tree.map(lambda _: P(None, None, axis), c)  # noqa: E731 [layers, slots, heads, ...]
    return TargetState(k=heads(state.k), v=heads(state.v), conv=P(None, None, axis), ssm=P(None, axis), length=P())


@dataclasses.dataclass(frozen=True)
class TargetParallel:
    """What the jitted functions need to run a sharded target (hashable: a static argument): the mesh, the local
    config and the axis."""

    mesh: Mesh
    local: TargetConfig
    axis: str

    def _map(self, fn: Callable, in_specs: tuple, out_specs: Any) -> Callable:
        # check_vma off: the Pallas kernels inside are not annotated; the replicated outputs are replicated by
        # construction (computed from all-reduced activations and replicated weights)
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    def prefill_chunk(self, graph: nnx.GraphDef, weights: dict, state: TargetState, tokens: jax.Array,
                      n_valid: jax.Array, taps: tuple[int, ...], all_logits: bool, kcfg: KernelConfig):
        """`target.prefill_chunk` of the sharded target."""
        def body(w, st, tok, nv):
            return target.prefill_chunk(nnx.merge(graph, _local_weights(w)), self.local, st, tok, nv, taps,
                                        all_logits, kcfg, axis=self.axis)

        sspecs = state_specs(state, self.axis)
        return self._map(body, (weight_specs(weights, self.axis), sspecs, P(), P()), (P(), P(), sspecs))(
            weights, state, tokens, n_valid)

    def step(self, fn: Callable) -> Callable:
        """A decoding step `fn` (engine/step.py's, on one shard's weights and local config) as one program over the
        mesh: the target's weights and state sharded, the drafter's, the tree and the acceptance replicated (each
        device computes them alike), (tweights, dweights, state, stop_ids, sampling) -> (state, StepOut)."""
        def run(tweights, dweights, state, stop_ids, sampling=None):
            sspecs = self.decode_specs(state)
            body = lambda tw, dw, st, stop, *smp: fn(_local_weights(tw), dw, st, stop, *smp)  # noqa: E731
            extra = () if sampling is None else (sampling,)
            in_specs = (weight_specs(tweights, self.axis), P(), sspecs, P()) + (P(),) * len(extra)
            return self._map(body, in_specs, (sspecs, P()))(tweights, dweights, state, stop_ids, *extra)

        return run

    def decode_specs(self, state: Any) -> Any:
        """The PartitionSpecs of a DecodeState: its target state's (`state_specs`), the rest replicated."""
        return dataclasses.replace(state, target=state_specs(state.target, self.axis),
                                   draft=None if state.draft is None else P(), root=P(), remaining=P(), done=P())


@functools.lru_cache(maxsize=None)
def _chunk_function(parallel: TargetParallel, graph: nnx.GraphDef) -> Callable:
    """The jitted prefill chunk of a sharded target, with `prefill.chunk_function`'s signature."""
    def chunk(weights: dict, cfg: TargetConfig, state: TargetState, tokens: jax.Array, n_valid: jax.Array,
              taps: tuple[int, ...], all_logits: bool, kcfg: KernelConfig = REFERENCE):
        return parallel.prefill_chunk(graph, weights, state, tokens, n_valid, taps, all_logits, kcfg)

    return jax.jit(chunk, static_argnums=(1, 5, 6), static_argnames=("kcfg",), donate_argnums=(2,))


def _place(mesh: Mesh, axis: str, shards: list[Any]) -> Any:
    """Per-shard weight pytrees as one of global arrays: replicated leaves whole on each device (shard 0's), the
    others stacked on a new axis 0, each device holding its own block (never gathered on one device)."""
    def put(path, *leaves):
        if _replicated(path):
            return jax.device_put(leaves[0], NamedSharding(mesh, P()))
        blocks = [jax.device_put(x, d)[None] for x, d in zip(leaves, mesh.devices.flat)]
        return jax.make_array_from_single_device_arrays((len(leaves), *leaves[0].shape),
                                                        NamedSharding(mesh, P(axis)), blocks)

    return jax.tree_util.tree_map_with_path(put, *shards)


@dataclasses.dataclass(frozen=True)
class ShardedTarget(SplitTarget):
    """A Target split over a mesh: the graph of one shard's module, the weights of all shards as global arrays
    (`_place`), its jitted prefill chunk and the TargetParallel (`parallel`) its step runs."""

    def init_state(self, cfg: TargetConfig, slots: int, kv_type: str = "f32", v_type: str | None = None
                   ) -> TargetState:
        """An empty target state of the global config laid out over the mesh, each device allocating its part."""
        make = functools.partial(init_state, cfg, slots, kv_type, v_type)
        specs = state_specs(jax.eval_shape(make), self.parallel.axis)
        return jax.jit(make, out_shardings=jax.tree.map(lambda s: NamedSharding(self.parallel.mesh, s), specs))()

    def replicated(self, tree: Any) -> Any:
        """A pytree of arrays copied whole onto every device of the mesh (the drafter's weights and state)."""
        return jax.device_put(tree, NamedSharding(self.parallel.mesh, P()))

    @classmethod
    def over(cls, model: Target, kcfg: KernelConfig, pcfg: ParallelConfig) -> "ShardedTarget":
        """The model sharded over the first pcfg.devices local devices; its matrices must be in the layout they
        load in (QTensor or float arrays), and each shard's are then laid out for `kcfg`."""
        cfg, n = model.config, pcfg.devices
        tensors = target_tensors(model)
        stored = [name for name, x in tensors.items()
                  if not isinstance(x, QTensor) and not isinstance(x, (jax.Array, np.ndarray))]
        if stored:
            raise ConfigError(f"--devices {n}: the target's {stored[0]} is already in a kernel layout; sharding "
                              f"needs the target loaded in the reference layout (load_target with the reference "
                              f"kernels), each shard being laid out after the split")
        check_split(cfg, tensors, n)
        check_present(n)
        lcfg, devices = local_config(cfg, n), jax.local_devices()[:n]
        graph, shards = None, []
        for s in range(n):
            local = target.target_from_tensors(lcfg, prepare_target(shard_tensors(cfg, tensors, n, s), kcfg), kcfg,
                                               head_axis=pcfg.axis)
            graph, weights = split_weights(local)
            shards.append(jax.device_put(weights, devices[s]))  # on its device at once: one shard at a time here
        mesh = Mesh(np.asarray(devices), (pcfg.axis,))
        parallel = TargetParallel(mesh, lcfg, pcfg.axis)
        return cls(graph, _place(mesh, pcfg.axis, shards), _chunk_function(parallel, graph), parallel)
