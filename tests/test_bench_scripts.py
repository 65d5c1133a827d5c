"""scripts/bench.py (tiny synthetic pair) and scripts/budget_sweep.py (fixture pair) run as documented and write what
they say; the verify-cost fits recover known lines."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, TINY

sys.path.insert(0, str(ROOT / "scripts"))


def run_script(module, argv):
    module.main(argv)


def test_fit_verify_cost_recovers_lines():
    from benchlib import fit_verify_cost

    fit = fit_verify_cost([(n, 2.0 + 0.5 * n) for n in (5, 9, 17, 23)])
    assert fit["n"]["a_ms"] == pytest.approx(2.0) and fit["n"]["b_ms"] == pytest.approx(0.5)
    assert fit["n"]["max_rel_residual"] < 1e-9
    tiled = fit_verify_cost([(n, 10.0 + {16: 16, 32: 32, 64: 64}[t] * 0.25) for n, t in
                             ((5, 16), (16, 16), (17, 32), (23, 32), (40, 64))])
    assert tiled["tile"]["b_ms"] == pytest.approx(0.25) and tiled["tile"]["max_rel_residual"] < 1e-9
    assert tiled["n"]["max_rel_residual"] > 0.01  # a step function is not a line in N


def test_bench_on_the_tiny_synthetic_pair(tmp_path, capsys):
    import bench

    out, trace = tmp_path / "bench.json", tmp_path / "trace"
    argv = ["--model", "tiny", "--out", str(out), "--sections", "ar,forced,steps", "--budgets", "4", "--no-chain",
            "--als", "3", "--forced_budget", "4", "--max_ctx", "256", "--prompt_len", "16", "--n_gen", "32", "--iters",
            "1", "--impl", "reference", "--profile", str(trace)]
    run_script(bench, argv)
    res = json.loads(out.read_text())
    # --profile: 8 AR steps and the forced engine's steps traced, each into its folder; a CPU's trace has no GPU events
    assert set(res["profile"]) == {"ar", "ddtree-4"}
    for label, p in res["profile"].items():
        assert p["dir"] == str(trace / label) and any((trace / label).rglob("*.xplane.pb")) and p["gpus"] == {}
    assert res["profile"]["ar"]["steps"] == 8 and 0 < res["profile"]["ddtree-4"]["steps"] <= 8
    # after the build the live arrays on the device are the two models' (one device: as their trees count them)
    models = res["models"]
    assert models["accounting"]["named"] == {"target": models["target_device_bytes"],
                                             "drafter": models["draft_device_bytes"]}
    assert res["ar"]["tokens_per_s"] > 0 and 0 < res["ar"]["roofline_fraction"]
    # the roofline: the step's weights read once at the read-stream rate (not the copy rate, half writes)
    assert res["ar"]["roofline_ms"] == pytest.approx(1e3 * res["models"]["step_weight_bytes"] / res["read_rate"])
    forced, = res["forced"]
    assert forced["follows_sequence"] and abs(forced["accept_length"] - 3) <= 0.15 * 3  # calibrated to the goal
    step, = res["steps"]
    assert step["mode"] == "ddtree" and step["budget"] == 4 and step["phases_ms"]["verify_tokens"] == 5
    assert all(step["phases_ms"][k] > 0 for k in ("draft", "tree", "verify", "accept_commit"))
    assert any("_step" in r["name"] for r in res["compile"])
    assert res["kernels"]["impl"] == "reference" and res["engine"]["kv_type"] == "f32"  # a CPU's defaults
    printed = capsys.readouterr().out
    assert "forced DDTree-4: AL" in printed and " ddtree      4 " in printed
    assert "ar: no GPU kernel events in the trace (a cpu run has none)" in printed
    assert "memory after the models: live arrays" in printed
    with pytest.raises(SystemExit, match="earlier run's traces"):  # they would be summed with the new ones
        run_script(bench, argv)
    merged = tmp_path / "merged.json"
    run_script(bench, ["--out", str(merged), "--merge", f"{out}:steps+forced"])
    again = json.loads(merged.read_text())
    assert again["steps"] == res["steps"] and again["forced"] == res["forced"] and again["ar"] == res["ar"]
    assert again["read_rate"] == res["read_rate"]
    assert (tmp_path / "merged.txt").read_text().strip() == bench.summary(again).strip()


def test_bench_first_token_of_a_tree_engine(tmp_path, capsys):
    """`--sections first_token --ttft_mode ddtree`: this process's first generation is a DDTree engine's, its TTFT
    the prefill (with the drafter's context) and the first tree step, compiles included."""
    import bench

    out = tmp_path / "ddtree.json"
    run_script(bench, ["--model", "tiny", "--out", str(out), "--sections", "first_token", "--ttft_mode", "ddtree",
                       "--prompt_len", "16", "--max_ctx", "256", "--impl", "reference"])
    r = json.loads(out.read_text())["first_token"]
    assert r["mode"] == "ddtree" and r["prompt_len"] == 16 and 0 < r["prefill_s"] < r["ttft_s"]
    assert "(ddtree, 16 tokens; trace" in capsys.readouterr().out


def test_bench_prefill_and_ttft_on_the_tiny_synthetic_pair(tmp_path, capsys):
    """`--sections ttft,prefill`: a row per chunk size and prompt length, the first call of each chunk size compiling
    (its prefill chunk once: the memory analysis finds the program compiled) and the second length nothing; two fresh
    processes' TTFT, the one with the cache the first wrote finding every program there; --merge keeps the rows."""
    import bench

    out = tmp_path / "bench.json"
    run_script(bench, ["--model", "tiny", "--out", str(out), "--sections", "ttft,prefill", "--prefill_lens", "16,300",
                       "--prefill_chunks", "64,128", "--prefill_calls", "2", "--prompt_len", "16", "--max_ctx", "256",
                       "--impl", "reference", "--jit_cache_min_s", "0",  # every program kept: the test's CPU is fast
                       "--profile", str(tmp_path / "trace")])
    res = json.loads(out.read_text())
    # one warm prefill of the first length traced per chunk size, per 64-token block of the chunks it computed
    assert {k: (p["prompt_len"], p["chunk"], p["steps"], p["unit"]) for k, p in res["profile"].items()} == {
        "prefill-64": (16, 64, 1, "64-token block"), "prefill-128": (16, 128, 2, "64-token block")}
    rows = res["prefill"]
    # one context for all, fitting the longest prompt (a size no other test's engine has: the first calls compile)
    assert [(r["chunk"], r["prompt_len"], r["max_ctx"]) for r in rows] == [(64, 16, 512), (64, 300, 512),
                                                                          (128, 16, 512), (128, 300, 512)]
    assert all(r["tokens_per_s"] == pytest.approx(r["prompt_len"] / r["prefill_s"]) for r in rows)
    assert all(0 < r["prefill_s"] < r["ttft_s"] and r["first_prefill_s"] < r["first_ttft_s"] for r in rows)
    assert [r["first_compiles"] > 0 for r in rows] == [True, False, True, False]
    assert [r["first_compile_s"] > 0 for r in rows] == [True, False, True, False]
    assert sum(r["compiles"] for r in res["compile"] if r["name"] == "jit(chunk)") == 2
    for r in rows:  # the chunk's call holds the weights and the state (donated: written in place) and temporaries
        m = r["chunk_memory"]
        assert m["alias_bytes"] == r["state_bytes"] > 0 and m["temp_bytes"] > 0
        assert r["chunk_peak_bytes"] == m["argument_bytes"] + m["output_bytes"] - m["alias_bytes"] + m["temp_bytes"]
        assert m["argument_bytes"] > res["models"]["target_device_bytes"] + r["state_bytes"]
        assert r["memory"] == {}  # a CPU reports no device memory
    assert rows[0]["chunk_memory"]["temp_bytes"] < rows[2]["chunk_memory"]["temp_bytes"]  # twice the rows
    empty, warm = res["ttft"]
    assert (empty["cache"], warm["cache"]) == ("empty", "warm")
    for r in (empty, warm):
        assert r["prompt_len"] == 16 and 0 < r["prefill_s"] < r["ttft_s"] and r["build_s"] > 0
        assert 0 < r["start_s"] and r["ttft_s"] < r["to_token_less_build_s"]
        assert r["compiles"] == r["cache_requests"] > 0
    assert empty["mode"] == warm["mode"] == "ar"  # --ttft_mode's default
    assert empty["cache_hits"] == 0 and warm["cache_hits"] == warm["compiles"] == empty["compiles"]
    assert warm["compile_s"] < empty["compile_s"]
    printed = capsys.readouterr().out
    assert "prefill   chunk  tokens    tok/s" in printed and "TTFT of a fresh process, warm cache" in printed
    merged = tmp_path / "merged.json"
    run_script(bench, ["--out", str(merged), "--merge", f"{out}:prefill+ttft", f"{out}:prefill"])
    again = json.loads(merged.read_text())
    assert again["prefill"] == rows and again["ttft"] == res["ttft"] and "ar" not in again
    assert (tmp_path / "merged.txt").read_text().strip() == bench.summary(again).strip()


def test_bench_refuses_bad_prefill_flags(tmp_path):
    """Unknown sections, prompt lengths that are not positive integers, chunks that are not multiples of 64 and no
    warm calls are refused before anything runs."""
    import bench

    from dflash_jax.config import ConfigError

    out = ["--model", "tiny", "--out", str(tmp_path / "x.json")]
    with pytest.raises(SystemExit, match="unknown prefil"):
        run_script(bench, out + ["--sections", "prefil"])
    with pytest.raises(SystemExit, match="--prefill_lens '512,0'"):
        run_script(bench, out + ["--sections", "prefill", "--prefill_lens", "512,0"])
    with pytest.raises(ConfigError, match="prefill_chunk 100 must be a positive multiple of 64"):
        run_script(bench, out + ["--sections", "prefill", "--prefill_chunks", "64,100"])
    with pytest.raises(SystemExit, match="--prefill_calls 0"):
        run_script(bench, out + ["--sections", "prefill", "--prefill_calls", "0"])
    assert not (tmp_path / "x.json").exists()


def test_bench_steps_without_their_phases(tmp_path, capsys):
    """--no-phases: the steps row has the fused step's time, and neither phases nor the oracle are timed (nor
    compiled)."""
    import bench

    out = tmp_path / "bench.json"
    run_script(bench, ["--model", "tiny", "--out", str(out), "--sections", "steps", "--budgets", "4", "--no-chain",
                       "--max_ctx", "256", "--prompt_len", "16", "--n_gen", "32", "--iters", "1", "--impl",
                       "reference", "--step_error_rate", "0.2", "--no-phases"])
    res = json.loads(out.read_text())
    step, = res["steps"]
    assert step["phases_ms"] is None and step["step_ms"] > 0 and step["follows_sequence"]
    assert "oracle_ms" not in res
    assert " ddtree      4       -       -       -       - " in capsys.readouterr().out


def test_bench_times_a_sharded_step_whole(tmp_path):
    """--devices 2 (two CPU devices, a process of its own): the steps row has the fused step's time and AR's tokens,
    and no phases (phase timing takes one device's target)."""
    out = tmp_path / "bench.json"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--model", "tiny", "--out", str(out),
                           "--sections", "ar,steps", "--budgets", "4", "--no-chain", "--max_ctx", "256",
                           "--prompt_len", "16", "--n_gen", "32", "--iters", "1", "--impl", "reference",
                           "--step_error_rate", "0.2", "--devices", "2"], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    step, = res["steps"]
    assert res["devices"] == 2 and step["phases_ms"] is None and step["step_ms"] > 0
    assert step["differs_from_ar_at"] is None and step["follows_sequence"]
    assert " ddtree      4       -       -       -       - " in proc.stdout


def test_prefix_cache_bench_on_the_tiny_synthetic_pair(tmp_path, capsys):
    """scripts/prefix_cache_bench.py with tiny settings: without the cache every request prefills its whole prompt;
    with it the main conversation prefills only each turn's new ids (and the last reply's pending token), the side
    requests only their own part; the replies are the same both ways."""
    import prefix_cache_bench

    out = tmp_path / "pc.json"
    run_script(prefix_cache_bench, ["--model", "tiny", "--out", str(out), "--turns", "3", "--system", "100", "--user",
                                    "20", "--reply", "4", "--side", "10", "--side_reply", "2", "--max_ctx", "256",
                                    "--impl", "reference"])
    res = json.loads(out.read_text())
    assert res["device"] and res["jax"] and res["date"] and res["command"].startswith("python scripts/prefix_cache_bench.py --model tiny")
    off, on = res["without_cache"], res["with_cache"]
    assert [(r["turn"], r["request"]) for r in on] == [(t, k) for t in (1, 2, 3) for k in ("main", "side")]
    assert all(r["prefilled"] == r["prompt"] and r["ttft_s"] > 0 for r in off)
    assert [r["prompt"] for r in off] == [r["prompt"] for r in on] == [120, 110, 144, 110, 168, 110]
    assert [r["prefilled"] for r in on] == [120, 10, 21, 10, 21, 10] and all(r["same_reply"] for r in on)
    # each request adds its prompt's end and the end of the reply before it (the first: the system prompt's end)
    assert [r["cache_snapshots"] for r in on] == [2, 4, 6, 8, 10, 12] and all(r["cache_snapshots"] == 0 for r in off)
    assert all(0 < a["cache_bytes"] < b["cache_bytes"] <= 4 * 2**30 for a, b in zip(on, on[1:]))
    assert (tmp_path / "pc.txt").read_text() in capsys.readouterr().out


def test_bench_summary_of_long_contexts_alone():
    """`--sections long` runs no AR section: its table has the run's line and the contexts' steps, no step table."""
    import bench

    res = dict(device="GPU", jax="0", date="d", copy_rate=2e12, read_rate=3.5e12, model="27b",
               models=dict(step_weight_bytes=1.6e10),
               long=[dict(context=32768, budget=8, ar_step_ms=20.0, ddtree_step_ms=30.0, ddtree_over_ar=1.5,
                          memory=dict(peak_bytes_in_use=2**31))])
    lines = bench.summary(res).splitlines()
    assert lines == ["GPU jax 0 d; copy 2000 GB/s; read 3500 GB/s; model 27b (16.00 GB streamed per step)",
                     "context 32768: AR 20.00 ms, DDTree-8 30.00 ms (1.50 x), peak 2.0 GiB"]


def test_bench_resolves_the_configuration_generate_resolves():
    """With no flags, scripts/bench.py runs what `generate` runs on this machine: the same EngineConfig and KernelConfig
    from the same resolution (dflash_jax/defaults.py), its flags meaning what generate's mean."""
    from absl import flags

    import bench
    from benchlib import engine_settings
    from dflash_jax import generate

    fv = flags.FlagValues()
    generate.define_flags(fv)
    fv(["generate", "--jit_cache="])  # bench keeps no compilation cache unless asked (nor kept programs in one)
    assert engine_settings(bench.parse_args(["--out", "x.json"])) == generate.resolve_flags(fv, max_ctx=4096)
    fv.unparse_flags()
    fv(["generate", "--jit_cache=/tmp/jit"])
    assert engine_settings(bench.parse_args(["--out", "x.json", "--jit_cache", "/tmp/jit"])) == generate.resolve_flags(
        fv, max_ctx=4096)
    fv.unparse_flags()
    for flagged in (["--budget", "5", "--topk", "3", "--chain_seed", "--kv_type", "bf16", "--nomgpu"],
                    ["--budget", "30", "--nochain_seed", "--kv_type", "f32"],
                    ["--kv_type_k", "q8_0", "--kv_type_v", "f16", "--draft_ctx", "512"]):
        fv(["generate", "--jit_cache=", *flagged])
        assert engine_settings(bench.parse_args(["--out", "x.json", *flagged])) == generate.resolve_flags(
            fv, max_ctx=4096)
        fv.unparse_flags()
    assert bench.parse_args(["--out", "x.json", "--no-mgpu"]).mgpu is False  # argparse's spelling too
    assert bench.parse_args(["--out", "x.json"]).allocator is None  # the environment's (generate's default)
    assert bench.parse_args(["--out", "x.json", "--allocator", "cuda_async"]).allocator == "cuda_async"
    assert bench.parse_args(["--out", "x.json", "--no-compile_ahead"]).compile_ahead is False


def test_bench_kernels_tree_attention_at_a_context_and_splits_asked_for():
    """bench_kernels' tree attention at a context and a prefix split asked for (`--contexts`, `--attn_splits`), the
    kernel in interpret mode: a row for the defaults, one for the split and XLA's, each kernel row within the
    kernel's bf16 rounding of the float32 reference."""
    import bench_kernels

    rows = bench_kernels.bench_tree_attention(1e12, False, contexts=(40,), splits=(2,), interpret=True)
    assert [(r["kernel"], r["context"], r.get("splits")) for r in rows] == [
        ("tree_attention", 40, None), ("tree_attention", 40, 2), ("xla_tree_attention", 40, None)]
    assert all(r["rel_err"] < 5e-3 and r["us"] > 0 for r in rows[:2])


def test_bench_kernels_tree_attention_times_only_the_kernels_asked_for():
    """`--attn_kernels` and `--attn_tokens`: the AR step's one token on XLA's reference alone, then the Triton kernel
    alone (in interpret mode); an unknown kernel is refused."""
    import bench_kernels

    rows = bench_kernels.bench_tree_attention(1e12, False, n=1, contexts=(40,), interpret=True, kernels=("xla",))
    assert [(r["kernel"], r["n"]) for r in rows] == [("xla_tree_attention", 1)]
    rows = bench_kernels.bench_tree_attention(1e12, False, n=1, contexts=(40,), interpret=True, kernels=("triton",))
    assert [(r["kernel"], r["n"]) for r in rows] == [("tree_attention", 1)] and rows[0]["rel_err"] < 5e-3
    with pytest.raises(ValueError, match="tree attention kernels"):
        bench_kernels.bench_tree_attention(1e12, False, contexts=(40,), interpret=True, kernels=("cudnn",))


def test_bench_kernels_qmatmul_section_on_a_small_matrix(capsys):
    """bench_kernels' qmatmul section on one small matrix, the kernels in interpret mode: rows for the default tiles,
    a variant at one M only and XLA, and the table; a CPU trace has no GPU kernel time, so none is given."""
    import bench_kernels

    shapes = [("small", "Q4_K", 40, 512)]
    rows = bench_kernels.bench_qmatmul([1, 3], 1e10, sweep=False, extra=[dict(block_n=32), dict(m=1, block_n=16)],
                                       shapes=shapes, min_bytes=1, interpret=True)
    assert [(r["kernel"], r["m"], r.get("block_n")) for r in rows] == [
        ("qmatmul", 1, None), ("qmatmul", 1, 32), ("qmatmul", 1, 16), ("xla_dequant_dot", 1, None),
        ("qmatmul", 3, None), ("qmatmul", 3, 32), ("xla_dequant_dot", 3, None)]
    assert all(r["us"] > 0 and r["ratio"] == pytest.approx(r["gguf_bytes"] / r["us"] * 1e6 / 1e10) for r in rows)
    # each kernel against qmatmul's reference of its route (one token: x in int8; three: f16x2 tiles)
    assert all(r["rel_err"] < 1e-5 for r in rows if r["kernel"] == "qmatmul")
    assert not any("kernel_us" in r for r in rows)
    table = bench_kernels.qmatmul_table(rows, [1, 3], shapes)
    assert "small        Q4_K      40    512" in table and "M=3" in table
    assert "small" in capsys.readouterr().out  # each row printed as it is timed


def test_bench_kernels_delta_rule_tiles_on_small_heads(capsys):
    """bench_kernels' delta-rule tile sweep on small heads in interpret mode: for one token's and a 5-node tree's
    verify and commit, a row for the defaults (equal to itself) and one per tile, each with its bitwise agreement with
    the defaults; a CPU trace has no GPU kernel time."""
    import bench_kernels

    rows = bench_kernels.bench_gdn_tiles(n=5, layers=2, heads=2, dims=(16, 32), block_vs=(16, 64), warps=(4,),
                                         interpret=True)
    assert [(r["kernel"], r["n"], r["tiles"]) for r in rows] == [
        (name, n, tiles) for name, n in (("gdn verify tiles", 1), ("gdn verify tiles", 5), ("gdn commit tiles", 1),
                                         ("gdn commit tiles", 5))
        for tiles in ("default", dict(block_v=16, num_warps=4))]  # 64 columns exceed dv = 32: not run
    assert all(r["us"] > 0 and 0 <= r["equal"] <= 1 and "kernel_us" not in r for r in rows)
    assert all(r["equal"] == 1 and r["max_diff"] == 0 for r in rows if r["tiles"] == "default")
    # the commit's products are over the path, which no tile splits: every tile gives its bits on the CPU too
    assert all(r["equal"] == 1 for r in rows if r["kernel"] == "gdn commit tiles")
    assert "gdn commit N= 5" in capsys.readouterr().out


def test_bench_kernels_shard_shapes_follow_the_split():
    """`--shard N`: each 27B matrix as shard 0 of N holds it, 1/N of its weights; the row-split ones (gate/up, the
    head) keep their columns, the all-reduced ones (ffn_down, o_proj, out_proj) their rows."""
    import bench_kernels

    for n in (2, 4):
        shards = bench_kernels.shard_shapes(bench_kernels.SHAPES, n)
        assert [rows * k * n for _, _, rows, k in shards] == [rows * k for _, _, rows, k in bench_kernels.SHAPES]
        by_name = {(name, fmt): (rows, k) for name, fmt, rows, k in shards}
        assert by_name["ffn_gate/up", "Q4_K"] == (17408 // n, 5120) and by_name["output", "Q6_K"] == (248320 // n, 5120)
        assert by_name["ffn_down", "Q6_K"] == (5120, 17408 // n) and by_name["attn_output", "Q4_K"] == (5120, 6144 // n)


def test_budget_sweep_on_the_fixture_pair(tiny_gguf_path, tmp_path):
    import budget_sweep

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(x):\n"}) + "\n")
    out = tmp_path / "sweep.json"
    run_script(budget_sweep, ["--target", str(tiny_gguf_path), "--draft", str(TINY / "draft-full"), "--sets",
                              str(prompts), "--n_gen", "10", "--budgets", "2,5", "--topks", "2", "--chain_seeds",
                              "on", "--iters", "1", "--impl", "reference", "--out", str(out)])
    report = json.loads(out.read_text())
    rows = report["results"]
    assert [(r["budget"], r["chain_seed"]) for r in rows] == [(2, True), (5, True)]
    assert all(r["same_as_ar"] == 1 and r["al"] >= 1.0 and r["step_ms"] > 0 for r in rows)
    assert set(report["verify_ms"]) == {"3", "6"} and report["verify_fit"]["n"]["b_ms"] != 0
    assert (tmp_path / "sweep.png").stat().st_size > 10_000
    table = (tmp_path / "sweep.txt").read_text()
    assert "verify(N) =" in table and len(table.splitlines()) == 2 + len(rows) + 1


def test_cpu_step_profile_finds_a_product_and_its_weight(tmp_path):
    """The trace reading behind scripts/cpu_step_profile.py on a jitted product of a named weight: the op events
    of XLA:CPU's threads are found and the product's instruction names the weight it reads."""
    import jax
    import jax.numpy as jnp
    import cpu_step_profile as csp
    from dflash_jax.engine.prefill import split_weights
    from dflash_jax.models.layers import MLP

    _, params = split_weights(MLP(*(jnp.ones(shape, jnp.float32) for shape in ((64, 32), (64, 32), (32, 64)))))
    f = jax.jit(lambda tweights, x: jnp.einsum("mi,oi->mo", x, tweights["up_proj"]["weight"]))
    x = jnp.ones((3, 32), jnp.float32)
    f(params, x).block_until_ready()
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(3):
            f(params, x).block_until_ready()
    ops = csp.op_seconds(str(tmp_path))
    info = csp.instructions(f.lower(params, x).compile().as_text())
    products = [(name, info[name]) for name in ops if csp.PRODUCT.match(name) and name in info]
    assert products and all(s > 0 for s in ops.values())
    assert [dims_weight for _, dims_weight in products] == [([3, 64], "t:up_proj.weight")]


def test_gpu_step_profile_counts_busy_time_as_the_union_of_kernels():
    from gpu_step_profile import summarize, table

    # two steps: kernels a (0-4 ms), b (2-6, overlapping a), idle 6-10, a again (10-12)
    ms = 1_000_000
    events = [("a", 0, 4 * ms), ("b", 2 * ms, 4 * ms), ("a", 10 * ms, 2 * ms)]
    r = summarize(events, steps=2)
    assert r["span_ms"] == 6 and r["busy_ms"] == 4 and r["idle_ms"] == 2 and r["launches"] == 1.5
    assert r["kernels"][0] == {"name": "a", "category": "other", "ms": 3.0, "launches": 1.0}
    assert summarize([], steps=8) == {"steps": 8, "kernels": []}
    text = table({"device": "d", "jax": "j", "date": "t", "model": "m", "modes": {"ar": r, "ddtree": summarize([], 1)}})
    assert "ar: ms a step: span 6.00, busy 4.00, idle 2.00 (33 %), collectives 0.00, 1.5 launches; 2 steps traced" \
        in text
    assert "ddtree: no GPU kernel events in the trace" in text
    # the span ends at the last kernel to end, not at the end of the last to start
    assert summarize([("long", 0, 10 * ms), ("short", ms, ms)], steps=1)["span_ms"] == 10


def test_gpu_step_profile_groups_kernels_by_the_jax_op_that_made_them():
    """by_op: XLA's fusions by the op_name of their instruction in the optimized HLO (a trace's `_170` is the HLO's
    `.170`, nested jit names folded, ROOT lines too), two fusions of one op summed, Pallas kernels by name, the
    products in one group, a name the HLO lacks kept; longest first."""
    from gpu_step_profile import by_op

    hlo = """
  %loop_add_fusion.170 = f32[1,5120]{1,0} fusion(%a, %b), kind=kLoop, calls=%fused_add.170, metadata={op_name="jit(_step)/add" stack_frame_id=271}
  %loop_add_fusion.43 = f32[1,16]{1,0} fusion(%c), kind=kLoop, calls=%fused_add.43, metadata={op_name="jit(_step)/add"}
  ROOT %loop_pad_fusion.87 = f16[8,6144]{1,0} fusion(%d), kind=kLoop, metadata={op_name="jit(_step)/jit(qmatmul)/jit(qmatmul_many)/scatter"}
"""  # noqa: E501 (HLO lines as XLA writes them)
    kernels = [{"name": "qmatmul_mgpu_q4_k_mosaic_gpu_kernel", "category": "quantized products", "ms": 4.0,
                "launches": 224.0},
               {"name": "qmatmul_mgpu_q6_k_mosaic_gpu_kernel", "category": "quantized products", "ms": 1.5,
                "launches": 65.0},
               {"name": "gdn_blocks", "category": "delta rule", "ms": 0.9, "launches": 48.0},
               {"name": "loop_add_fusion_170", "category": "other", "ms": 0.2, "launches": 123.0},
               {"name": "loop_add_fusion_43", "category": "other", "ms": 0.05, "launches": 44.0},
               {"name": "loop_pad_fusion_87", "category": "layout", "ms": 0.1, "launches": 47.0},
               {"name": "MemcpyD2H", "category": "layout", "ms": 0.01, "launches": 3.0}]
    got = [(g["op"], round(g["ms"], 6), g["launches"], g["kernels"]) for g in by_op(kernels, hlo)]
    assert got == [("quantized products", 5.5, 289.0, 2), ("gdn_blocks", 0.9, 48.0, 1), ("add", 0.25, 167.0, 2),
                   ("qmatmul/qmatmul_many/scatter", 0.1, 47.0, 1), ("MemcpyD2H", 0.01, 3.0, 1)]


def test_gpu_step_profile_sorts_every_kernel_into_a_category():
    """The kernel names of an H200's DDTree-22 step (gpu_step_profile_h200_exact_nov27.txt) and a 2-GPU step's
    collectives, each in its category; the categories' sums and every name (none cut) in the summary and its table."""
    from gpu_step_profile import CATEGORIES, category, profile_lines, summarize

    names = {"qmatmul_mgpu_q4_k_mosaic_gpu_kernel": "quantized products", "gemv_int8_q6_k": "quantized products",
             "qmatmul_q4_k": "quantized products", "gemv_q5_k": "quantized products",
             "gdn_blocks": "delta rule", "gdn_commit": "delta rule", "tree_attention__1": "attention",
             "tree_conv": "conv", "ncclDevKernel_AllReduce_Sum_bf16_RING_LL": "collectives",
             "psum_add_fusion": "collectives", "all-gather-start": "collectives", "reduce-scatter.3": "collectives",
             "gemm_fusion_dot_59": "XLA GEMMs", "nvjet_hsh_64x8_64x16_2x1_v_bz_splitK_TNT": "XLA GEMMs",
             "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64": "XLA GEMMs",
             "cutlass_80_tensorop_s16816gemm_bf16_64x64_64x4_tn_align8": "XLA GEMMs",
             "input_transpose_fusion_126": "layout", "loop_pad_fusion_340": "layout", "wrapped_concatenate": "layout",
             "loop_dynamic_update_slice_fusion": "layout", "MemcpyD2D": "layout", "copy_fusion_2": "layout",
             "triton_softmax_590": "other", "loop_add_fusion_63": "other", "input_reduce_fusion_34": "other",
             "fusion_3002": "other",
             "void stream_executor::cuda::Run<8ul, float, unsigned int>(float*, int, f": "other"}
    assert {n: category(n) for n in names} == names
    us = 1_000  # ns
    # one event of each name, name i lasting (i + 1) us, one after another from t = 0; then a gap of 100 us
    events = [(n, sum(range(1, i + 1)) * us, (i + 1) * us) for i, n in enumerate(names)]
    end = sum(range(1, len(names) + 1)) * us
    events.append(("gdn_blocks", end + 100 * us, 50 * us))  # a second launch of the delta rule, after the gap
    r = summarize(events, steps=2)
    assert r["launches"] == (len(names) + 1) / 2 and r["span_ms"] == (end + 150 * us) / 1e6 / 2
    assert r["busy_ms"] == pytest.approx((end + 50 * us) / 1e6 / 2) and r["idle_ms"] == pytest.approx(100 * us / 2e6)
    assert len(r["kernels"]) == len(names) and list(r["categories"]) == [name for name, _ in CATEGORIES]
    expect = {}
    for i, n in enumerate(names):
        expect[names[n]] = expect.get(names[n], 0) + (i + 1) * us + (50 * us if n == "gdn_blocks" else 0)
    assert {c: v["ms"] for c, v in r["categories"].items()} == pytest.approx({c: expect[c] / 2e6 for c in expect})
    assert r["categories"]["delta rule"]["launches"] == 1.5 and r["categories"]["collectives"]["launches"] == 2
    assert r["collective_ms"] == r["categories"]["collectives"]["ms"]
    longest = r["kernels"][0]  # the 5th name (5 us) and its second launch
    assert longest["name"] == "gdn_blocks" and longest["ms"] == pytest.approx((5 + 50) * us / 2e6)
    lines = profile_lines("ddtree-22 /device:GPU:0", r, top=5)
    assert lines[0].startswith("ddtree-22 /device:GPU:0: ms a step:")
    assert "the 5 longest of 27 kernel names" in lines[-6]
    assert lines[-5].split()[0] == "gdn_blocks" and len(lines) == 1 + 1 + len(CATEGORIES) + 1 + 1 + 5


def test_memory_accounting_counts_buffers_on_the_device():
    """benchlib.memory_accounting against known arrays: int4 two to a byte, an array named twice counted once in the
    live total, the arrays of no named tree listed by size."""
    import jax
    import jax.numpy as jnp
    from benchlib import memory_accounting, memory_line

    q = jnp.zeros((64, 32), jnp.int4)  # 1024 bytes packed (jax's nbytes says 2048)
    scales = jnp.ones((64, 3), jnp.float32)  # 768
    state = {"k": jnp.ones((5, 7, 9), jnp.bfloat16), "length": jnp.int32(3)}  # 630 + 4
    loose = jnp.ones((123, 457), jnp.float32)  # 224,844 bytes of no named tree
    m = memory_accounting({"target": {"q": q, "s": scales, "none": None}, "state": state, "again": [q]},
                          largest=10 ** 6)
    assert m["named"] == {"target": 1024 + 768, "state": 634, "again": 1024}
    assert {"shape": [123, 457], "dtype": "float32", "bytes": 224_844} in m["other_largest"]
    assert m["other_bytes"] == sum(o["bytes"] for o in m["other_largest"])
    assert m["live_bytes"] == 1024 + 768 + 634 + m["other_bytes"] and m["live_buffers"] == len(m["other_largest"]) + 4
    before = m["other_bytes"]
    loose.delete()
    assert memory_accounting({"target": [q, scales]}, jax.devices()[0])["other_bytes"] == before - 224_844 + 634
    assert memory_line("now", m).startswith("memory now: live arrays 0.00 GB in ")


def test_qmatmul_sass_reads_the_kernel_ir_and_its_loops():
    """The parts of scripts/qmatmul_sass.py that need no Triton compiler: the kernel's Triton IR with the launch
    settings qmatmul asks for (read back from the lowered HLO), and the K loop found in a SASS listing by its
    backward branch."""
    import qmatmul_sass
    from pallas_kernels import gemv_int8, qmatmul_triton

    ir_text, warps, stages = qmatmul_sass.triton_ir("Q4_K", 64, 1024, 1, {})  # one token: the int8 GEMV
    assert '"tt.load"' in ir_text and '"scf.for"' in ir_text and (warps, stages) == (gemv_int8.TILES[2], 3)
    assert qmatmul_sass.kernel_tiles("Q4_K", 64, 1, {}) == ("gemv8", *gemv_int8.TILES[:2])
    _, warps, stages = qmatmul_sass.triton_ir("Q5_K", 64, 1024, 23, {"num_stages": 2})  # the tensor-core kernel
    assert (warps, stages) == (qmatmul_triton.default_tiles(32, 64, "Q5_K")[2], 2)
    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0020*/                   FFMA R8, R4, R5, R8 ;
        /*0028*/                   IMAD.MOV.U32 R9, RZ, RZ, R8 ;
        /*002c*/                   IMAD.WIDE R2, R9, 0x4, R2 ;
        /*0030*/               @P0 BRA 0x10 ;
        /*0040*/                   EXIT ;
        /*0050*/                   BRA 0x50;
    """
    assert qmatmul_sass.loops(sass) == [["LDG", "FFMA", "IMAD.MOV", "IMAD", "BRA"]]  # a move kept apart


def test_attn_smem_lowers_tree_attention_with_its_default_stages():
    """scripts/attn_smem.py's Triton IR of tree attention without a GPU: the 27B's bfloat16 caches launch with three
    pipeline stages, its float32 ones with two (three asked more shared memory than an SM has), its q8_0 ones with
    three."""
    import attn_smem

    for kind, expected in (("bf16", 3), ("f32", 2), ("q8_0", 3)):
        ir_text, warps, stages = attn_smem.triton_ir(24, 4, 256, kind)
        assert '"tt.dot"' in ir_text and (warps, stages) == (4, expected), (kind, warps, stages)


def test_mgpu_ptx_counts_the_kernels_instructions(capsys):
    """scripts/mgpu_ptx.py without a GPU: opcodes counted per statement (predicated, labelled, inside inline
    assembly, several on a line; directives and comments not), and its report on the saved dump of the kernel."""
    import mgpu_ptx

    ptx = """
    .reg .b32 %r<4>;  // a directive
    $L__BB0_1:
    @%p1 bra.uni $L__BB0_2;
    // begin inline asm
    {
    .reg .b32 u, k;
    lop3.b32 u, %r1, 0x000f000f, 0x64086408, 0x6a;
    sub.f16x2 u, u, k;
    }
    // end inline asm
    { .reg .pred p; setp.ne.b32 p, 1, 0; wgmma.mma_async.sync.aligned.m64n24k16.f32.f16.f16 {%r1}, {%r2}, %rd1, p; }
    mov.b32 %r3, {%rs1, %rs1};
    """
    counts = mgpu_ptx.opcode_counts(ptx)
    assert counts == {"bra.uni": 1, "lop3.b32": 1, "sub.f16x2": 1, "setp.ne.b32": 1, "mov.b32": 1,
                      "wgmma.mma_async.sync.aligned.m64n24k16.f32.f16.f16": 1}
    saved = ROOT / "scripts/results/ptx/qmatmul_mgpu_wgmma_m23_h200.ptx"
    mgpu_ptx.main(["--read", str(saved)])
    out = capsys.readouterr().out
    # per super-block step: 8 sub-blocks of 2 wgmma and 8 lop3/sub/fma; no shuffle or prmt left in the conversion
    for line in ("Used 64 registers", "wgmma.mma_async              16", "lop3                         64",
                 "fma.rn.f16x2                 64", "prmt                         0"):
        assert line in out, line
    sass = """
        /*0000*/                   S2R R21, SR_TID.X ;
        /*0010*/                   WARPGROUP.ARRIVE ;
        /*0020*/                   HFMA2 R52, R52, R58.H0_H0, R37.H1_H1 ;
        /*0030*/                   HGMMA.64x24x16.F32 R24, R48, gdesc[UR24], R24 ;
        /*0040*/              @P0 BRA 0x10 ;
        /*0050*/                   EXIT ;
    """
    assert mgpu_ptx.sass_report(sass, "a note") == ("SASS: 6 instructions; the pipeline loop 4 (a note)\n"
                                                    "loop: WARPGROUP 1, HFMA2 1, HGMMA 1, BRA 1")


@pytest.mark.gpu
def test_mgpu_ptx_assembles_the_saved_dump(capsys):
    """scripts/mgpu_ptx.py --sass on the saved PTX of the shipped kernel, assembled by pip triton's ptxas: its loop
    (one super-block step) is 512 SASS instructions with no byte permute left (the scale broadcasts fold into the
    fma's operand selectors). With the GPU tests: the ptxas is pip's triton package's, which the GPU machines have
    and the CPU install does not (a large download for one test)."""
    import mgpu_ptx

    saved = ROOT / "scripts/results/ptx/qmatmul_mgpu_scale_words_m23_h100.ptx"
    mgpu_ptx.main(["--read", str(saved), "--sass"])
    out = capsys.readouterr().out
    assert "the pipeline loop 512" in out and "PRMT" not in out.split("loop: ")[-1]


def test_weight_bytes_by_format_of_the_27b():
    """The 27B's Q4_K_M matrices a step streams, by format (the figures the README gives): 11.36 GB of Q4_K and
    4.45 GB of Q6_K (the output head and the "more bits" ffn_down and attn_qkv), 15.81 GB in all."""
    import bench_kernels

    by_format = bench_kernels.weight_bytes_by_format()
    assert sorted(by_format) == ["Q4_K", "Q6_K"] and bench_kernels.ar_weight_bytes() == sum(by_format.values())
    assert round(by_format["Q4_K"] / 1e9, 2) == 11.36 and round(by_format["Q6_K"] / 1e9, 2) == 4.45


def test_compare_kernel_runs_pairs_products_by_name_and_options(tmp_path, capsys):
    import compare_kernel_runs

    def run(device, copy, rows):
        return dict(device=device, jax="0.11.2", date="2026-11-27", copy_rate=copy, results=rows)

    def row(m, kernel_us, **opts):
        return dict(kernel="qmatmul", matrix="ffn_down", fmt="Q4_K", n=64, k=256, m=m, us=3 * kernel_us,
                    kernel_us=kernel_us, kernel_ratio=0.5, rel_err=1e-3, **opts)

    a = run("A", 2e12, [row(1, 10.0, tile="default"), row(1, 20.0, gemv=False), row(23, 40.0),
                        dict(kernel="gdn verify", us=5.0)])  # no kernel time: left out
    b = run("B", 4e12, [row(23, 30.0), row(1, 8.0, tile="default"), row(1, 25.0, gemv=False), row(32, 1.0)])
    rows = compare_kernel_runs.compare(a, b)
    assert [(r["m"], r.get("gemv"), r["a_us"], r["b_us"]) for r in rows] == [
        (1, None, 10.0, 8.0), (1, False, 20.0, 25.0), (23, None, 40.0, 30.0)]
    assert [r["b_over_a"] for r in rows] == pytest.approx([0.8, 1.25, 0.75])
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    run_script(compare_kernel_runs, [str(pa), str(pb), "--out", str(tmp_path / "c.txt")])
    text = (tmp_path / "c.txt").read_text()
    assert "copy rate A / B = 0.50" in text and "qmatmul            0.80 over 3 products (0.75-1.25)" in text
    assert text in capsys.readouterr().out


def test_bench_kernels_kernel_times_by_name():
    import bench_kernels

    r = bench_kernels.kernel_times({"tree_attention_1": 4e-6, "loop_fusion": 2e-6}, per=2)
    assert r["kernel_us"] == pytest.approx(3.0)
    assert r["kernels_us"] == pytest.approx({"tree_attention_1": 2.0, "loop_fusion": 1.0})
    assert bench_kernels._kernel_note(r, "tree_attention") == "  kernels      3.0 us (tree_attention      2.0 us)"
    assert bench_kernels.kernel_times({}) == {} and bench_kernels._kernel_note({}, "gdn") == ""  # a CPU trace


@pytest.mark.parametrize("kind", ["q8_0", "rq3_0", "bf16"])
def test_fill_random_takes_a_page_at_a_time(kind):
    """`--long`'s random cache (bench.fill_random) is made a page at a time, in place: its temporaries are the same
    for a cache of 20,000 or 80,000 slots and a fraction of the float32 copy of the smaller one (the whole cache in
    float32 would be 32 GiB for the 27B at 256K); slots 0..pages * page - 1 of each layer hold random rows of scale
    0.5 in the cache's type, the rest stay as they were."""
    import bench
    import jax
    import numpy as np

    from dflash_jax import kv_quant as kvq

    def temp(slots):
        cache = kvq.empty(kind, (2, slots, 1, 32))
        return bench.fill_random.lower(cache, jax.random.key(0), pages=3, page=1000).compile() \
            .memory_analysis().temp_size_in_bytes

    small = temp(20_000)
    assert small == temp(80_000) and small < 2 * 20_000 * 32 * 4 / 4
    cache = kvq.empty(kind, (2, 20_000, 1, 32))
    out = np.asarray(kvq.readable(bench.fill_random(cache, jax.random.key(0), pages=3, page=1000)), np.float32)
    assert all(x.is_deleted() for x in jax.tree.leaves(cache))  # donated: filled in place
    assert abs(out[:, :3000].std() - 0.5) < 0.02 and not np.any(out[:, 3000:])
    assert not np.allclose(out[0, :3000], out[1, :3000])


def test_bench_long_contexts_in_one_cache_compile_each_step_once(tmp_path):
    """`--long_slots`: every context in one cache of that many slots, so the AR and DDTree steps compile once each
    for both contexts (the random fill leaves the state committed as a step leaves it: a half-committed state
    compiled the step again on its second call); too few slots for the longest context are refused. With
    --no-long_phases the rows have no phases, and a CPU's budget."""
    import bench

    out = tmp_path / "long.json"
    run_script(bench, ["--model", "tiny", "--out", str(out), "--sections", "long", "--long", "300,600",
                       "--long_slots", "1200", "--prompt_len", "16", "--steps", "2", "--impl", "reference",
                       "--no-long_phases"])
    res = json.loads(out.read_text())
    assert [(r["context"], r["slots"]) for r in res["long"]] == [(300, 1200), (600, 1200)]
    compiles = {c["name"]: c["compiles"] for c in res["compile"]}
    assert compiles["jit(_step)"] == 2 and compiles["jit(chunk)"] == 2
    # no phases timed, and a CPU's budget
    assert all(r["ddtree_step_ms"] > 0 and r["budget"] == 8 and "phases_ms" not in r for r in res["long"])
    with pytest.raises(SystemExit, match="needs 1112 slots"):
        bench.main(["--model", "tiny", "--out", str(out), "--sections", "long", "--long", "300,600",
                    "--long_slots", "1000"])


def test_bench_long_with_a_block_kv_type(tmp_path):
    """`--sections long` with q4_0 on the tiny pair: AR and DDTree steps over a random cache of 300 tokens."""
    import bench

    out = tmp_path / "long.json"
    run_script(bench, ["--model", "tiny", "--out", str(out), "--sections", "long", "--long", "300", "--max_ctx", "256",
                       "--prompt_len", "16", "--iters", "1", "--steps", "2", "--impl", "reference",
                       "--kv_type", "q4_0"])
    res = json.loads(out.read_text())
    row, = res["long"]
    assert res["engine"]["kv_type"] == "q4_0" and row["context"] == 300
    for mode in ("ar", "ddtree"):  # each state's buffers on the device, as its tree counts them (q4_0's blocks too)
        named = row[f"{mode}_accounting"]["named"]
        assert named["state"] == row[f"{mode}_state_bytes"] and named["target"] == res["models"]["target_device_bytes"]
    assert row["ar_step_ms"] > 0 and row["ddtree_step_ms"] > 0 and row["phases_ms"]["verify"] > 0


def test_host_dispatch_times_the_steps_of_the_tiny_pair(tmp_path, capsys):
    """Each step count's host and device times, and the decode loop over exactly the steps asked for."""
    import host_dispatch

    out = tmp_path / "hd.json"
    host_dispatch.main(["--out", str(out), "--model", "tiny", "--modes", "ar", "--loop_steps", "3",
                        "--max_ctx", "1024"])
    res = json.loads(out.read_text())
    assert res["devices"] == 1 and "ddtree" not in res
    ar = res["ar"]
    assert [r["steps"] for r in ar["queued"]] == list(host_dispatch.CALLS) and ar["loop_steps"] == 3
    assert all(0 < r["dispatch_ms"] <= r["total_ms"] for r in ar["queued"]) and ar["loop_ms"] > 0
    assert f"ar: {ar['arguments']} argument arrays; 40 steps queued" in capsys.readouterr().out


def test_host_dispatch_refuses_bad_flags(tmp_path):
    import host_dispatch

    out = tmp_path / "hd.json"
    with pytest.raises(SystemExit, match="--modes chain"):
        host_dispatch.main(["--out", str(out), "--model", "tiny", "--modes", "chain"])
    with pytest.raises(SystemExit, match="--loop_steps 1"):
        host_dispatch.main(["--out", str(out), "--model", "tiny", "--loop_steps", "1"])
    with pytest.raises(SystemExit, match="--max_ctx 600: ddtree needs"):
        host_dispatch.main(["--out", str(out), "--model", "tiny", "--modes", "ddtree", "--max_ctx", "600"])
    assert not out.exists()


def test_host_dispatch_over_two_processes(tmp_path):
    """One process per device (two processes of one CPU device each, joined at a coordinator): the step runs over
    both, process 0 reports and writes the file, process 1 neither."""
    from test_multihost import finish, free_port

    port = free_port()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
    outs = [tmp_path / f"hd{i}.json" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, str(ROOT / "scripts" / "host_dispatch.py"), "--out", str(outs[i]),
                               "--model", "tiny", "--modes", "ar", "--loop_steps", "2", "--max_ctx", "1024",
                               "--devices", "all", "--coordinator", f"localhost:{port}", "--num_processes", "2",
                               "--process_id", str(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for i in range(2)]
    (code0, out0, err0), (code1, out1, err1) = finish(procs)
    assert code0 == 0 and code1 == 0, (err0[-3000:], err1[-3000:])
    res = json.loads(outs[0].read_text())
    assert res["devices"] == 2 and res["processes"] == 2 and res["ar"]["loop_steps"] == 2
    assert "ar: " in out0 and "ar: " not in out1 and not outs[1].exists()
