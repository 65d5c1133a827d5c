"""scripts/kv_quality.py on the fixture target, tiny settings: each type's rows over a JSONL set, an ids file and a
long concatenated sequence, against the divergence computed here; KLD grows as the bits shrink; the results file and
table say what ran; K and V may take different types."""

import json
import sys

import numpy as np

from conftest import ROOT, TINY


def test_kv_quality_measures_each_type(tiny_gguf_path, tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "scripts"))
    import kv_quality

    prompts = tmp_path / "code.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ("def f(x):\n    return x", "import os\n")))
    out = tmp_path / "q.json"
    kv_quality.main(["--target", str(tiny_gguf_path), "--sets", str(prompts), "--ids", str(TINY / "tokens.npy"),
                     "--long", "100", "--n_long", "1", "--types", "q8_0,q4_0,rq3_0,q8_0/q4_0", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["groups"]["tokens"] == [48] and report["groups"]["long 100"] == [100]
    rows = {(r["group"], r["kv_type"]): r for r in report["rows"]}
    assert set(rows) == {(g, t) for g in ("code", "tokens", "long 100", "all")
                         for t in ("q8_0", "q4_0", "rq3_0", "q8_0/q4_0")}
    assert rows["all", "q8_0"]["positions"] == sum(report["groups"]["code"]) + 48 + 100
    kld = [rows["all", t]["mean_kld"] for t in ("q8_0", "q4_0", "rq3_0")]
    assert 0 < kld[0] < kld[1] < kld[2] and 0.5 < rows["all", "rq3_0"]["top1_agreement"] <= 1
    # q8_0 keys beside q4_0 values: the values' coarser type adds to the keys' error
    assert rows["all", "q8_0/q4_0"]["bits"] == 6.5 and kld[0] < rows["all", "q8_0/q4_0"]["mean_kld"]
    assert report["command"].startswith("python scripts/kv_quality.py --target") and report["jax"] and report["date"]
    table = (tmp_path / "q.txt").read_text()
    assert table == capsys.readouterr().out.rstrip("\n") + "\n"
    assert any(line.split()[:4] == ["tokens", "q8_0", "8.5", "48"] for line in table.splitlines())


def test_divergence_against_a_direct_computation():
    sys.path.insert(0, str(ROOT / "scripts"))
    from kv_quality import divergence

    rng = np.random.default_rng(0)
    ref, got = rng.standard_normal((5, 7)) * 3, rng.standard_normal((5, 7)) * 3
    p = np.exp(ref) / np.exp(ref).sum(-1, keepdims=True)
    q = np.exp(got) / np.exp(got).sum(-1, keepdims=True)
    kl, agree = divergence(ref.astype(np.float32), got.astype(np.float32))
    np.testing.assert_allclose(kl, (p * np.log(p / q)).sum(-1), rtol=1e-5)
    assert agree.tolist() == (ref.argmax(-1) == got.argmax(-1)).tolist()
    assert np.all(divergence(ref, ref)[0] == 0)
