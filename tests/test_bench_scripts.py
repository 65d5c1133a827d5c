"""scripts/bench.py (tiny synthetic pair) and scripts/budget_sweep.py (fixture pair) run as documented and write what
they say; the verify-cost fits recover known lines."""

import json
import sys

import pytest

from conftest import ROOT, TINY

sys.path.insert(0, str(ROOT / "scripts"))


def run_script(module, argv):
    saved = sys.argv
    sys.argv = [module.__name__ + ".py", *argv]
    try:
        module.main()
    finally:
        sys.argv = saved


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

    out = tmp_path / "bench.json"
    run_script(bench, ["--model", "tiny", "--out", str(out), "--sections", "ar,forced,steps", "--budgets", "4",
                       "--no-chain", "--als", "3", "--forced_budget", "4", "--max_ctx", "256", "--prompt_len", "16",
                       "--n_gen", "32", "--iters", "1", "--impl", "reference"])
    res = json.loads(out.read_text())
    assert res["ar"]["tokens_per_s"] > 0 and 0 < res["ar"]["roofline_fraction"]
    forced, = res["forced"]
    assert forced["follows_sequence"] and abs(forced["accept_length"] - 3) <= 0.15 * 3  # calibrated to the goal
    step, = res["steps"]
    assert step["mode"] == "ddtree" and step["budget"] == 4 and step["phases_ms"]["verify_tokens"] == 5
    assert all(step["phases_ms"][k] > 0 for k in ("draft", "tree", "verify", "accept_commit"))
    assert any("_step" in r["name"] for r in res["compile"])
    printed = capsys.readouterr().out
    assert "forced DDTree-4: AL" in printed and " ddtree      4 " in printed
    merged = tmp_path / "merged.json"
    run_script(bench, ["--out", str(merged), "--merge", f"{out}:steps+forced"])
    again = json.loads(merged.read_text())
    assert again["steps"] == res["steps"] and again["forced"] == res["forced"] and again["ar"] == res["ar"]
    assert (tmp_path / "merged.txt").read_text().strip() == bench.summary(again).strip()


def test_bench_summary_of_long_contexts_alone():
    """`--sections long` runs no AR section: its table has the run's line and the contexts' steps, no step table."""
    import bench

    res = dict(device="GPU", jax="0", date="d", copy_rate=2e12, model="27b", models=dict(step_weight_bytes=1.6e10),
               long=[dict(context=32768, ar_step_ms=20.0, ddtree_step_ms=30.0, ddtree_over_ar=1.5,
                          memory=dict(peak_bytes_in_use=2**31))])
    lines = bench.summary(res).splitlines()
    assert lines == ["GPU jax 0 d; copy 2000 GB/s; model 27b (16.00 GB streamed per step)",
                     "context 32768: AR 20.00 ms, DDTree-22 30.00 ms (1.50 x), peak 2.0 GiB"]


def test_bench_kernel_switches_last_one_run(tmp_path, monkeypatch):
    """--one_token tensor_cores sends one-token products to the tensor-core kernel, --dequant jnp makes its tiles
    without inline PTX, --gemv_dequant jnp the GEMV's too, --prefetch sets the kernels' loads ahead, --int8_x and
    --int8_mma the int8 kernels, --wgmma the operand order, during the run and only then; with none of them the run
    takes qmatmul's defaults."""
    import bench
    from pallas_kernels import qmatmul as qm

    state = lambda: (qm.qmatmul, dict(qm.PREFETCH), dict(qm.ASM), qm.INT8_X, qm.INT8_MMA, qm.WGMMA)  # noqa: E731
    shipped, seen = state(), []
    monkeypatch.setattr(bench, "run", lambda args: seen.append(state()))
    out = ["--out", str(tmp_path / "x.json")]
    run_script(bench, out + ["--one_token", "tensor_cores"])
    run_script(bench, out + ["--dequant", "jnp", "--gemv_dequant", "jnp", "--prefetch", "gemv=2,mma=1",
                             "--int8_x", "0", "--int8_mma", "1", "--wgmma", "1"])
    run_script(bench, out)
    assert seen[0][0].func is shipped[0] and seen[0][0].keywords == {"gemv": False} and seen[0][1:] == shipped[1:]
    assert seen[1] == (shipped[0], {"gemv": 2, "mma": 1}, {"gemv": False, "mma": False}, 0, 1, 1)
    assert shipped[2:] == ({"gemv": True, "mma": True}, 2, False, False)  # so the switches above changed something
    assert seen[2] == shipped and state() == shipped
    with pytest.raises(SystemExit):
        run_script(bench, out + ["--prefetch", "tensor=1"])


def test_bench_mgpu_switches_last_one_run(tmp_path, monkeypatch):
    """--mgpu 2 --mgpu_formats Q4_K --mgpu_nibbles subnormal --mgpu_cols 64 --mgpu_split_sum tma_add --small_rows 0
    packs Q4_K alone for the Mosaic GPU kernel, in its layout alone and with its nibbles in that form, 64 columns a
    wgmma call, the K splits added by TMA, every quantized matrix on the kernels, during the run, and only then."""
    import bench
    from dflash_jax import kernels
    from pallas_kernels import qmatmul as qm
    from pallas_kernels import qmatmul_mgpu as mg

    state = lambda: (qm.MGPU_LAYOUT, qm.MGPU_FORMATS, mg.NIBBLE, mg.COLS, mg.SPLIT_SUM, kernels.SMALL_ROWS)  # noqa
    shipped, seen = state(), []
    monkeypatch.setattr(bench, "run", lambda args: seen.append(state()))
    run_script(bench, ["--out", str(tmp_path / "x.json"), "--mgpu", "2", "--mgpu_formats", "Q4_K",
                       "--mgpu_nibbles", "subnormal", "--mgpu_cols", "64", "--mgpu_split_sum", "tma_add",
                       "--small_rows", "0"])
    assert seen == [("only", ("Q4_K",), "subnormal", 64, "tma_add", 0)]
    assert state() == shipped == (False, ("Q4_K", "Q6_K"), "magic", 32, "xla", 64)


def test_bench_attention_tiles_last_one_run(tmp_path, monkeypatch):
    """--attn_tiles 32,2 gives the tree-attention kernel 32-row programs and two pipeline stages (the tiles before
    2026-11-27) during the run, and only then."""
    import bench
    from dflash_jax import kernels

    shipped, seen = kernels._tree_attention_kernel, []
    monkeypatch.setattr(bench, "run", lambda args: seen.append(kernels._tree_attention_kernel))
    run_script(bench, ["--out", str(tmp_path / "x.json"), "--attn_tiles", "32,2"])
    assert seen[0].func is shipped and seen[0].keywords == {"block_rows": 32, "num_stages": 2}
    assert kernels._tree_attention_kernel is shipped


def test_ar_variants_set_qmatmul_options_and_restore_them(tmp_path, capsys):
    """scripts/ar_variants.py on the tiny pair: each variant's options are in force for its run only, every round
    runs every variant, the table is printed; unknown keys are refused."""
    import ar_variants
    from pallas_kernels import qmatmul as qm

    shipped = ar_variants.qmatmul_defaults()
    out = tmp_path / "ar.json"
    run_script(ar_variants, ["--out", str(out), "--model", "tiny", "--impl", "reference", "--variants", "shipped",
                             "int8_x=1,gemv_prefetch=2,int8_block_n=16,mma_asm=0", "--rounds", "2", "--n_gen", "4",
                             "--prompt_len", "8", "--max_ctx", "64", "--repeats", "2"])
    assert ar_variants.qmatmul_defaults() == shipped
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["round"]) for r in rows] == [
        ("shipped", 1), ("int8_x=1,gemv_prefetch=2,int8_block_n=16,mma_asm=0", 1), ("shipped", 2),
        ("int8_x=1,gemv_prefetch=2,int8_block_n=16,mma_asm=0", 2)]
    assert (rows[0]["int8_x"], rows[0]["prefetch"], rows[0]["asm"]) == (qm.INT8_X, qm.PREFETCH, qm.ASM)
    assert rows[1]["int8_x"] and rows[1]["prefetch"]["gemv"] == 2 and rows[1]["int8_tiles"][0] == 16
    assert not rows[1]["asm"]["mma"] and all(r["step_ms"] > 0 and r["parts_at"] is None for r in rows)
    assert all(len(r["step_ms_each"]) == 2 and min(r["step_ms_each"]) <= r["step_ms"] for r in rows)
    assert "greedy tokens part at" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown option"):
        ar_variants.options("gemv_tiles=3")


def test_gemv_probe_kernels_match_the_reference():
    """The probe's GEMV variants behind the README's sweep (interpret mode) agree with qmatmul's reference."""
    import qmatmul_gemv_probe

    qmatmul_gemv_probe.check_all()


def test_bench_kernels_qmatmul_section_on_a_small_matrix(tmp_path, monkeypatch, capsys):
    """bench_kernels' qmatmul section end to end on one small matrix, the kernel in interpret mode: rows for the
    default tiles, the tensor cores at M = 1 and XLA, the table; a CPU trace has no GPU kernel time, so none is
    given."""
    import functools

    import bench_kernels
    from pallas_kernels import qmatmul as qm

    monkeypatch.setattr(bench_kernels, "SHAPES", [("small", "Q4_K", 40, 512)])
    monkeypatch.setattr(bench_kernels, "MIN_BYTES", 1)
    monkeypatch.setattr(bench_kernels, "copy_rate", lambda: 1e10)
    monkeypatch.setattr(qm, "qmatmul", functools.partial(qm.qmatmul, interpret=True))
    out = tmp_path / "k.json"
    run_script(bench_kernels, ["--out", str(out), "--kernels", "qmatmul", "--m", "1", "3",
                               "--variants", "prefetch=1", "m=1,block_n=16,prefetch=2"])
    rows = json.loads(out.read_text())["results"]
    assert [(r["kernel"], r["m"], r.get("gemv"), r.get("prefetch"), r.get("block_n")) for r in rows] == [
        ("qmatmul", 1, None, None, None), ("qmatmul", 1, False, None, None), ("qmatmul", 1, None, 1, None),
        ("qmatmul", 1, None, 2, 16), ("xla_dequant_dot", 1, None, None, None), ("qmatmul", 3, None, None, None),
        ("qmatmul", 3, None, 1, None), ("xla_dequant_dot", 3, None, None, None)]
    assert all(r["us"] > 0 and r["ratio"] == pytest.approx(r["gguf_bytes"] / r["us"] * 1e6 / 1e10) for r in rows)
    # one token takes the int8-activation GEMV (x rounded to int8: within 1e-2 of the float product, as
    # tests/test_gemv_int8.py bounds it), the tensor cores bf16 tiles
    assert all(r["rel_err"] < (1e-2 if r["m"] == 1 and r.get("gemv") is not False else 4e-3)
               for r in rows if r["kernel"] == "qmatmul")
    assert not any("kernel_us" in r for r in rows)
    printed = capsys.readouterr().out
    assert "small        Q4_K      40    512" in printed and "M=1 TC" in printed


def test_rows_probe_kernels_match_the_reference():
    """The 16-32 row probe's variants behind the README's findings (interpret mode) agree with qmatmul's reference."""
    import qmatmul_rows_probe

    qmatmul_rows_probe.check()


def test_mgpu_probe_reference_is_q4k_from_its_fields():
    """scripts/mgpu_probe.py's `codes` layout (quants stored as q - 8, 6-bit scales and mins, d and dmin per
    256 columns) multiplies as Q4_K's d sc q - dmin m, computed here from the fields directly."""
    import jax
    import numpy as np

    import mgpu_probe

    n, k = 64, 512
    w, x, (codes, dd) = mgpu_probe.inputs(jax.random.key(3), n, k, 8, "int4", True, sub=1, codes=1)
    q = np.asarray(w, np.int32) + 8
    c, d = np.asarray(codes, np.float64), np.asarray(dd, np.float64)
    want = np.zeros((n, k))
    for col in range(k):
        sb, j = divmod(col, 256)
        j //= 32
        want[:, col] = d[2 * sb] * c[16 * sb + j] * q[:, col] - d[2 * sb + 1] * c[16 * sb + 8 + j]
    got = mgpu_probe.reference(w, x, codes, dd, sub=1, codes=1)
    np.testing.assert_allclose(got, want @ np.asarray(x, np.float64).T, rtol=2e-5, atol=1e-4)


@pytest.mark.parametrize("variant", ["wtype=int4,scaled=1,splits=2", "wtype=int4,scaled=1,sub=1,codes=1,math=f16"])
def test_mgpu_probe_kernels_lower_for_cuda_on_a_cpu(variant):
    """The probe's Mosaic GPU kernels trace and lower for CUDA with no GPU, as `--lower` does before a device run
    (their numbers come from a GPU run, scripts/results/mgpu_probe_*_h200.txt)."""
    import functools

    import jax

    import mgpu_probe
    from benchlib import parse_options

    opts = parse_options(variant)
    wtype, scaled = opts.pop("wtype"), bool(opts.pop("scaled"))
    w, x, so = mgpu_probe.inputs(jax.random.key(0), 128, 512, 24, wtype, scaled, sub=opts.get("sub", 0),
                                 codes=opts.get("codes", 0))
    lowered = jax.jit(functools.partial(mgpu_probe.mgpu_matmul, **opts)).trace(w, x, *so).lower(
        lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


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

    params = {"layers": [{"w_up": jnp.ones((64, 32), jnp.float32)}]}
    f = jax.jit(lambda tparams, x: jnp.einsum("mi,oi->mo", x, tparams["layers"][0]["w_up"]))
    x = jnp.ones((3, 32), jnp.float32)
    f(params, x).block_until_ready()
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(3):
            f(params, x).block_until_ready()
    ops = csp.op_seconds(str(tmp_path))
    info = csp.instructions(f.lower(params, x).compile().as_text())
    products = [(name, info[name]) for name in ops if csp.PRODUCT.match(name) and name in info]
    assert products and all(s > 0 for s in ops.values())
    assert [dims_weight for _, dims_weight in products] == [([3, 64], "t:layers.0.w_up")]


def test_gpu_step_profile_counts_busy_time_as_the_union_of_kernels():
    from gpu_step_profile import summarize, table

    # two steps: kernels a (0-4 ms), b (2-6, overlapping a), idle 6-10, a again (10-12)
    ms = 1_000_000
    events = [("a", 0, 4 * ms), ("b", 2 * ms, 4 * ms), ("a", 10 * ms, 2 * ms)]
    r = summarize(events, steps=2)
    assert r["span_ms"] == 6 and r["busy_ms"] == 4 and r["idle_ms"] == 2 and r["launches"] == 1.5
    assert r["top"][0] == {"name": "a", "ms": 3.0, "launches": 1.0}
    assert summarize([], steps=8) == {"steps": 8, "kernels": 0}
    text = table({"device": "d", "jax": "j", "date": "t", "model": "m", "modes": {"ar": r, "ddtree": summarize([], 1)}})
    assert "ar: span 6.00, busy 4.00, idle 2.00 (33 %), 2 launches" in text and "ddtree: no GPU kernel" in text


def test_qmatmul_sass_reads_the_kernel_ir_and_its_loops():
    """The parts of scripts/qmatmul_sass.py that need no Triton compiler: the kernel's Triton IR with the launch
    settings qmatmul asks for, and the K loop found in a SASS listing by its backward branch."""
    import qmatmul_sass
    from pallas_kernels import qmatmul as qm

    ir_text, warps, stages = qmatmul_sass.triton_ir("Q4_K", 64, 1024, 1, {"prefetch": 1, "int8_x": 0})
    assert '"tt.load"' in ir_text and '"scf.for"' in ir_text and (warps, stages) == (qm.GEMV_TILES[2], 3)
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
    pipeline stages, its float32 ones with two (three asked more shared memory than an SM has)."""
    import attn_smem
    import jax.numpy as jnp

    for dtype, expected in ((jnp.bfloat16, 3), (jnp.float32, 2)):
        ir_text, warps, stages = attn_smem.triton_ir(24, 4, 256, dtype)
        assert '"tt.dot"' in ir_text and (warps, stages) == (4, expected), (dtype, warps, stages)


def test_mgpu_ptx_counts_the_kernels_instructions(capsys, monkeypatch):
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
    monkeypatch.setattr(sys, "argv", ["mgpu_ptx.py", "--read", str(saved)])
    mgpu_ptx.main()
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


def test_mgpu_ptx_assembles_the_saved_dump(capsys, monkeypatch):
    """scripts/mgpu_ptx.py --sass on the saved PTX of the shipped kernel, assembled by pip triton's ptxas: its loop
    (one super-block step) is 512 SASS instructions with no byte permute left (the scale broadcasts fold into the
    fma's operand selectors)."""
    pytest.importorskip("triton", reason="--sass assembles with the ptxas of pip's triton package")
    import mgpu_ptx

    saved = ROOT / "scripts/results/ptx/qmatmul_mgpu_scale_words_m23_h100.ptx"
    monkeypatch.setattr(sys, "argv", ["mgpu_ptx.py", "--read", str(saved), "--sass"])
    mgpu_ptx.main()
    out = capsys.readouterr().out
    assert "the pipeline loop 512" in out and "PRMT" not in out.split("loop: ")[-1]


def test_weight_bytes_by_format_of_the_27b():
    """The 27B's Q4_K_M matrices a step streams, by format (the figures the README gives): 11.36 GB of Q4_K and
    4.45 GB of Q6_K (the output head and the "more bits" ffn_down and attn_qkv), 15.81 GB in all."""
    import bench_kernels

    by_format = bench_kernels.weight_bytes_by_format()
    assert sorted(by_format) == ["Q4_K", "Q6_K"] and bench_kernels.ar_weight_bytes() == sum(by_format.values())
    assert round(by_format["Q4_K"] / 1e9, 2) == 11.36 and round(by_format["Q6_K"] / 1e9, 2) == 4.45


def test_mgpu_head_tree_passes_with_the_reference_product(monkeypatch, capsys):
    """scripts/mgpu_head_tree.py's checks hold where nothing is wrong: with qmatmul's reference product (a CPU) every
    variant reports OK, so a WRONG on a GPU is the kernel's or the compiler's, not the harness's (the tree's later
    siblings, which 1e-3 of the head may reorder, are not compared)."""
    import mgpu_head_tree
    from pallas_kernels import qmatmul as qm

    monkeypatch.setattr(qm, "qmatmul", lambda x, w: qm.qmatmul_reference(x, w))
    monkeypatch.setattr(qm, "MGPU_LAYOUT", qm.MGPU_LAYOUT)  # main sets both; restored after
    monkeypatch.setattr(qm, "MGPU_FORMATS", qm.MGPU_FORMATS)
    mgpu_head_tree.main(["--fmt", "Q6_K", "--rows", "2048", "--cols", "256"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 11 and all("WRONG" not in line and "OK" in line for line in lines), lines


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


def test_bench_kernels_kernel_times_by_name(monkeypatch):
    import bench_kernels

    monkeypatch.setattr(bench_kernels, "kernel_seconds_by_name",
                        lambda fn, *args: {"tree_attention_1": 4e-6, "loop_fusion": 2e-6})
    r = bench_kernels._kernel_times(None, per=2)
    assert r["kernel_us"] == pytest.approx(3.0)
    assert r["kernels_us"] == pytest.approx({"tree_attention_1": 2.0, "loop_fusion": 1.0})
    assert bench_kernels._kernel_note(r, "tree_attention") == "  kernels      3.0 us (tree_attention      2.0 us)"
    monkeypatch.setattr(bench_kernels, "kernel_seconds_by_name", lambda fn, *args: {})  # a CPU trace
    assert bench_kernels._kernel_times(None) == {} and bench_kernels._kernel_note({}, "gdn") == ""
