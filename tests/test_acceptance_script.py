"""scripts/acceptance.py on the fixture pair: every configuration runs, each output equals AR's (the reference path
is exact), AL is the tokens per step, and the results file and table say so."""

import json
import sys

from conftest import ROOT, TINY


def test_acceptance_script_measures_each_configuration(tiny_gguf_path, tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "scripts"))
    import acceptance

    prompts = tmp_path / "code.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ("def f(x):\n", "import os\n", "x = [1, 2")))
    out = tmp_path / "r.json"
    acceptance.main(["--target", str(tiny_gguf_path), "--draft", str(TINY / "draft-full"), "--sets", str(prompts),
                     "--n_gen", "12", "--budgets", "3", "--out", str(out)])
    report = json.loads(out.read_text())
    rows = report["sets"]["code"]["results"]
    assert [(r["mode"], r["budget"]) for r in rows] == [("ar", None), ("chain", None), ("ddtree", 3)]
    for r in rows:
        assert r["same_as_ar"] == 3 and r["decoded"] == rows[0]["decoded"] <= 3 * 11  # the first is from prefill
        assert r["al"] == r["decoded"] / r["steps"] == sum((i + 1) * n for i, n in enumerate(r["histogram"])) / \
            r["steps"]
    # a budget-3 tree emits at most 4 per step
    assert rows[0]["al"] == 1.0 and rows[0]["steps"] == rows[0]["decoded"] and len(rows[2]["histogram"]) == 4
    # with no engine flags, the configuration a user's `generate` runs on this machine (a CPU)
    assert (report["kernels"]["impl"], report["kv_type"], report["chain_seed"]) == ("reference", "f32", "auto")
    table = (tmp_path / "r.txt").read_text()
    assert table == capsys.readouterr().out.rstrip("\n") + "\n" and "ddtree      3" in table and "1.00x" in table


def test_acceptance_script_sweeps_drafter_contexts_over_long_prompts(tiny_gguf_path, tmp_path):
    """--long makes prompts of concatenated ones; --draft_ctxs runs chain and the trees at each drafter context bound
    against one AR reference, every output equal to AR's."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import acceptance

    prompts = tmp_path / "code.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ("def f(x):\n", "import os\n", "x = [1, 2")))
    out = tmp_path / "r.json"
    acceptance.main(["--target", str(tiny_gguf_path), "--draft", str(TINY / "draft-full"), "--sets", str(prompts),
                     "--n_gen", "8", "--budgets", "3", "--long", "40", "--n_long", "2", "--draft_ctxs", "0,16",
                     "--out", str(out)])
    report = json.loads(out.read_text())
    s = report["sets"]["code-40"]
    assert (s["prompts"], s["prompt_tokens"]) == (2, 80)
    assert [(r["mode"], r["budget"], r["draft_ctx"]) for r in s["results"]] == [
        ("ar", None, None), ("chain", None, None), ("ddtree", 3, None), ("chain", None, 16), ("ddtree", 3, 16)]
    assert all(r["same_as_ar"] == 2 for r in s["results"])
    table = (tmp_path / "r.txt").read_text().splitlines()
    assert table[1] == "# " + report["command"] and table[-1].split()[-1] == "16" and table[-3].split()[-1] == "all"
