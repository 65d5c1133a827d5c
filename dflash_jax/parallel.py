"""The target tensor-parallel over a 1-D mesh of local devices: one SPMD program (docs/architecture.md, "Several
devices").

Each shard holds a slice of every layer (`shard_plan`, `take`): attention by KV heads (the query heads of their groups),
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
from typing import Any, Callable, Iterable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dflash_jax.config import FULL_ATTENTION, SINGLE_DEVICE, ConfigError, KernelConfig, ParallelConfig, TargetConfig
from dflash_jax.engine.prefill import SplitTarget, split_weights
from dflash_jax.gguf import tensor_specs
from dflash_jax.kernels import DENSE_LIMIT, REFERENCE, prepare_matrix
from dflash_jax.load import TargetFile, load_target, prepare_target, read_target
from dflash_jax.models import target
from dflash_jax.models.target import Target, TargetState, init_state, target_tensors
from dflash_jax.quant import FORMATS, QTensor, block_format, dequantize

# module names whose weights every shard holds whole
REPLICATED = frozenset({"embed_tokens", "norm", "input_layernorm", "post_attention_layernorm", "q_norm", "k_norm"})


def check_present(n: int) -> None:
    """Raise ConfigError unless n devices are present (this process's; every process's once they have joined:
    dflash_jax/multihost.py)."""
    present = jax.device_count()
    if n > present:
        where = "local " if jax.process_count() == 1 else f"in {jax.process_count()} processes, "
        raise ConfigError(f"--devices {n}: only {present} {where}device(s) present ({jax.default_backend()})")


def device_count_flag(devices: str | int) -> int | None:
    """The count a `--devices` value names; None for "all" and for a value that is no count (which
    `parallel_config` refuses). Reads no device: callable before JAX starts."""
    if devices == "all":
        return None
    try:
        return int(devices)
    except (TypeError, ValueError):
        return None


def parallel_config(devices: str | int, processes: ParallelConfig = SINGLE_DEVICE) -> ParallelConfig:
    """The ParallelConfig of a `--devices` value: a count of local devices that are present, or "all"; for the
    processes of `processes` (joined: `multihost.join`), "all" or the count of every process's devices."""
    if devices == "all":
        return dataclasses.replace(processes, devices=jax.device_count())
    count = device_count_flag(devices)
    if count is None:
        raise ConfigError(f"--devices {devices!r} should be a device count or 'all'")
    if count < 1:
        raise ConfigError(f"--devices {count} must be at least 1 (or 'all')")
    if processes.coordinator is not None and count != jax.device_count():
        raise ConfigError(f"--devices {count}: over {processes.num_processes} process(es) the target is split over "
                          f"every device of every process, {jax.device_count()} here (pass --devices all)")
    check_present(count)
    return dataclasses.replace(processes, devices=count)


def load_split(source: TargetFile, kcfg: KernelConfig, pcfg: ParallelConfig, progress: bool = True
               ) -> Target | "ShardedTarget":
    """An opened target loaded for `pcfg`'s devices: whole on one (`load.load_target`), straight into its shards on
    several (`load_sharded`)."""
    if pcfg.devices == 1:
        return load_target(source, progress=progress, kcfg=kcfg)
    return load_sharded(source, kcfg, pcfg, progress)


def load_sharded(source: TargetFile, kcfg: KernelConfig, pcfg: ParallelConfig, progress: bool = True
                 ) -> "ShardedTarget":
    """An opened target read into its shards: each tensor read on the host, sliced there and each slice put on its
    device (laid out for `kcfg` there), so no device ever holds the whole target; a GGUF's quants are checked to
    split on their blocks before any weight is read."""
    if source.gguf is not None and not dense_layout(source.config, kcfg):
        check_split(source.config, {name: block_format(info.ggml_type).name
                                    for name, info in source.gguf.tensors.items()}, pcfg.devices)
    return ShardedTarget.from_tensors(source.config, read_target(source, progress), kcfg, pcfg)


def dense_layout(cfg: TargetConfig, kcfg: KernelConfig) -> bool:
    """Whether `kcfg` lays every matrix of the target out dense: the reference path's, for a target whose float32
    matrices fit `kernels.DENSE_LIMIT` (`kernels.prepare_matrices`). Its quants are then dequantized before the split
    and need not split on their blocks."""
    specs = tensor_specs(dataclasses.replace(cfg, num_mtp_layers=0, tie_word_embeddings=False))
    dense = sum(4 * int(np.prod(s.shape)) for name, s in specs.items()
                if s.kind == "matrix" and len(s.shape) == 2 and name != "token_embd.weight")
    return kcfg.impl == "reference" and dense <= DENSE_LIMIT


def _dequantized(x: Any) -> Any:
    """A stored matrix as float32 numpy, dequantized on the host's CPU (another tensor as it is)."""
    if not isinstance(x, QTensor):
        return x
    return np.asarray(dequantize(jax.device_put(x, jax.local_devices(backend="cpu")[0])))


def split_target(model: Target | "ShardedTarget", kcfg: KernelConfig, pcfg: ParallelConfig) -> SplitTarget:
    """The model split once for the jitted functions: on one device as it is (`SplitTarget.of`: its matrices
    already in `kcfg`'s layout), on several over a mesh (`ShardedTarget.over`; a ShardedTarget, loaded straight
    into its shards by `load_sharded`, as it is)."""
    if isinstance(model, ShardedTarget):
        if model.parallel.mesh.size != pcfg.devices:
            raise ConfigError(f"--devices {pcfg.devices}: the target was sharded over {model.parallel.mesh.size} "
                              "device(s); pass that ParallelConfig, or load it again for this one")
        if model.kcfg != kcfg:
            raise ConfigError(f"the target was sharded for {model.kcfg.describe()}, not for {kcfg.describe()}")
        return model
    return SplitTarget.of(model) if pcfg.devices == 1 else ShardedTarget.over(model, kcfg, pcfg)


def local_config(cfg: TargetConfig, n: int) -> TargetConfig:
    """The config one of n shards runs: heads and intermediate size divided by n."""
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // n, num_kv_heads=cfg.num_kv_heads // n,
                               intermediate_size=cfg.intermediate_size // n,
                               linear_num_key_heads=cfg.linear_num_key_heads // n,
                               linear_num_value_heads=cfg.linear_num_value_heads // n)


def _format(x: Any) -> str | None:
    """The stored format of a matrix (a QTensor, or a format's name: a GGUF header's), None for a dense array."""
    return x if isinstance(x, str) else x.fmt if isinstance(x, QTensor) else None


def _block(x: Any) -> int:
    """Columns per block of a stored matrix: its quant's block, 1 for a dense one."""
    return 1 if _format(x) is None else FORMATS[_format(x)].block_size


def check_split(cfg: TargetConfig, tensors: dict[str, Any], n: int) -> None:
    """Raise ConfigError unless the target splits n ways: heads, intermediate size and vocabulary divide, and the
    column slices of each quantized o_proj, out_proj and down_proj start and end on its blocks (`tensors`: GGUF
    name -> tensor, or its format's name)."""
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
            raise ConfigError(f"--devices {n}: {name} is {_format(x)}, whose blocks of {_block(x)} columns do not "
                              f"split into slices of {runs[base]} columns")


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


def shard_plan(cfg: TargetConfig, n: int, shard: int) -> dict[str, tuple[str, np.ndarray]]:
    """GGUF name -> ("rows" or "cols", the indices shard `shard` of n takes) of every split tensor; the tensors it
    does not name are replicated."""
    plan = {"output.weight": ("rows", _span(shard, cfg.vocab_size // n))}
    for i, layer_type in enumerate(cfg.layer_types):
        for name, cut in {**_layer_slices(cfg, n, shard, layer_type), **_mlp_slices(cfg, n, shard)}.items():
            plan[f"blk.{i}.{name}"] = cut
    return plan


def take(plan: dict[str, tuple[str, np.ndarray]], name: str, x: Any) -> Any:
    """A shard's part of tensor `name` (`check_split` first): its slice of a split one, a replicated one whole."""
    if name not in plan:
        return x
    how, idx = plan[name]
    return (_rows if how == "rows" else _cols)(x, idx)


def _replicated(path: tuple) -> bool:
    """Whether the weight at a pytree path of a Target's weights is whole on every shard."""
    return any(getattr(k, "key", None) in REPLICATED for k in path)


def weight_specs(weights: Any, axis: str) -> Any:
    """The PartitionSpec of each leaf of sharded weights: replicated ones whole, the others split on axis 0 (each
    shard's block its own leaf, `_place`)."""
    return jax.tree_util.tree_map_with_path(lambda p, _: P() if _replicated(p) else P(axis), weights)


def state_device_bytes(state: TargetState, n: int) -> int:
    """Bytes each of n devices holds of a target state (or its shapes) laid out by `state_specs`: its share of the
    caches and of the conv and recurrent state (split by head), the length whole."""
    def share(x, spec):
        return x.size * x.dtype.itemsize // (n if "heads" in tuple(spec) else 1)

    return sum(jax.tree.leaves(jax.tree.map(share, state, state_specs(state, "heads"))))


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
            return target.prefill_chunk(nnx.merge(graph, w), self.local, st, tok, nv, taps,
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
            extra = () if sampling is None else (sampling,)
            in_specs = (weight_specs(tweights, self.axis), P(), sspecs, P()) + (P(),) * len(extra)
            return self._map(fn, in_specs, (sspecs, P()))(tweights, dweights, state, stop_ids, *extra)

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


@functools.lru_cache(maxsize=None)
def _state_function(parallel: TargetParallel, cfg: TargetConfig, slots: int, kv_type: str, v_type: str | None
                    ) -> Callable:
    """The jitted `init_state` of a sharded target, its state laid out over the mesh: one per state shape (a jit made
    at each call compiled again at each generation)."""
    make = functools.partial(init_state, cfg, slots, kv_type, v_type)
    specs = state_specs(jax.eval_shape(make), parallel.axis)
    return jax.jit(make, out_shardings=jax.tree.map(lambda s: NamedSharding(parallel.mesh, s), specs))


def _place(mesh: Mesh, axis: str, shards: dict[int, Any]) -> Any:
    """The weight pytrees of this process's shards (shard -> pytree, each leaf already on its shard's device) as one
    of global arrays made of those leaves (nothing copied): replicated leaves whole on each device, the others the
    shards' blocks one after the other on axis 0 (the global array of a split matrix is no matrix of the model: only
    its blocks are read). Another process holds the other shards' blocks of the same arrays."""
    devices = list(mesh.devices.flat)

    def put(path, *leaves):
        whole = _replicated(path)
        shape = leaves[0].shape if whole else (mesh.size * leaves[0].shape[0], *leaves[0].shape[1:])
        blocks = [jax.device_put(x, devices[s]) for x, s in zip(leaves, shards)]  # already there: no copy
        return jax.make_array_from_single_device_arrays(shape, NamedSharding(mesh, P() if whole else P(axis)),
                                                        blocks)

    return jax.tree_util.tree_map_with_path(put, *shards.values())


@dataclasses.dataclass(frozen=True)
class ShardedTarget(SplitTarget):
    """A Target split over a mesh: the graph of one shard's module, the weights of all shards as global arrays
    (`_place`), its jitted prefill chunk, the TargetParallel (`parallel`) its step runs, and the global config and
    the KernelConfig its shards are laid out for (what `Engine.from_loaded` reads of a loaded target)."""

    config: TargetConfig | None = None
    kcfg: KernelConfig | None = None

    def init_state(self, cfg: TargetConfig, slots: int, kv_type: str = "f32", v_type: str | None = None
                   ) -> TargetState:
        """An empty target state of the global config laid out over the mesh, each device allocating its part."""
        return _state_function(self.parallel, cfg, slots, kv_type, v_type)()

    def replicated(self, tree: Any) -> Any:
        """A pytree of arrays copied whole onto every device of the mesh (the drafter's weights and state; over
        several processes each copies its own, the same, onto its devices)."""
        return jax.device_put(tree, NamedSharding(self.parallel.mesh, P()))

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """The devices of the mesh, in shard order."""
        return tuple(self.parallel.mesh.devices.flat)

    def state_device_bytes(self, state: TargetState) -> int:
        """Bytes of a target state (or its shapes) that each device of the mesh holds (`state_device_bytes`)."""
        return state_device_bytes(state, self.parallel.mesh.size)

    @classmethod
    def over(cls, model: Target, kcfg: KernelConfig, pcfg: ParallelConfig) -> "ShardedTarget":
        """The model sharded over the first pcfg.devices local devices; its matrices must be in the layout they
        load in (QTensor or float arrays), and each shard's are then laid out for `kcfg`. Each tensor is copied to
        the host, sliced there and its slices put on their devices (`from_tensors`); the model is left as it is."""
        tensors = target_tensors(model)
        stored = [name for name, x in tensors.items()
                  if not isinstance(x, QTensor) and not isinstance(x, (jax.Array, np.ndarray))]
        if stored:
            raise ConfigError(f"--devices {pcfg.devices}: the target's {stored[0]} is already in a kernel layout; "
                              f"sharding needs the target loaded in the reference layout (load_target with the "
                              f"reference kernels), each shard being laid out after the split")
        return cls.from_tensors(model.config, ((name, jax.device_get(x)) for name, x in tensors.items()), kcfg,
                                pcfg)

    @classmethod
    def from_tensors(cls, cfg: TargetConfig, tensors: Iterable[tuple[str, Any]], kcfg: KernelConfig,
                     pcfg: ParallelConfig) -> "ShardedTarget":
        """A target sharded over the first pcfg.devices devices (of every process, where several run it) from its
        tensors by GGUF name, in host memory as stored and taken one at a time (`load.read_target`): each is sliced
        on the host and each slice of this process's devices put on its device and laid out for `kcfg` there, so a
        device holds its shard and one tensor's slice in the stored layout, never the whole target. A tied head (no
        output.weight) takes each shard's rows of the embedding."""
        n, dense = pcfg.devices, dense_layout(cfg, kcfg)
        check_split(cfg, {}, n)
        check_present(n)
        lcfg, devices = local_config(cfg, n), jax.devices()[:n]
        mine = {s: d for s, d in enumerate(devices) if d.process_index == jax.process_index()}
        plans = {s: shard_plan(cfg, n, s) for s in mine}
        parts: dict[int, dict[str, Any]] = {s: {} for s in mine}
        for name, x in tensors:
            x = _dequantized(x) if dense and name != "token_embd.weight" else x
            check_split(cfg, {name: x}, n)
            for s, device in mine.items():
                piece = jax.device_put(take(plans[s], name, x), device)
                parts[s][name] = piece if name == "token_embd.weight" else prepare_matrix(piece, kcfg)
        graph, shards = None, {}
        for s, part in parts.items():
            if "output.weight" not in part:
                part["output.weight"] = prepare_matrix(take(plans[s], "output.weight", part["token_embd.weight"]),
                                                       kcfg)
            local = target.target_from_tensors(lcfg, prepare_target(part, kcfg), kcfg, head_axis=pcfg.axis)
            graph, shards[s] = split_weights(local)
            part.clear()  # the shard's module holds its arrays now
        mesh = Mesh(np.asarray(devices), (pcfg.axis,))
        parallel = TargetParallel(mesh, lcfg, pcfg.axis)
        return cls(graph, _place(mesh, pcfg.axis, shards), _chunk_function(parallel, graph), parallel, cfg, kcfg)
