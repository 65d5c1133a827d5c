"""scripts/exactness.py on the fixture pair: every configuration equals AR (greedy and sampled, on the CPU's exact
reference path), and its pieces: the first difference and the nucleus's slack."""

import json
import sys

import numpy as np

from conftest import ROOT, TINY

sys.path.insert(0, str(ROOT / "scripts"))
import exactness  # noqa: E402
from benchlib import first_difference  # noqa: E402


def test_every_configuration_equals_ar(tiny_gguf_path, tmp_path, capsys):
    prompts = tmp_path / "code.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ("def f(x):\n", "import os\n")))
    for extra in ([], ["--temperature", "0.8", "--top_p", "0.9", "--seed", "4"]):
        out = tmp_path / "r.json"
        exactness.main(["--target", str(tiny_gguf_path), "--draft", str(TINY / "draft-full"), "--sets", str(prompts),
                        "--n_gen", "12", "--budgets", "3,8", "--out", str(out), *extra])
        report = json.loads(out.read_text())
        rows = report["sets"]["code"]
        assert [(r["mode"], r["budget"]) for r in rows] == [("chain", None), ("ddtree", 3), ("ddtree", 8)]
        assert all(r["same_as_ar"] == r["prompts"] == 2 and not r["diverged"] for r in rows), rows
        assert report["sampling"]["temperature"] == (0.8 if extra else 0.0)
        assert "2/2 identical to AR" in capsys.readouterr().out


def test_first_difference_and_nucleus_slack():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1 and first_difference([1, 2], [1, 2, 3]) == 2
    z = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    # the cumulative 0.5, 0.8, 0.95, 1.0: top_p 0.79 reaches it at the second token, 0.01 from its sum
    assert abs(exactness.nucleus_slack(z, 0.79) - 0.01) < 1e-9
    assert abs(exactness.nucleus_slack(z, 0.9) - 0.05) < 1e-9
