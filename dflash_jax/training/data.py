"""Training text: files read in a fixed order, a held-out split by file, tokenized and packed into sequences."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Iterator, Sequence

import numpy as np

from dflash_jax.errors import InputError, brief

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".c", ".h", ".json", ".jsonl", ".toml", ".cfg")


class DataError(InputError):
    """Training data that cannot be used: missing, empty, or too short for one sequence."""


def list_files(paths: Sequence[str], suffixes: Sequence[str] = TEXT_SUFFIXES) -> list[str]:
    """Every text file under the given files and directories, sorted (the same list on every run)."""
    found = []
    for path in paths:
        if os.path.isfile(path):
            found.append(path)
        elif os.path.isdir(path):
            for root, dirs, files in os.walk(path):
                dirs.sort()
                found += [os.path.join(root, f) for f in sorted(files) if f.endswith(tuple(suffixes))]
        else:
            raise DataError(f"{path}: no such file or directory")
    return sorted(set(found))


def _jsonl_text(line: str, where: str) -> str:
    """The string 'text' field of one JSONL line, or a DataError naming the file and line."""
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, RecursionError) as e:
        raise DataError(f"{where}: not a JSON line ({type(e).__name__}: {str(e)[:80]})") from None
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise DataError(f"{where}: a JSONL line must be an object with a string 'text' field, found "
                        f"{brief(record)}")
    return record["text"]


def _jsonl_documents(path: str) -> Iterator[tuple[str, str]]:
    """(path:line, text) of each non-blank line of a UTF-8 .jsonl file."""
    with open(path, "rb") as f:
        for i, raw in enumerate(f):
            where = f"{path}:{i + 1}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
            if line.strip():
                yield where, _jsonl_text(line, where)


def read_documents(files: Sequence[str]) -> Iterator[tuple[str, str]]:
    """(name, text) per document: a .jsonl line's "text" field, or a whole UTF-8 file; other files are skipped."""
    for path in files:
        if path.endswith(".jsonl"):
            yield from _jsonl_documents(path)
            continue
        try:
            with open(path, encoding="utf-8") as f:
                yield path, f.read()
        except UnicodeDecodeError:
            continue


def held_out(name: str, fraction: float) -> bool:
    """Whether a document belongs to the held-out split: a hash of its name, so the split never depends on order."""
    digest = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return digest / 2**64 < fraction


def split(docs: Sequence[tuple[str, str]], fraction: float) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(training, held-out) documents: each goes where `held_out` of its name says."""
    parts: tuple[list, list] = ([], [])
    for doc in docs:
        parts[held_out(doc[0], fraction)].append(doc)
    return parts


def dedupe(docs: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """Documents with the same text kept once (the first name wins)."""
    seen, out = set(), []
    for name, text in docs:
        key = hashlib.sha256(text.encode()).digest()
        if key not in seen and text.strip():
            seen.add(key)
            out.append((name, text))
    return out


def pack(token_lists: Sequence[Sequence[int]], seq_len: int, separator: int) -> np.ndarray:
    """Documents joined by the separator token and cut into [n, seq_len] rows (the tail that does not fill a row
    is dropped)."""
    stream = []
    for ids in token_lists:
        stream.extend(ids)
        stream.append(separator)
    n = len(stream) // seq_len
    if n == 0:
        raise DataError(f"{len(stream)} tokens of data do not fill one sequence of {seq_len}")
    return np.asarray(stream[:n * seq_len], np.int32).reshape(n, seq_len)


def batches(data: np.ndarray, batch: int, seed: int, start_step: int = 0) -> Iterator[np.ndarray]:
    """Batches of rows, reshuffled every epoch from the seed; start_step resumes the same sequence of batches."""
    per_epoch = len(data) // batch
    if per_epoch == 0:
        raise DataError(f"{len(data)} sequences do not fill one batch of {batch}")
    step = start_step
    while True:
        epoch, i = divmod(step, per_epoch)
        order = np.random.default_rng([seed, epoch]).permutation(len(data))
        yield data[order[i * batch:(i + 1) * batch]]
        step += 1
