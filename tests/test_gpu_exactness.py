"""(-m gpu) Issue 38's GPU check: the fixture pair through the Pallas kernels (the device's defaults, exact numerics),
20 prompts, greedy and sampled: chain and DDTree emit AR's tokens, as `scripts/exactness.py` reports them."""

import json
import sys

import pytest

from conftest import ROOT, TINY

sys.path.insert(0, str(ROOT / "scripts"))
import exactness  # noqa: E402

pytestmark = pytest.mark.gpu

PROMPTS = [f"def f{i}(x, y):\n    \"\"\"Return the {w} of x and y.\"\"\"\n" for i, w in enumerate(
    ("sum", "product", "maximum", "minimum", "mean", "difference", "ratio", "power", "remainder", "gcd", "lcm",
     "distance", "angle", "hash", "concatenation", "union", "intersection", "larger", "smaller", "average"))]


@pytest.mark.parametrize("sampling", [[], ["--temperature", "0.7", "--top_p", "0.95", "--seed", "0"]],
                         ids=["greedy", "t0.7"])
def test_chain_and_ddtree_equal_ar_on_the_gpu(tiny_gguf_path, tmp_path, sampling):
    prompts = tmp_path / "code.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS))
    out = tmp_path / "r.json"
    exactness.main(["--target", str(tiny_gguf_path), "--draft", str(TINY / "draft-full"), "--sets", str(prompts),
                    "--n_gen", "32", "--budgets", "8,22", "--out", str(out), *sampling])
    report = json.loads(out.read_text())
    assert report["kernels"]["impl"] == "pallas" and report["kernels"]["numerics"] == "exact", report["kernels"]
    rows = report["sets"]["code"]
    assert [r["prompts"] for r in rows] == [20, 20, 20]
    assert all(r["same_as_ar"] == 20 for r in rows), [(r["mode"], r["budget"], r["diverged"]) for r in rows]
