"""Every bad input a one-line error (issue 39): a generated corpus of malformed GGUF files, HF and drafter configs and
flags, each run as a subprocess of the commands that read it (`inspect` and `generate` for a GGUF header or tensor
table, `generate` for tensor data and configs, the command concerned for a flag). Each run must exit with code 2 and
one line on stderr that names the file and the field, without a traceback, within TIME_LIMIT_S seconds and
MEMORY_LIMIT bytes resident. The runs go in parallel, each a child forked from one process that imported the commands
once (tests/cli_forks.py); the GGUF edits are also checked in process, more of them (every truncation point of the
header, every variant of every metadata key)."""

import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from gguf import GGUFValueType as VT

from bad_inputs_corpus import (BASE, CASES, CONFIG_KEYS, DATA_START, DRAFT_BASE, KEY, KVS, TARGET, TENSORS, Outcome,
                               Run, check_one_line, draft_configs, drafter_config, expected_at_cut, folder_name,
                               hf_config, hf_configs, layout, metadata_variants, patched, rewritten, run_clis, u64)
from conftest import ROOT, TINY_GGUF
from dflash_jax.errors import InputError
from dflash_jax.gguf import GGUFError, GGUFModel
from dflash_jax.load import draft_config, hf_target_config
from dflash_jax.testing.gguf_writer import rewrite_gguf


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, list[tuple[Run, Outcome, Path | None]]]:
    """Every case's runs, in parallel subprocesses: case name -> (run, outcome, the file to be named)."""
    root = tmp_path_factory.mktemp("bad-inputs")
    jobs = []
    for case in CASES:
        folder = root / folder_name(case)
        folder.mkdir()
        named, runs = case.build(folder)
        jobs += [(case.name, run, named) for run in runs]
    results = run_clis([run for _, run, _ in jobs], jobs=max(2, os.cpu_count() or 2))
    by_case = collections.defaultdict(list)
    for (name, run, named), outcome in zip(jobs, results):
        by_case[name].append((run, outcome, named))
    return by_case


def test_the_forked_runs_report_what_fresh_interpreters_do(tmp_path):
    """cli_forks.py's children against `python -m` in fresh interpreters: the same exit code and stderr for a bad
    GGUF (inspect), a bad flag (generate), bad ids (score) and `--help` (exit 0, nothing on stderr)."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(BASE[:6])
    runs = [Run("inspect", (str(bad),)), Run("generate", ("--jit_cache=", "--n_gen", "-3")),
            Run("score", ("--ids", "1,x")), Run("score", ("--help",))]
    forked = run_clis(runs, jobs=2)
    for run, got in zip(runs, forked):
        fresh = subprocess.run([sys.executable, "-m", f"dflash_jax.{run.module}", *run.args], cwd=ROOT,
                               capture_output=True, text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        assert (got.code, got.stderr) == (fresh.returncode, fresh.stderr), run


def test_the_corpus_is_large_and_its_names_unique():
    assert len(CASES) >= 60 and len({folder_name(c) for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_one_line_and_exit_code_2(case, outcomes):
    for run, outcome, named in outcomes[case.name]:
        check_one_line(run, outcome, named, case.fields)


# ---------------------------------------------------------------------------------------------------------------
# The same faults in process: more of them, cheaply

def test_the_unedited_inputs_are_accepted(tmp_path):
    """The corpus's bases are valid, so that each case fails for its edit: the fixture GGUF (also as rewritten), the
    HF config and the drafter config."""
    assert layout(BASE)[2] <= len(BASE) and GGUFModel(rewritten()(tmp_path)).config == TARGET
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf_config()))
    assert hf_target_config(str(tmp_path / "hf")) == TARGET
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "config.json").write_text(json.dumps(drafter_config()))
    assert draft_config(tmp_path / "draft", TARGET).num_layers == DRAFT_BASE["num_hidden_layers"]


def _refused(path: Path, fields: tuple[str, ...]) -> str | None:
    """None if opening path raises one GGUFError naming it and one of fields, else what happened."""
    try:
        GGUFModel(path)
    except GGUFError as e:
        message = str(e)
        ok = str(path) in message and any(f in message for f in fields) and "\n" not in message
        return None if ok else message
    return "accepted"


def test_every_cut_of_the_header_and_table_is_refused(tmp_path):
    """Cut at every boundary of the header, the metadata, the tensor table, and at the start of some tensors' data:
    one GGUFError naming the file and what the cut runs into."""
    cuts = sorted({*range(0, 25), *(p for kv in KVS for p in (kv.start, kv.type_pos, kv.value_pos, kv.end - 1)),
                   *(p for t in TENSORS for p in (t.start, t.dims_pos, t.type_pos, t.offset_pos, t.end)),
                   DATA_START, *(DATA_START + t.offset for t in TENSORS[::20]), len(BASE) - 1})
    path = tmp_path / "cut.gguf"
    wrong = {}
    for cut in cuts:
        path.write_bytes(BASE[:cut])
        problem = _refused(path, expected_at_cut(cut))
        if problem:
            wrong[cut] = problem
    assert len(cuts) > 300 and not wrong, wrong


@pytest.mark.parametrize("key", CONFIG_KEYS)
def test_every_variant_of_every_config_key_is_refused(key, tmp_path):
    """Each config key made huge, zero, negative, NaN and text (where that is not a valid value): one GGUFError
    naming the file and the key."""
    wrong = {}
    for kind, value in metadata_variants(key).items():
        path = tmp_path / f"{kind}.gguf"
        rewrite_gguf(TINY_GGUF, path, set_keys=[(key, *value)])
        problem = _refused(path, (key.removeprefix("qwen35."),))
        if problem:
            wrong[kind] = problem
    assert not wrong, wrong


def _config_refused(read: Callable[[Path], object], folder: Path, raw: bytes, fields: tuple[str, ...]) -> str | None:
    """None if reading a config of these bytes raises one InputError naming its file and one of fields."""
    (folder / "config.json").write_bytes(raw)
    try:
        read(folder)
    except InputError as e:
        message = str(e)
        ok = str(folder / "config.json") in message and any(f in message for f in fields) and "\n" not in message
        return None if ok else message
    return "accepted"


def test_every_bad_hf_config_is_refused(tmp_path):
    wrong = {name: problem for name, (raw, fields) in hf_configs().items()
             if (problem := _config_refused(lambda d: hf_target_config(str(d)), tmp_path, raw, fields))}
    assert not wrong, wrong


def test_every_bad_drafter_config_is_refused(tmp_path):
    wrong = {name: problem for name, (raw, fields) in draft_configs().items()
             if (problem := _config_refused(lambda d: draft_config(d, TARGET), tmp_path, raw, fields))}
    assert not wrong, wrong


HF_TENSOR_FAULTS = {  # name: (HF tensor, replacement given the original, the message)
    "conv kernel of another rank": ("model.layers.0.linear_attn.conv1d.weight", lambda x: x[:, 0, :],
                                    "has shape"),
    "NaN in a norm": ("model.norm.weight", lambda x: np.full_like(x, np.nan), "NaN or infinite"),
    "int32 weights": ("model.layers.1.mlp.up_proj.weight", lambda x: x.astype(np.int32), "is I32"),
}


@pytest.mark.parametrize("fault", sorted(HF_TENSOR_FAULTS))
def test_bad_hf_weights_are_refused_naming_the_directory_and_tensor(fault, tmp_path):
    from safetensors.numpy import save_file

    from dflash_jax.load import LoadError, load_target
    from dflash_jax.testing.tiny import random_gguf_tensors, tiny_target_config, write_hf_dir
    from dflash_jax.weights import gguf_to_hf

    cfg = tiny_target_config()
    tensors = gguf_to_hf(random_gguf_tensors(cfg), cfg)
    write_hf_dir(tmp_path, cfg, tensors)
    name, replace, message = HF_TENSOR_FAULTS[fault]
    save_file({**tensors, name: replace(tensors[name])}, str(tmp_path / "model.safetensors"))
    with pytest.raises(LoadError) as err:
        load_target(tmp_path, progress=False)
    assert str(err.value).startswith(f"{tmp_path}: ") and name in str(err.value) and message in str(err.value)


def test_a_file_of_absurd_counts_is_refused_at_once(tmp_path):
    """The issue's two slow ones, in process: block_count 2^31 and an array of 2^60 entries, refused in well under
    a second (gguf-py alone walked the array for 41 s)."""
    big = tmp_path / "blocks.gguf"
    rewrite_gguf(TINY_GGUF, big, set_keys=[("qwen35.block_count", 2**31, VT.UINT32, None)])
    count = tmp_path / "count.gguf"
    count.write_bytes(patched((KEY["tokenizer.ggml.tokens"].value_pos + 4, u64(2**60))))
    for path, key in ((big, "qwen35.block_count"), (count, "tokenizer.ggml.tokens")):
        t0 = time.perf_counter()
        assert _refused(path, (key,)) is None
        assert time.perf_counter() - t0 < 1.0


# ---------------------------------------------------------------------------------------------------------------
# What the commands accept that they used to refuse

def _run(*args: str, module: str = "generate") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"dflash_jax.{module}", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})


@pytest.mark.parametrize("module", ["generate", "score"])
def test_help_exits_0(module):
    proc = _run("--help", module=module)
    assert proc.returncode == 0 and f"python -m dflash_jax.{module}" in proc.stdout and not proc.stderr


def test_score_defaults_to_the_shipped_target_and_names_the_npy_it_writes(tmp_path):
    proc = _run("--ids", "1,2,3", "--out", str(tmp_path / "logits"), module="score")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1].endswith(f"written to {tmp_path / 'logits.npy'}")
    assert np.load(tmp_path / "logits.npy").shape[0] == 3


def test_chat_refuses_a_line_that_is_not_utf8_and_reads_on():
    proc = subprocess.run([sys.executable, "-m", "dflash_jax.chat", "--jit_cache=", "--target", str(TINY_GGUF),
                           "--mode", "ar", "--n_gen", "4", "--max_ctx", "64"], cwd=ROOT, capture_output=True,
                          timeout=300, input=b"hi \xff\n/exit\n", env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0 and b"Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.decode().splitlines()[-1] == "chat: the line is not valid UTF-8 (byte 0xff at character 3)"


def test_inspect_metadata_shows_text_that_is_not_utf8_as_such(tmp_path):
    path = tmp_path / "name.gguf"
    path.write_bytes(patched((KEY["general.name"].value_pos + 8, b"\xff")))
    proc = _run(str(path), "--metadata", "--notensors", module="inspect")
    assert proc.returncode == 0, proc.stderr
    assert any(line.split() == ["general.name", "<text", "that", "is", "not", "valid", "UTF-8>"]
               for line in proc.stdout.splitlines())
