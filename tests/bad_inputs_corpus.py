"""The corpus of tests/test_bad_inputs.py: bad GGUF files, HF and drafter configs and flags, generated from the fixtures
(issue 39), and how a command is run on one: exit code, stderr, seconds and peak resident memory."""

import collections
import dataclasses
import json
import math
import os
import re
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
from gguf import GGUFValueType as VT

from conftest import ROOT, TINY, TINY_GGUF
from dflash_jax.config import target_config_to_hf
from dflash_jax.gguf import GGUFModel
from dflash_jax.testing.gguf_writer import rewrite_gguf

TIME_LIMIT_S = 20
MEMORY_LIMIT = 2 << 30  # peak resident bytes of one run
ADDRESS_LIMIT_KB = 8 << 20  # a backstop: a runaway allocation fails in the child instead of starving the machine
PROMPT = ("--prompt_ids", "1,2,3")
BASE = TINY_GGUF.read_bytes()
TARGET = GGUFModel(TINY_GGUF).config


# ---------------------------------------------------------------------------------------------------------------
# Running a command: exit code, stderr, seconds and peak memory

@dataclasses.dataclass(frozen=True)
class Run:
    """One command line: `python -m dflash_jax.<module> args`, with stdin; its errors start with `prefix: `."""

    module: str
    args: tuple
    stdin: bytes | None = None

    @property
    def prefix(self) -> str:
        return self.module.rsplit(".", 1)[-1]


@dataclasses.dataclass(frozen=True)
class Outcome:
    code: int
    stderr: str
    seconds: float
    max_rss: int  # bytes


def inspect(path: Path) -> Run:
    return Run("inspect", (str(path),))


def generate(*args, stdin: bytes | None = None) -> Run:
    return Run("generate", ("--jit_cache=", *args), stdin)


def run_clis(runs: list[Run], jobs: int) -> list[Outcome]:
    """Run the command lines, `jobs` at a time, each in a child forked from one process that imported the commands
    once (tests/cli_forks.py: the module run as `__main__`, its address space capped at ADDRESS_LIMIT_KB, killed past
    TIME_LIMIT_S); each one's exit code, stderr, seconds from fork to exit and peak resident memory (wait4)."""
    with tempfile.TemporaryDirectory(prefix="bad_inputs_") as tmp:
        requests = []
        for i, run in enumerate(runs):
            stdin = Path(tmp) / f"{i}.in"
            stdin.write_bytes(run.stdin or b"")
            requests.append({"module": run.module, "args": [str(a) for a in run.args], "stdin_file": str(stdin)})
        path = Path(tmp) / "requests.json"
        path.write_text(json.dumps({"jobs": jobs, "time_limit_s": TIME_LIMIT_S, "address_limit_kb": ADDRESS_LIMIT_KB,
                                    "runs": requests}))
        proc = subprocess.run([sys.executable, str(Path(__file__).with_name("cli_forks.py")), str(path)], cwd=ROOT,
                              env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
                              timeout=TIME_LIMIT_S * len(runs))
        if proc.returncode:
            raise RuntimeError(f"cli_forks.py failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    out = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(out) == len(runs), proc.stdout[-2000:]
    return [Outcome(r["code"], r["stderr"], r["seconds"], r["max_rss"]) for r in out]


def check_one_line(run: Run, outcome: Outcome, named: Path | None, fields: tuple[str, ...]) -> None:
    """Exit code 2, one line naming the file and one of the fields, no traceback, in time and memory."""
    what = f"{run.prefix} {' '.join(map(str, run.args))[:200]}"
    assert "Traceback" not in outcome.stderr, f"{what}:\n{outcome.stderr[-4000:]}"
    assert outcome.code == 2, f"{what}: exit code {outcome.code}\n{outcome.stderr[-4000:]}"
    lines = outcome.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{run.prefix}: "), f"{what}:\n{outcome.stderr[-4000:]}"
    if named is not None:
        assert str(named) in lines[0], f"{what}: the file is not named: {lines[0]}"
    assert any(f in lines[0] for f in fields), f"{what}: none of {fields} named: {lines[0]}"
    assert outcome.seconds < TIME_LIMIT_S, f"{what}: {outcome.seconds:.1f} s"
    assert outcome.max_rss < MEMORY_LIMIT, f"{what}: {outcome.max_rss / 2**20:.0f} MiB resident"


# ---------------------------------------------------------------------------------------------------------------
# The fixture's GGUF layout, walked independently of the reader, for byte-level edits

@dataclasses.dataclass(frozen=True)
class KV:
    key: str
    start: int  # the key's length
    type_pos: int
    value_pos: int
    end: int


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    start: int  # the name's length
    dims_pos: int  # n_dims, then the dims
    dims: tuple[int, ...]
    type_pos: int
    ggml_type: int
    offset_pos: int
    offset: int
    end: int

    @property
    def nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(self.ggml_type)]
        return math.prod(self.dims) // block * size


_SCALARS = {VT.UINT8: 1, VT.INT8: 1, VT.BOOL: 1, VT.UINT16: 2, VT.INT16: 2, VT.UINT32: 4, VT.INT32: 4,
            VT.FLOAT32: 4, VT.UINT64: 8, VT.INT64: 8, VT.FLOAT64: 8}


def _skip_value(data: bytes, pos: int, vtype: int) -> int:
    if vtype == VT.STRING:
        return pos + 8 + struct.unpack_from("<Q", data, pos)[0]
    if vtype == VT.ARRAY:
        sub, count = struct.unpack_from("<IQ", data, pos)
        pos += 12
        for _ in range(count):
            pos = _skip_value(data, pos, sub)
        return pos
    return pos + _SCALARS[VT(vtype)]


def layout(data: bytes) -> tuple[list[KV], list[TensorInfo], int]:
    """(metadata entries, tensor infos, start of the data) of a little-endian GGUF."""
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos, kvs, infos = 24, [], []
    for _ in range(n_kv):
        start, n = pos, struct.unpack_from("<Q", data, pos)[0]
        key, pos = data[pos + 8:pos + 8 + n].decode(), pos + 8 + n
        vtype = struct.unpack_from("<I", data, pos)[0]
        end = _skip_value(data, pos + 4, vtype)
        kvs.append(KV(key, start, pos, pos + 4, end))
        pos = end
    for _ in range(n_tensors):
        start, n = pos, struct.unpack_from("<Q", data, pos)[0]
        name, pos = data[pos + 8:pos + 8 + n].decode(), pos + 8 + n
        n_dims = struct.unpack_from("<I", data, pos)[0]
        dims = struct.unpack_from(f"<{n_dims}Q", data, pos + 4)
        type_pos = pos + 4 + 8 * n_dims
        ggml_type, offset = struct.unpack_from("<IQ", data, type_pos)
        infos.append(TensorInfo(name, start, pos, dims, type_pos, ggml_type, type_pos + 4, offset, type_pos + 12))
        pos = type_pos + 12
    return kvs, infos, -(-pos // 32) * 32


KVS, TENSORS, DATA_START = layout(BASE)
KEY = {kv.key: kv for kv in KVS}
TENSOR = {t.name: t for t in TENSORS}


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def patched(*edits: tuple[int, bytes], cut: int | None = None) -> bytes:
    """The fixture's bytes with edits (position, new bytes) applied, then cut to `cut` bytes."""
    data = bytearray(BASE)
    for pos, new in edits:
        data[pos:pos + len(new)] = new
    return bytes(data[:cut])


def _same_length_pair(names: list[str]) -> tuple[str, str]:
    by_length = collections.defaultdict(list)
    for name in names:
        by_length[len(name)].append(name)
    return next(tuple(group[:2]) for group in by_length.values() if len(group) > 1)


def expected_at_cut(cut: int) -> tuple[str, ...]:
    """What a file cut to `cut` bytes may be refused for: the header field, metadata entry or tensor at the cut (or
    the counts, which are checked against the bytes left first)."""
    for end, field in ((4, "GGUF"), (8, "version"), (16, "tensor_count"), (24, "kv_count")):
        if cut < end:
            return (field,)
    counts = ("tensor_count", "kv_count")
    for i, kv in enumerate(KVS):
        if cut < kv.end:
            return (*counts, kv.key, f"metadata key #{i}")
    for i, t in enumerate(TENSORS):
        if cut < t.end:
            return (*counts, t.name, f"tensor #{i}")
    return (next(t.name for t in TENSORS if DATA_START + t.offset + t.nbytes > cut),)


# ---------------------------------------------------------------------------------------------------------------
# The corpus

@dataclasses.dataclass(frozen=True)
class Case:
    """A bad input: `build(folder)` writes it and returns the file its error must name (None for a flag) and the
    runs; the error line must contain one of `fields`."""

    name: str
    build: Callable[[Path], tuple[Path | None, list[Run]]]
    fields: tuple[str, ...]


def _gguf_case(name: str, data: Callable[[], bytes], fields: tuple[str, ...], runs: str = "both") -> Case:
    """A GGUF of these bytes through inspect and generate (`runs="generate"`: tensor data, which inspect never
    reads)."""
    def build(folder: Path):
        path = folder / "model.gguf"
        path.write_bytes(data())
        chosen = [generate("--target", str(path), "--mode", "ar", *PROMPT)]
        return path, chosen if runs == "generate" else [inspect(path), *chosen]
    return Case(f"gguf-{name}", build, fields)


def rewritten(**edits) -> Callable[[Path], Path]:
    def write(folder: Path) -> Path:
        path = folder / "model.gguf"
        rewrite_gguf(TINY_GGUF, path, **edits)
        return path
    return write


def _metadata_case(name: str, fields: tuple[str, ...], runs: str = "both", **edits) -> Case:
    def build(folder: Path):
        path = rewritten(**edits)(folder)
        chosen = [generate("--target", str(path), "--mode", "ar", *PROMPT)]
        return path, chosen if runs == "generate" else [inspect(path), *chosen]
    return Case(f"gguf-{name}", build, fields)


def _cut_cases() -> list[Case]:
    kv_tokens, middle = KEY["tokenizer.ggml.tokens"], TENSORS[len(TENSORS) // 2]
    cuts = {"in the magic": 2, "in the version": 6, "in tensor_count": 12, "after the header": 24,
            "in the tokens array": (kv_tokens.value_pos + kv_tokens.end) // 2, "in the tensor table": middle.start,
            "in a tensor's dims": middle.dims_pos + 6, "in the data": DATA_START + middle.offset + 7,
            "one byte short": len(BASE) - 1}  # every boundary in process: test_every_cut_..._is_refused
    return [_gguf_case(f"cut {name}", lambda cut=cut: BASE[:cut], expected_at_cut(cut)) for name, cut in cuts.items()]


def _layout_cases() -> list[Case]:
    first_key, second_key = _same_length_pair([kv.key for kv in KVS])
    first_t, second_t = _same_length_pair([t.name for t in TENSORS])
    mid = TENSORS[len(TENSORS) // 2]
    matrix = next(t for t in TENSORS[1:-1] if len(t.dims) == 2 and t.ggml_type == gguf.GGMLQuantizationType.Q4_K)
    arch, tokens, sections = KEY["general.architecture"], KEY["tokenizer.ggml.tokens"], \
        KEY["qwen35.rope.dimension_sections"]
    n_kv, n_tensors = len(KVS), len(TENSORS)
    edits = {
        "version byte-swapped": ([(4, u32(0x03000000))], ("version",)),
        "version 99": ([(4, u32(99))], ("version",)),
        "tensor_count 2^60": ([(8, u64(2**60))], ("tensor_count",)),
        "kv_count 2^60": ([(16, u64(2**60))], ("kv_count",)),
        "tensor_count 0": ([(8, u64(0))], ("block_count", "tensor")),
        "kv_count 0": ([(16, u64(0))], ("tensor",)),
        "kv_count one more": ([(16, u64(n_kv + 1))], ("metadata key", "tensor")),
        "tensor_count one more": ([(8, u64(n_tensors + 1))], ("tensor",)),
        "key length 2^60": ([(KVS[0].start, u64(2**60))], ("metadata key #0",)),
        "key not UTF-8": ([(KVS[5].start + 8, b"\xff")], ("metadata key #5",)),
        "duplicate key": ([(KEY[second_key].start + 8, first_key.encode())], (first_key,)),
        "unknown value type": ([(KEY["qwen35.ssm.conv_kernel"].type_pos, u32(99))], ("qwen35.ssm.conv_kernel",)),
        "string length 2^60": ([(KEY["general.name"].value_pos, u64(2**60))], ("general.name",)),
        "string array of 2^60": ([(tokens.value_pos + 4, u64(2**60))], ("tokenizer.ggml.tokens",)),
        "int array of 2^60": ([(sections.value_pos + 4, u64(2**60))], ("qwen35.rope.dimension_sections",)),
        "array of arrays": ([(KEY["tokenizer.ggml.token_type"].value_pos, u32(VT.ARRAY))],
                            ("tokenizer.ggml.token_type",)),
        "array of type 99": ([(sections.value_pos, u32(99))], ("qwen35.rope.dimension_sections",)),
        "architecture not UTF-8": ([(arch.value_pos + 8, b"\xff")], ("general.architecture",)),
        "tensor name length 2^60": ([(TENSORS[0].start, u64(2**60))], ("tensor #0",)),
        "tensor name not UTF-8": ([(TENSORS[3].start + 8, b"\xfe")], ("tensor #3",)),
        "duplicate tensor": ([(TENSOR[second_t].start + 8, first_t.encode())], (first_t,)),
        "n_dims 0": ([(mid.dims_pos, u32(0))], (mid.name,)),
        "n_dims 2^31": ([(mid.dims_pos, u32(2**31))], (mid.name,)),
        "dimension 0": ([(mid.dims_pos + 4, u64(0))], (mid.name,)),
        "dimension 2^40": ([(matrix.dims_pos + 12, u64(2**40))], (matrix.name,)),
        "dimension 2^63": ([(matrix.dims_pos + 12, u64(2**63))], (matrix.name,)),
        "rows not whole blocks": ([(matrix.dims_pos + 4, u64(255))], (matrix.name,)),
        "type id 99": ([(mid.type_pos, u32(99))], (mid.name,)),
        "unsupported type Q2_K": ([(matrix.type_pos, u32(gguf.GGMLQuantizationType.Q2_K))], (matrix.name,)),
        "F32 over Q4_K bytes": ([(matrix.type_pos, u32(gguf.GGMLQuantizationType.F32))], (matrix.name,)),
        "offset 2^40": ([(mid.offset_pos, u64(2**40))], (mid.name,)),
        "offset unaligned": ([(mid.offset_pos, u64(mid.offset + 1))], (mid.name,)),
        "offset of another tensor": ([(mid.offset_pos, u64(TENSORS[0].offset))], (mid.name, TENSORS[0].name)),
    }
    return [_gguf_case(name, lambda e=e: patched(*e), fields) for name, (e, fields) in edits.items()]


def _tensor_data(name: str, fill: Callable[[bytearray], None]) -> Callable[[], bytes]:
    def data() -> bytes:
        t = TENSOR[name]
        start = DATA_START + t.offset
        part = bytearray(BASE[start:start + t.nbytes])
        fill(part)
        return patched((start, bytes(part)))
    return data


def _first_q6_k() -> str:
    return next(t.name for t in TENSORS if t.ggml_type == gguf.GGMLQuantizationType.Q6_K)


def _inf_scale(part: bytearray) -> None:
    part[208:210] = struct.pack("<e", math.inf)  # the first Q6_K block's d (its last two of 210 bytes)


def _all_ff(part: bytearray) -> None:
    part[:] = b"\xff" * len(part)


def _data_cases() -> list[Case]:
    return [
        _gguf_case("Q4_K tensor of 0xFF bytes", _tensor_data("token_embd.weight", _all_ff), ("token_embd.weight",),
                   runs="generate"),
        _gguf_case("NaN norm", _tensor_data("output_norm.weight", _all_ff), ("output_norm.weight",), runs="generate"),
        _gguf_case("Q6_K block with an inf scale", _tensor_data(_first_q6_k(), _inf_scale), (_first_q6_k(),),
                   runs="generate"),
    ]


CONFIG_KEYS = [kv.key for kv in KVS if kv.key.startswith("qwen35.")] + ["qwen35.nextn_predict_layers"]
FLOAT_KEYS = ("qwen35.attention.layer_norm_rms_epsilon", "qwen35.rope.freq_base")
ARRAY_KEYS = ("qwen35.rope.dimension_sections",)


def metadata_variants(key: str) -> dict[str, tuple]:
    """The key made huge, zero, negative, NaN and of the wrong type, as (value, type, array element type); the
    variants that are valid values of that key are left out."""
    if key in FLOAT_KEYS:
        return {"huge": (math.inf, VT.FLOAT32, None), "zero": (0.0, VT.FLOAT32, None),
                "negative": (-1.0, VT.FLOAT32, None), "nan": (math.nan, VT.FLOAT32, None),
                "text": ("x", VT.STRING, None)}
    if key in ARRAY_KEYS:  # sections of zero are valid (text ignores them)
        return {"huge": ([2**40] * 4, VT.ARRAY, VT.UINT64), "negative": ([-1] * 4, VT.ARRAY, VT.INT32),
                "nan": ([math.nan] * 4, VT.ARRAY, VT.FLOAT32), "text": ("x", VT.STRING, None)}
    variants = {"huge": (2**40, VT.UINT64, None), "zero": (0, VT.UINT32, None), "negative": (-1, VT.INT32, None),
                "nan": (math.nan, VT.FLOAT32, None), "text": ("x", VT.STRING, None)}
    if key == "qwen35.nextn_predict_layers":  # no MTP block is the default
        variants.pop("zero")
    return variants


def _metadata_cases() -> list[Case]:
    """One variant of every other config key (all variants of all keys are checked in process), the issue's
    block_count of 2^31, the architecture and the alignment."""
    cases = [_metadata_case("block_count 2^31", ("qwen35.block_count",),
                            set_keys=[("qwen35.block_count", 2**31, VT.UINT32, None)]),
             _metadata_case("architecture a number", ("general.architecture",),
                            set_keys=[("general.architecture", 5, VT.UINT32, None)]),
             _metadata_case("alignment 3", ("general.alignment",),
                            set_keys=[("general.alignment", 3, VT.UINT32, None)]),
             _metadata_case("alignment text", ("general.alignment",),
                            set_keys=[("general.alignment", "x", VT.STRING, None)]),
             _metadata_case("alignment 2^31", ("alignment", TENSORS[0].name),
                            set_keys=[("general.alignment", 2**31, VT.UINT32, None)])]
    for i, key in enumerate(CONFIG_KEYS[::2]):
        variants = metadata_variants(key)
        kind = list(variants)[i % len(variants)]
        cases.append(_metadata_case(f"{key} {kind}", (key.removeprefix("qwen35."),),
                                    set_keys=[(key, *variants[kind])]))
    return cases


def _tokenizer_cases() -> list[Case]:
    """Tokenizer metadata, read by generate (inspect does not build the tokenizer)."""
    edits = {
        "tokens of ints": ("tokenizer.ggml.tokens", [1, 2, 3], VT.ARRAY, VT.INT32),
        "token types short": ("tokenizer.ggml.token_type", [1] * 10, VT.ARRAY, VT.INT32),
        "merges text": ("tokenizer.ggml.merges", "x", VT.STRING, None),
        "merges not in the vocabulary": ("tokenizer.ggml.merges", ["zzz qqq"], VT.ARRAY, VT.STRING),
        "model a number": ("tokenizer.ggml.model", 5, VT.UINT32, None),
        "eos 2^40": ("tokenizer.ggml.eos_token_id", 2**40, VT.UINT64, None),
        "bos negative": ("tokenizer.ggml.bos_token_id", -1, VT.INT32, None),
        "chat template a number": ("tokenizer.chat_template", 7, VT.UINT32, None),
    }
    return [_metadata_case(f"tokenizer {name}", (edit[0],), runs="generate", set_keys=[edit])
            for name, edit in edits.items()]


DELETE = object()


def changed(d: dict, changes: dict) -> dict:
    """d with each key of `changes` set to its value, or removed where the value is DELETE."""
    for key, value in changes.items():
        if value is DELETE:
            d.pop(key)
        else:
            d[key] = value
    return d


def hf_config(**changes) -> dict:
    return changed(target_config_to_hf(TARGET), changes)


def _config_case(prefix: str, name: str, content: bytes, fields: tuple[str, ...], drafter: bool) -> Case:
    def build(folder: Path):
        path = folder / "config.json"
        path.write_bytes(content)
        args = ("--target", str(TINY_GGUF), "--draft", str(folder)) if drafter else \
            ("--target", str(folder), "--mode", "ar")
        return path, [generate(*args, *PROMPT)]
    return Case(f"{prefix}-{name}", build, fields)


RAW_CONFIGS = {
    "not UTF-8": (b'{"hidden_size": "\xff"}', ("UTF-8",)),
    "not JSON": (b'{"hidden_size": ', ("JSON",)),
    "a JSON array": (b"[1, 2]", ("JSON object",)),
    "nested 100000 deep": (b"[" * 100_000 + b"]" * 100_000, ("nested",)),
}


ROPE = target_config_to_hf(TARGET)["rope_parameters"]
HF_CHANGES = {  # name: (changes to the fixture's config, the field the error names)
    "num_hidden_layers 1e10": (dict(num_hidden_layers=1e10), "num_hidden_layers"),
    "num_hidden_layers a list": (dict(num_hidden_layers=[1]), "num_hidden_layers"),
    "num_hidden_layers 0": (dict(num_hidden_layers=0), "num_hidden_layers"),
    "num_hidden_layers text": (dict(num_hidden_layers="8"), "num_hidden_layers"),
    "full_attention_interval 0": (dict(full_attention_interval=0, layer_types=DELETE), "full_attention_interval"),
    "hidden_size a list": (dict(hidden_size=[256]), "hidden_size"),
    "hidden_size 2.5": (dict(hidden_size=2.5), "hidden_size"),
    "vocab_size negative": (dict(vocab_size=-1), "vocab_size"),
    "num_attention_heads 0": (dict(num_attention_heads=0), "num_attention_heads"),
    "num_key_value_heads true": (dict(num_key_value_heads=True), "num_key_value_heads"),
    "head_dim 0": (dict(head_dim=0), "head_dim"),
    "rms_norm_eps NaN": (dict(rms_norm_eps=math.nan), "rms_norm_eps"),
    "rms_norm_eps 0": (dict(rms_norm_eps=0), "rms_norm_eps"),
    "rope_parameters text": (dict(rope_parameters="x"), "rope_parameters"),
    "rope_theta text": (dict(rope_parameters={**ROPE, "rope_theta": "x"}), "rope_theta"),
    "partial_rotary_factor 2": (dict(rope_parameters={**ROPE, "partial_rotary_factor": 2}), "partial_rotary_factor"),
    "mrope_section text": (dict(rope_parameters={**ROPE, "mrope_section": "x"}), "mrope_section"),
    "text_config text": (dict(text_config="x", architectures=["Qwen3_5ForConditionalGeneration"]), "text_config"),
    "layer_types a number": (dict(layer_types=5), "layer_types"),
    "layer_types unknown": (dict(layer_types=["bogus"] * TARGET.num_layers), "layer types"),
    "tie_word_embeddings text": (dict(tie_word_embeddings="no"), "tie_word_embeddings"),
    "max_position_embeddings 0": (dict(max_position_embeddings=0), "max_position_embeddings"),
    "architectures a number": (dict(architectures=5), "architectures"),
    "linear_conv_kernel_dim negative": (dict(linear_conv_kernel_dim=-1), "linear_conv_kernel_dim"),
}


def hf_configs() -> dict[str, tuple[bytes, tuple[str, ...]]]:
    """Every bad HF config.json: name -> (bytes, the fields its error may name)."""
    edited = {name: (json.dumps(hf_config(**c)).encode(), (field,)) for name, (c, field) in HF_CHANGES.items()}
    return {**edited, **RAW_CONFIGS}


def _hf_cases() -> list[Case]:
    """Every other HF config through generate (all of them are checked in process)."""
    return [_config_case("hf", name, raw, fields, drafter=False) for name, (raw, fields) in
            list(hf_configs().items())[::2]]


DRAFT_BASE = json.loads((TINY / "draft-full" / "config.json").read_text())


def drafter_config(**changes) -> dict:
    return changed(json.loads(json.dumps(DRAFT_BASE)), changes)


DFLASH = DRAFT_BASE["dflash_config"]
DRAFT_CHANGES = {  # name: (changes to the fixture drafter's config, the field the error names)
    "num_attention_heads 0 without head_dim": (dict(num_attention_heads=0, head_dim=DELETE), "num_attention_heads"),
    "num_hidden_layers a list": (dict(num_hidden_layers=[1]), "num_hidden_layers"),
    "dflash_config text": (dict(dflash_config="x"), "dflash_config"),
    "target_layer_ids text": (dict(dflash_config={**DFLASH, "target_layer_ids": "x"}), "target_layer_ids"),
    "target_layer_ids past the target": (dict(dflash_config={**DFLASH, "target_layer_ids": [100]}),
                                         "target_layer_ids"),
    "mask_token_id 2^40": (dict(dflash_config={**DFLASH, "mask_token_id": 2**40}), "mask_token_id"),
    "block_size 0": (dict(block_size=0), "block_size"),
    "block_size 1e10": (dict(block_size=1e10), "block_size"),
    "num_target_layers text": (dict(num_target_layers="8"), "num_target_layers"),
    "head_dim negative": (dict(head_dim=-1), "head_dim"),
    "rms_norm_eps infinite": (dict(rms_norm_eps=math.inf), "rms_norm_eps"),
    "sliding_window text": (dict(sliding_window="x"), "sliding_window"),
    "layer_types a number": (dict(layer_types=5), "layer_types"),
    "vocab_size 1e10": (dict(vocab_size=1e10), "vocab_size"),
    "architectures text": (dict(architectures="DFlashDraftModel"), "architectures"),
}


def draft_configs() -> dict[str, tuple[bytes, tuple[str, ...]]]:
    """Every bad drafter config.json: name -> (bytes, the fields its error may name)."""
    edited = {name: (json.dumps(drafter_config(**c)).encode(), (field,)) for name, (c, field) in DRAFT_CHANGES.items()}
    return {**edited, **RAW_CONFIGS}


def _draft_cases() -> list[Case]:
    """Every other drafter config through generate (all of them are checked in process)."""
    return [_config_case("drafter", name, raw, fields, drafter=True) for name, (raw, fields) in
            list(draft_configs().items())[1::2]]


def _flag_case(name: str, run: Callable[[Path], Run], fields: tuple[str, ...], named: Callable | None = None) -> Case:
    def build(folder: Path):
        return (named(folder) if named else None), [run(folder)]
    return Case(f"flags-{name}", build, fields)


def _huge_npy(folder: Path) -> Path:
    path = folder / "ids.npy"
    with open(path, "wb") as f:
        np.lib.format.write_array_header_2_0(f, {"descr": "<i8", "fortran_order": False, "shape": (2**40,)})
    return path


def _long_context_gguf(folder: Path) -> Path:
    path = folder / "long.gguf"
    rewrite_gguf(TINY_GGUF, path, set_keys=[("qwen35.context_length", 2**30, VT.UINT32, None)])
    return path


def _bad_jsonl(folder: Path, line: str) -> Path:
    path = folder / "data.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    return path


def _train_draft(folder: Path, line: str) -> Run:
    return Run("train_draft", ("--jit_cache=", "--target", str(TINY_GGUF), "--data", str(_bad_jsonl(folder, line)),
                               "--out", str(folder / "drafter"), "--steps", "1"))


def _flag_cases() -> list[Case]:
    ar = ("--target", str(TINY_GGUF), "--mode", "ar")
    score = lambda *a: Run("score", ("--target", str(TINY_GGUF), *a))  # noqa: E731
    tiny = lambda *a: Run("testing.tiny", a)  # noqa: E731
    return [
        _flag_case("prompt not UTF-8", lambda d: generate(*ar, b"--prompt=caf\xe9"), ("--prompt",)),
        _flag_case("system not UTF-8", lambda d: generate(*ar, b"--system=\xff", "--prompt=hi"), ("--system",)),
        _flag_case("stdin not UTF-8", lambda d: generate(*ar, stdin=b"def f(x):\n    return '\xff'\n"), ("stdin",)),
        _flag_case("prompt_ids 2^63", lambda d: generate(*ar, "--prompt_ids", str(2**63)), ("--prompt_ids",)),
        _flag_case("prompt_ids negative", lambda d: generate(*ar, "--prompt_ids", "1,-1"), ("--prompt_ids",)),
        _flag_case("prompt_ids a huge .npy", lambda d: generate(*ar, "--prompt_ids", str(_huge_npy(d))),
                   ("--prompt_ids",), named=lambda d: d / "ids.npy"),
        _flag_case("n_gen 1e12", lambda d: generate(*ar, *PROMPT, "--n_gen", "1000000000000"), ("--n_gen",)),
        _flag_case("max_ctx 1e9", lambda d: generate(*ar, *PROMPT, "--max_ctx", "1000000000"), ("--max_ctx",)),
        _flag_case("max_ctx past memory", lambda d: generate("--target", str(_long_context_gguf(d)), "--mode", "ar",
                                                             *PROMPT, "--max_ctx", "1000000000"), ("--max_ctx",)),
        _flag_case("prompt past the context", lambda d: generate(*ar, "--raw", "--prompt", "x " * 30_000),
                   ("prompt of",)),
        _flag_case("kv_type unknown", lambda d: generate(*ar, *PROMPT, "--kv_type", "q3_0"), ("--kv_type",)),
        _flag_case("score kv_type unknown", lambda d: score("--ids", "1,2", "--kv_type", "fp8"), ("--kv_type",)),
        _flag_case("kv_type_k unknown", lambda d: generate(*ar, *PROMPT, "--kv_type_k", "q3_0"), ("--kv_type_k",)),
        _flag_case("score kv_type_v unknown", lambda d: score("--ids", "1,2", "--kv_type_v", "fp8"),
                   ("--kv_type_v",)),
        _flag_case("draft_ctx negative", lambda d: generate(*ar, *PROMPT, "--draft_ctx", "-1"),
                   ("--draft_ctx",)),
        _flag_case("devices past those present", lambda d: generate(*ar, *PROMPT, "--devices", "64"),
                   ("--devices 64",)),
        _flag_case("devices not a count", lambda d: generate(*ar, *PROMPT, "--devices", "two"), ("--devices",)),
        _flag_case("score devices 0", lambda d: score("--ids", "1,2", "--devices", "0"), ("--devices 0",)),
        _flag_case("coordinator alone", lambda d: generate(*ar, *PROMPT, "--coordinator", "localhost:1"),
                   ("--num_processes", "--process_id")),
        _flag_case("score over two processes", lambda d: score("--ids", "1,2", "--coordinator", "localhost:1",
                                                               "--num_processes", "2", "--process_id", "0"),
                   ("--num_processes 2",)),
        _flag_case("score chunk 0", lambda d: score("--ids", "1,2", "--prefill_chunk", "0"), ("--prefill_chunk",)),
        _flag_case("score chunk -1", lambda d: score("--ids", "1,2", "--prefill_chunk", "-1"), ("--prefill_chunk",)),
        _flag_case("score chunk not a multiple of 64", lambda d: score("--ids", "1,2", "--prefill_chunk", "100"),
                   ("prefill_chunk",)),
        _flag_case("score chunk past the context", lambda d: score("--ids", "1,2", "--prefill_chunk", "100032"),
                   ("--prefill_chunk",)),
        _flag_case("generate prefill_chunk not a multiple of 64",
                   lambda d: generate(*ar, *PROMPT, "--prefill_chunk", "96"), ("prefill_chunk",)),
        _flag_case("score out in a missing folder", lambda d: score("--ids", "1,2", "--out", str(d / "no" / "x")),
                   ("--out",), named=lambda d: d / "no"),
        _flag_case("score ids and text", lambda d: score("--ids", "1,2", "--text", "hi"), ("--ids",)),
        _flag_case("score text not UTF-8", lambda d: score(b"--text=\xff\xfe"), ("--text",)),
        _flag_case("score ids 2^64", lambda d: score("--ids", str(2**64)), ("--ids",)),
        _flag_case("tiny out in a missing folder", lambda d: tiny("--out", str(d / "no" / "x.gguf")), ("--out",),
                   named=lambda d: d / "no"),
        _flag_case("tiny out a folder", lambda d: tiny("--out", str(d)), ("--out",), named=lambda d: d),
        _flag_case("tiny bad config", lambda d: tiny("--out", str(d / "x.gguf"), "--config",
                                                     str(TINY / "draft-full" / "config.json")), ("model_type",),
                   named=lambda d: TINY / "draft-full" / "config.json"),
        _flag_case("train_draft JSONL line not an object", lambda d: _train_draft(d, "[1, 2]"), ("data.jsonl:2",),
                   named=lambda d: d / "data.jsonl"),
        _flag_case("train_draft JSONL line not JSON", lambda d: _train_draft(d, "{oops"), ("data.jsonl:2",),
                   named=lambda d: d / "data.jsonl"),
    ]


CASES = [*_cut_cases(), *_layout_cases(), *_data_cases(), *_metadata_cases(), *_tokenizer_cases(), *_hf_cases(),
         *_draft_cases(), *_flag_cases()]


def folder_name(case: Case) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", case.name)
