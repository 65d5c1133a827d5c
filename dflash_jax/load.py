"""Load a target model (a `qwen35` GGUF file or an HF safetensors directory) or a DFlash drafter onto the device.

Both routes end in the same layout (GGUF names and conventions, value heads tiled, see `dflash_jax.weights`) and the
same Flax NNX module (`models.target.Target`, `models.draft.Draft`): matrices are QTensors in their stored format
(GGUF quants, or dense BF16/F16/F32 from safetensors) or the kernels' layout, norms and the small GDN tensors
float32. Tensors are read, converted and put on the device one at a time, so host memory holds one
tensor beyond the memory-mapped file; a progress bar counts the bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from tqdm.auto import tqdm

from dflash_jax.config import (ConfigError, DraftConfig, KernelConfig, TargetConfig, draft_config_from_hf, read_json,
                               target_config_from_hf)
from dflash_jax.errors import InputError, brief
from dflash_jax.gguf import GGUFModel, tensor_specs
from dflash_jax.kernels import REFERENCE, prepare_matrices, prepare_matrix
from dflash_jax.models.draft import Draft, check_pair, draft_from_tensors
from dflash_jax.models.draft import tensor_shapes as draft_tensor_shapes
from dflash_jax.models.target import Target, target_from_tensors
from dflash_jax.quant import QTensor, nonfinite_field
from dflash_jax.weights import WeightsError, iter_hf_to_gguf

HF_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
HF_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
# safetensors dtype names are also our dense QTensor formats
_DENSE_DTYPES = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "F16": np.float16}
_SKIPPED_HF = ("mtp.", "model.visual.", "visual.")  # the MTP head and the vision tower are not run


class LoadError(InputError):
    """A model path that cannot be loaded: missing, of another architecture, or without usable weights."""


@dataclasses.dataclass(frozen=True)
class TargetFile:
    """A target opened and checked without loading a weight: its path, config, and the open GGUF (None for an HF
    directory, whose config is all that is read)."""

    path: str
    config: TargetConfig
    gguf: GGUFModel | None


def check_path(path: str) -> None:
    """A model path must exist and be a regular file or a directory: a named pipe or a device would block the read
    or stream without end."""
    if not os.path.exists(path):
        raise LoadError(f"{path}: no such file or directory")
    if not (os.path.isfile(path) or os.path.isdir(path)):
        raise LoadError(f"{path}: not a regular file or a directory")


def open_target(path: str | os.PathLike) -> TargetFile:
    """A GGUF file's header and tensor table, or an HF directory's config.json, read and checked."""
    path = os.fspath(path)
    check_path(path)
    if os.path.isdir(path):
        return TargetFile(path, hf_target_config(path), None)
    model = GGUFModel(path)
    return TargetFile(path, model.config, model)


def target_tokenizer(target: TargetFile):
    """The tokenizer of an opened target: its GGUF's metadata (the header is not parsed again), or its HF
    directory's tokenizer files."""
    from dflash_jax.tokenizer import Tokenizer

    if target.gguf is None:
        return Tokenizer.from_hf_dir(target.path)
    return Tokenizer.from_metadata(target.gguf.metadata_value, target.path)


def load_target(path: str | os.PathLike | TargetFile, *, progress: bool = True,
                kcfg: KernelConfig = REFERENCE) -> Target:
    """A target from a GGUF file or an HF `Qwen3_5ForCausalLM` / `Qwen3_5ForConditionalGeneration` directory (or
    one `open_target` opened), its quantized matrices repacked for `kcfg`'s kernels as they load
    (`dflash_jax.defaults.resolve_kernels` gives the device's configuration; the default is the reference path)."""
    source = path if isinstance(path, TargetFile) else open_target(path)
    tensors = {}
    for name, x in read_target(source, progress):
        x = _on_device(x)
        # repacked one at a time, so the stored layout of only one tensor is on the device at once
        tensors[name] = x if name == "token_embd.weight" else prepare_matrix(x, kcfg)
    return target_from_tensors(source.config, prepare_target(tensors, kcfg), kcfg)


def read_target(source: TargetFile, progress: bool = True) -> Iterator[tuple[str, QTensor | np.ndarray]]:
    """An opened target's tensors by GGUF name, read one at a time into host memory (numpy arrays and QTensors of
    them) and checked, for the caller to place (`load_target`; `parallel.load_sharded` slices each first)."""
    if source.gguf is not None:
        return _read_gguf(source.gguf, progress)
    return _read_hf_dir(source.path, source.config, progress)


def prepare_target(tensors: dict[str, Any], kcfg: KernelConfig) -> dict[str, Any]:
    """A target's tensors by GGUF name in the layout `kcfg` computes with (`kernels.prepare_matrices`): the embedding
    is read by row and stays a QTensor; a tied head (no output.weight) gets its own copy in the kernels' layout."""
    return prepare_matrices({"output.weight": tensors["token_embd.weight"], **tensors}, kcfg,
                            skip=("token_embd.weight",))


def _bar(total: int, path: str, progress: bool):
    return tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {os.path.basename(path)}",
                disable=None if progress else True, leave=False)


def _on_device(x: QTensor | np.ndarray):
    return jax.tree.map(jnp.asarray, x)


def _finite(path: str, name: str, x: QTensor | np.ndarray) -> QTensor | np.ndarray:
    """x, after checking that its values hold no NaN or infinity (a corrupt file)."""
    if nonfinite_field(x.data if isinstance(x, QTensor) else {"values": x}) is not None:
        raise LoadError(f"{path}: tensor {name!r} holds NaN or infinite values (the file is corrupt)")
    return x


def _read_gguf(model: GGUFModel, progress: bool) -> Iterator[tuple[str, QTensor | np.ndarray]]:
    path, cfg = model.path, model.config
    # MTP blocks (blk.N and up) are not used by the engine: skip their bytes.
    names = [n for n in model.tensors if not (n.startswith("blk.") and int(n.split(".")[1]) >= cfg.num_layers)]
    with _bar(sum(model.tensors[n].nbytes for n in names), path, progress) as bar:
        for name in names:
            yield name, model.load(name)
            bar.update(model.tensors[name].nbytes)


def _architectures(d: dict, where: str) -> list[str]:
    archs = d.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise LoadError(f"{where}: architectures should be a list of strings, found {brief(archs)}")
    return archs


def hf_target_config(path: str) -> TargetConfig:
    """The TargetConfig of an HF directory, after checking that it holds a Qwen3.5/3.6 model."""
    where = os.path.join(path, "config.json")
    if not os.path.exists(where):
        raise LoadError(f"{path}: not a model directory (no config.json)")
    d = read_json(where)
    archs = _architectures(d, where)
    if not any(a in HF_ARCHITECTURES for a in archs) and not (not archs and d.get("model_type") in HF_MODEL_TYPES):
        found = ", ".join(archs) if archs else f"model_type {d.get('model_type')!r}"
        raise LoadError(f"{where}: {found} is not a Qwen3.5/3.6 model (expected {' or '.join(HF_ARCHITECTURES)})")
    try:
        return target_config_from_hf(d, where=where)
    except ConfigError as e:
        raise LoadError(str(e)) from None


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = read_json(index).get("weight_map") or {}
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise LoadError(f"{index}: weight_map should map tensor names to file names, found {brief(weight_map)}")
        files = sorted({os.path.join(path, f) for f in weight_map.values()})
        missing = [f for f in files if not os.path.exists(f)]
        if missing:
            raise LoadError(f"{index}: lists {os.path.basename(missing[0])}, which is not in the directory")
    else:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise LoadError(f"{path}: no *.safetensors weights (PyTorch .bin checkpoints are not supported)")
    return files


@contextlib.contextmanager
def _open_safetensors(files: list[str]) -> Iterator[dict]:
    """name -> open safetensors handle holding it, over every file."""
    with contextlib.ExitStack() as stack:
        where = {}
        for f in files:
            try:
                handle = stack.enter_context(safe_open(f, framework="numpy"))
            except Exception as e:  # safetensors raises its own error types for bad headers
                raise LoadError(f"{f}: not a readable safetensors file ({e})") from None
            for name in handle.keys():
                where[name] = handle
        yield where


def _read_hf_dir(path: str, cfg: TargetConfig, progress: bool) -> Iterator[tuple[str, QTensor | np.ndarray]]:
    specs = tensor_specs(cfg)
    with _open_safetensors(_safetensors_files(path)) as where:
        info = {name: h.get_slice(name) for name, h in where.items()}
        dtypes = {name: s.get_dtype() for name, s in info.items()}
        # The engine does not run the MTP head: convert without it (its tensors, like the vision tower's, are skipped).
        convert_cfg = dataclasses.replace(cfg, num_mtp_layers=0)
        used = [n for n in where if not n.startswith(_SKIPPED_HF)]
        bad = [n for n in used if dtypes[n] not in _DENSE_DTYPES]
        if bad:
            raise LoadError(f"{path}: tensor {bad[0]!r} is {dtypes[bad[0]]}; only F32, BF16 and F16 are supported")
        nbytes = {n: int(np.prod(info[n].get_shape())) * np.dtype(_DENSE_DTYPES[dtypes[n]]).itemsize for n in used}
        with _bar(sum(nbytes.values()), path, progress) as bar:
            try:
                for name, hf_name, x in iter_hf_to_gguf(used, lambda n: where[n].get_tensor(n), convert_cfg):
                    if specs[name].kind == "matrix" and x.ndim == 2:  # kept in its stored precision
                        fmt = dtypes[hf_name]
                        x = QTensor(data={"w": x.astype(_DENSE_DTYPES[fmt])}, fmt=fmt, shape=x.shape)
                    yield name, _finite(path, hf_name, x)
                    bar.update(nbytes[hf_name])
            except WeightsError as e:
                raise LoadError(f"{path}: {e}") from None


def draft_config(path: str | os.PathLike, target: TargetConfig) -> DraftConfig:
    """The config.json of a DFlash drafter (its directory, or the .safetensors file beside it), checked against the
    target it will draft for; no weight is read."""
    path = os.fspath(path)
    check_path(path)
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    config_path = os.path.join(folder, "config.json")
    if not os.path.exists(config_path):
        raise LoadError(f"{folder}: no config.json beside the drafter weights")
    d = read_json(config_path)
    archs = _architectures(d, config_path)
    if archs and "DFlashDraftModel" not in archs:
        raise LoadError(f"{config_path}: {', '.join(archs)} is not a DFlash drafter (expected DFlashDraftModel)")
    try:
        cfg = draft_config_from_hf(d, where=config_path)
        check_pair(cfg, target, where=f"drafter {path}")
    except ConfigError as e:
        raise LoadError(str(e)) from None
    return cfg


def load_draft(path: str | os.PathLike, target: TargetConfig, *, progress: bool = True,
               kcfg: KernelConfig = REFERENCE) -> Draft:
    """A z-lab DFlash drafter (a directory with config.json and model.safetensors, or the .safetensors file
    beside its config.json), checked against the target it will draft for; `kcfg` as for load_target (the
    target's: the drafter runs with the target's kernels)."""
    path = os.fspath(path)
    cfg = draft_config(path, target)
    shapes = draft_tensor_shapes(cfg)
    files = [path] if not os.path.isdir(path) else _safetensors_files(path)
    with _open_safetensors(files) as where:
        names = {n[len("model."):] if n.startswith("model.") else n: n for n in where}  # some exports prefix
        missing = sorted(set(shapes) - set(names))
        unexpected = sorted(set(names) - set(shapes))
        if missing or unexpected:
            raise LoadError(f"{path}: tensors do not match the drafter config: missing {missing[:3]}, "
                            f"unexpected {unexpected[:3]}")
        slices = {name: where[names[name]].get_slice(names[name]) for name in shapes}
        for name, sl in slices.items():  # every check before anything is loaded
            if tuple(sl.get_shape()) != shapes[name]:
                raise LoadError(f"{path}: tensor {name!r} has shape {sl.get_shape()}, expected {list(shapes[name])}")
            if sl.get_dtype() not in _DENSE_DTYPES:
                raise LoadError(f"{path}: tensor {name!r} is {sl.get_dtype()}; only F32, BF16 and F16 are supported")
        nbytes = {n: int(np.prod(shapes[n])) * np.dtype(_DENSE_DTYPES[sl.get_dtype()]).itemsize
                  for n, sl in slices.items()}
        tensors = {}
        with _bar(sum(nbytes.values()), path, progress) as bar:
            for name, shape in shapes.items():
                x = where[names[name]].get_tensor(names[name])
                if len(shape) == 2:  # matrices stay in their stored precision
                    x = QTensor(data={"w": x}, fmt=slices[name].get_dtype(), shape=shape)
                else:
                    x = x.astype(np.float32)
                tensors[name] = _on_device(_finite(path, name, x))
                bar.update(nbytes[name])
    return draft_from_tensors(cfg, prepare_matrices(tensors, kcfg), kcfg)
