"""What large runs add, in examples/ and benchmarks/: the GPT's per-head maxima and train_gpt.py's --qk-clip,
--ns-blocks, --ns-coefficients and --tp-newton-schulz on real multi-rank runs (DP = 2 x TP = 1 and DP = 1 x
TP = 2), checked
against train_gpt.py's one-process reference (torch.optim.Muon + AdamW, examples/gpt_verify.py: blocks as separate
parameters, Polar Express swapped into torch's Newton-Schulz, the clip from the paper's equation; gram's
replay within the lesson's gram_tolerance);
their refusals; and benchmarks/compare.py's byte formulas for the Gram all-reduce against a real run's
Ledger, benchmarks/ns_coefficients.py's table.

Tolerance policy: examples/gpt_verify.py's. The replay (torch's optimizers fed the ranks' summed gradients and, with
--qk-clip, the ranks' maxima) is bit for bit on every grid but where gram sums a Gram matrix over TP; the
whole run is bit for bit with TP = 1 and, the one process computing TP's two pieces apart and adding them
as the ranks do, with TP = 2 (gram aside: its free-running weights). The reported maxima are compared with
logits computed here, in float64, from q and k of that one-process model at the ranks' weights on the
step's micro-batches: the ranks' q and k are its float32 q and k, bit for bit (the same ops on the same
numbers), so the reported maximum differs from the float64 logits of those q and k only by the float32 dot
product of head_dim terms and the 1/sqrt(head_dim) scale: (head_dim + 2) u sum_i |q_i k_i| / sqrt(head_dim)
at most (Higham 2002, section 3.1, u = 2**-24), and so does a max of such values.
"""

import json
import math
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from conftest import ROOT, suite_config, suite_specs
import distributed_muon_cpu
from distmuon import checks
from distmuon import large_runs
import muon_tools

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import compare  # noqa: E402
from examples import gpt  # noqa: E402
import ns_coefficients  # noqa: E402
from examples import gpt_verify  # noqa: E402
from examples import train_gpt  # noqa: E402
from examples.stdlib_text import load_corpus  # noqa: E402

SMALL = dict(d_model=32, layers=2, heads=4, context=32, batch=8, val_windows=4, log_every=1000, timeout_s=60)
STEPS = 3
UNIT_ROUNDOFF = 2.0**-24
GRIDS = [(2, 1), (1, 2)]
GRAM_TPS = [2, 4]
GRID_RUNS = [suite_config(dp=1, tp=tp, steps=1, tp_newton_schulz=way) for tp in GRAM_TPS for way in ("gather", "gram")]


def step1_max_logits(cfg):
    """Each head's largest logit of step 1 (at the initial weights, the same in every run): sorted."""
    model = gpt.GPT(cfg.gpt())
    model.record_max_logits()
    found = {}
    gpt_verify.accumulate_gradients(model, cfg, 1, "cpu", found)
    return sorted(torch.cat(list(found.values())).tolist())


def tau_between(cfg):
    """A tau with about half the heads above it at step 1: heads that clip and heads that do not."""
    s = step1_max_logits(cfg)
    return (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def configs(dp, tp):
    base = train_gpt.TrainConfig(dp=dp, tp=tp, steps=STEPS, keep=True, **SMALL)
    tau = tau_between(base)
    return [train_gpt.TrainConfig(dp=dp, tp=tp, steps=STEPS, keep=True, qk_clip=tau, **SMALL),
            train_gpt.TrainConfig(dp=dp, tp=tp, steps=STEPS, keep=True, ns_blocks="blocks",
                                  ns_coefficients="polar_express",
                           **SMALL),
            train_gpt.TrainConfig(dp=dp, tp=tp, steps=STEPS, keep=True, ns_blocks="heads", qk_clip=tau,
                           strategy="gather", **SMALL),
            train_gpt.TrainConfig(dp=dp, tp=tp, steps=STEPS, keep=True, tp_newton_schulz="gram", qk_clip=tau,
                           strategy="gather", **SMALL),
            # NorMuon on the matrices (its reference: muon_tools.NorMuonReference), with QK-clip and Polar Express
            train_gpt.TrainConfig(dp=dp, tp=tp, steps=STEPS, keep=True, optimizer="normuon", strategy="comm-free",
                           ns_coefficients="polar_express", qk_clip=tau, **SMALL)]


@pytest.fixture(scope="module")
def trained():
    """{(dp, tp): [(config, every rank's result)]}: one spawn per grid."""
    return {(dp, tp): train_gpt.train_many(configs(dp, tp)) for dp, tp in GRIDS}


@pytest.mark.parametrize("dp,tp", GRIDS)
def test_large_run_options_train_as_torch_does(trained, dp, tp):
    for cfg, results in trained[dp, tp]:
        checks = gpt_verify.verify(cfg, results)
        what = f"{cfg.strategy} {cfg.ns_blocks} {cfg.ns_coefficients} {cfg.tp_newton_schulz} qk_clip={cfg.qk_clip} " \
               f"on {dp}x{tp}"
        assert checks["passed"], what
        specs = {s.name: s for s in gpt_verify.param_specs(cfg)}
        for c in checks["replay"]:  # the optimizer: bit for bit, but where gram sums a Gram matrix over TP
            assert c["identical"] or (gpt_verify.by_gram(cfg, specs[c["name"]]) and c["max_abs_diff"] <= c["tolerance"]), \
                (what, c)
        gram_bytes = train_gpt.summarize(cfg, results)["bytes_per_step"].get("TP Gram", {"sent": [0]})["sent"]
        assert (max(gram_bytes) > 0) == (cfg.tp_newton_schulz == "gram" and tp > 1), what
        assert checks["gradients_exact"] and checks["grad_max_rel_diff"] == checks["step_loss_max_rel_diff"] == 0, what
        if not (cfg.tp_newton_schulz == "gram" and tp > 1):  # gram's own sums aside, the whole run is exact
            assert checks["exact"] and all(c["identical"] for c in checks["trained"]), what


def test_the_options_change_the_update(trained):
    """Each option does something: torch's plain reference (no option) fed the same gradients differs (gram
    does nothing at TP = 1)."""
    for cfg, results in trained[2, 1][:3]:
        specs = gpt_verify.param_specs(cfg)
        totals, _ = gpt_verify.total_gradients(cfg, results, specs)
        plain = gpt_verify.reference(replace(cfg, qk_clip=None, ns_blocks="whole", ns_coefficients="jordan"),
                             replay=totals)["params"]
        ranks = results[0]["params"]
        name = "blocks.0.attn.qkv.weight"
        assert not torch.equal(plain[name], ranks[name]), cfg
        assert torch.equal(plain["blocks.0.mlp.fc.weight"], ranks["blocks.0.mlp.fc.weight"]) == (
            cfg.ns_coefficients == "jordan"), cfg  # only Polar Express touches the other matrices


def direct_max_logits(cfg, weights, step, dtype=torch.float32):
    """{qkv name: ((heads,) float64 max logit, (heads,) the float32 dot product's rounding bound)} from the q
    and k the one-process model (in dtype; with TP > 1, TP's pieces apart) computes at `weights` on step's
    micro-batches: every pair j <= i, in float64."""
    model = gpt.GPT(cfg.gpt(), as_tp=cfg.tp).to(dtype)
    gpt_verify.load_weights(model, weights)
    g = cfg.gpt()
    hd = g.d_model // g.n_heads
    captured = {}
    hooks = [block.attn.qkv.register_forward_hook(lambda m, i, o, n=f"blocks.{k}.attn.qkv.weight":
                                                  captured.setdefault(n, []).append(o.detach()))
             for k, block in enumerate(model.blocks)]
    corpus = load_corpus()
    with torch.no_grad():
        for d in range(cfg.dp):
            x, y = corpus.batch(step, cfg.batch, cfg.context, cfg.seed, d, cfg.dp)
            model(x, y)
    for h in hooks:
        h.remove()
    causal = torch.ones(cfg.context, cfg.context, dtype=torch.bool).tril()
    out = {}
    for name, outputs in captured.items():
        qkv = torch.cat(outputs).double().view(-1, cfg.context, g.n_heads, 3, hd)
        q, k = qkv[:, :, :, 0], qkv[:, :, :, 1]  # (batch, time, heads, hd)
        logits = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(hd)
        magnitude = torch.einsum("bihd,bjhd->bhij", q.abs(), k.abs()) / math.sqrt(hd)
        logits = logits.masked_fill(~causal, -math.inf)
        bound = (hd + 2) * UNIT_ROUNDOFF * magnitude.masked_fill(~causal, 0).amax(dim=(0, 2, 3))
        out[name] = (logits.amax(dim=(0, 2, 3)), bound)
    return out


@pytest.mark.parametrize("dp,tp", GRIDS)
def test_the_reported_maxima_are_the_logits_of_q_and_k_and_heads_clip(trained, dp, tp):
    cfg, results = trained[dp, tp][0]
    specs = gpt_verify.param_specs(cfg)
    by_rank = {r["rank"]: r for r in results}
    heads_per_rank = cfg.heads // tp
    clipped_any = unclipped_any = False
    one_process, _ = gpt_verify.reference_model(cfg, "cpu")  # records its maxima: cfg has --qk-clip
    for step in range(cfg.steps):
        weights = gpt_verify.full_tensors(cfg, lambda t: by_rank[t]["weights"][step], specs)
        reported = gpt_verify.ranks_max_logits(results, step)
        gpt_verify.load_weights(one_process, weights)
        found = {}
        gpt_verify.accumulate_gradients(one_process, cfg, step + 1, "cpu", found)
        one_process.zero_grad(set_to_none=True)
        assert all(torch.equal(found[n], reported[n]) for n in reported), step  # the reference's own, bit for bit
        exact64 = direct_max_logits(cfg, weights, step + 1, torch.float64)
        for name, (one, bound) in direct_max_logits(cfg, weights, step + 1).items():
            ranks_err = (reported[name].double() - exact64[name][0]).abs()
            assert ((reported[name].double() - one).abs() <= bound).all(), (step, name, reported[name], one)
            assert (ranks_err < 1e-5 * one.abs()).all()  # the check is tight: far below a wrong head or position
            for r in results:  # a rank reports its TP rank's heads, -inf for the others
                t = r["rank"] % tp
                mine = torch.zeros(cfg.heads, dtype=torch.bool)
                mine[t * heads_per_rank:(t + 1) * heads_per_rank] = True
                local = r["max_logits"][step][name]
                assert torch.isfinite(local[mine]).all() and (local[~mine] == -math.inf).all()
            # the multipliers clip_qk_ returns, sqrt(min(1, tau / S)) with S over every rank: the same on every
            # rank for the heads whose rows it holds (None for the others), and every head's held somewhere
            expected = [math.sqrt(min(1.0, cfg.qk_clip / s)) for s in reported[name].tolist()]
            for r in results:
                got = r["clipped"][step][name]
                assert [g if g is None else e for g, e in zip(got, expected)] == got, (step, name, got, expected)
            assert all(any(r["clipped"][step][name][h] is not None for r in results) for h in range(cfg.heads))
            clipped_any |= any(m < 1 for m in expected)
            unclipped_any |= any(m == 1 for m in expected)
    assert clipped_any and unclipped_any

    def multiplier(step, name, h):  # from a rank that holds head h's rows
        return next(r["clipped"][step][name][h] for r in results if r["clipped"][step][name][h] is not None)

    counted = [sum(multiplier(s, n, h) < 1 for n in results[0]["clipped"][s] for h in range(cfg.heads))
               for s in range(cfg.steps)]
    assert train_gpt.summarize(cfg, results)["qk_clip"]["heads_clipped"] == counted  # what the run prints


def test_a_clipped_heads_q_and_k_rows_are_scaled_and_nothing_else(trained):
    """The weights step 2 starts from: step 1's update without the clip (torch's, fed the same gradients), then
    head h's q and k rows times sqrt(min(1, tau / S_h)) and its v rows as they were (the QKV bias, an AdamW
    parameter, is not clipped: with it a head's logits shrink by about gamma, not exactly)."""
    cfg, results = trained[2, 1][0]
    specs = gpt_verify.param_specs(cfg)
    totals, _ = gpt_verify.total_gradients(cfg, results, specs)
    unclipped = gpt_verify.reference(replace(cfg, qk_clip=None, steps=1), replay=totals[:1])
    g = cfg.gpt()
    hd = g.d_model // g.n_heads
    after = results[0]["weights"][1]  # the weights step 2 starts from: step 1's, clipped
    for name, maxima in gpt_verify.ranks_max_logits(results, 0).items():
        for h, s in enumerate(maxima.tolist()):
            rows = slice(3 * h * hd, (3 * h + 2) * hd)
            scale = math.sqrt(min(1.0, cfg.qk_clip / s))
            assert torch.equal(after[name][rows], unclipped["params"][name][rows] * scale), (name, h)
            v = slice((3 * h + 2) * hd, (3 * h + 3) * hd)
            assert torch.equal(after[name][v], unclipped["params"][name][v])  # v rows untouched


# -- refusals: exit 2, one line, before any rank (tests/test_bad_input.py's harness runs them) -------------
BAD = [(["--qk-clip", "0"], "--qk-clip must be a number > 0 and finite (got 0.0)"),
       (["--qk-clip", "nan"], "--qk-clip must be a number > 0 and finite (got nan)"),
       (["--qk-clip", "inf"], "--qk-clip must be a number > 0 and finite (got inf)"),
       (["--tp-newton-schulz", "ring"], "argument --tp-newton-schulz: invalid choice: 'ring'"),
       (["--tp-newton-schulz", "gram"], "--tp-newton-schulz gram applies to --strategy gather: strategy owner"),
       (["--qk-clip", "abc"], "argument --qk-clip: invalid float value: 'abc'"),
       (["--ns-blocks", "rows"], "argument --ns-blocks: invalid choice: 'rows'"),
       (["--ns-coefficients", "newton"], "argument --ns-coefficients: invalid choice: 'newton'"),
       (["--optimizer", "adamw", "--qk-clip", "1", "--ns-blocks", "heads"],
        "--optimizer adamw takes no --qk-clip, --ns-blocks: momentum, QK-clip and Newton-Schulz options are Muon's"),
       (["--optimizer", "normuon", "--strategy", "gather"],
        "--optimizer normuon takes --strategy owner or comm-free, whose owner holds each matrix's rows (got --strategy "
        "gather)"),
       (["--optimizer", "normuon", "--ns-blocks", "heads"],
        "--optimizer normuon takes no --ns-blocks: NorMuon normalizes the rows of the whole matrix")]


def test_bad_large_run_flags_are_refused_before_any_rank():
    jobs = [("examples/train_gpt.py", args, {}) for args, _ in BAD]
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "test_bad_input.py")], input=json.dumps(jobs),
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for (args, message), (code, out, err) in zip(BAD, json.loads(proc.stdout)):
        assert (code, out) == (2, ""), (args, code, out, err)
        assert err.startswith("error: ") and err.count("\n") == 1 and message in err, (args, err)


# -- benchmarks ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tp", GRAM_TPS)
def test_gram_bytes_formula_is_what_a_real_run_sends(run_grid, tp):
    """compare.tp_newton_schulz_costs against the Ledgers of real runs of the lesson's demo (DP = 1, so every
    TP-split matrix goes through each rank): the TP gather of tp_newton_schulz="gather", the Gram and norm
    all-reduces of "gram", every rank, summed over the matrices."""
    specs = [s for s in suite_specs() if s.group == muon_tools.MUON_GROUP and s.tp_split_dim >= 0]
    assert specs and all(large_runs.gram_eligible(s.global_shape, s.tp_split_dim) for s in specs)
    costs = [compare.tp_newton_schulz_costs(s.global_shape, s.tp_split_dim, tp) for s in specs]
    runs = {way: run_grid(1, tp, steps=1, tp_newton_schulz=way) for way in ("gather", "gram")}
    unsplit = sum(distributed_muon_cpu.newton_schulz_flops(s.global_shape) for s in suite_specs()
                  if s.group == muon_tools.MUON_GROUP and s.tp_split_dim < 0)  # the routers: whole on every rank either way
    for way, run in runs.items():
        assert run["passed"], way
        assert run["ns_flops"]["per_rank"] == [sum(c[f"{way}_flops"] for c in costs) + unsplit] * tp, way
    gather, gram = (runs[way]["bytes_per_step"] for way in ("gather", "gram"))
    assert gather["TP gather"]["sent"] == [sum(c["gather_bytes"] for c in costs)] * tp
    assert "TP gather" not in gram or gram["TP gather"]["sent"] == [0] * tp  # the router is not split
    assert [a + b for a, b in zip(gram["TP Gram"]["sent"], gram["TP Gram norm"]["sent"])] == \
        [sum(c["gram_bytes"] for c in costs)] * tp


def test_the_rule_is_where_the_bytes_cross():
    """gram < gather exactly when the long side exceeds 4 x ns_steps the short one (the norm's 4 bytes aside)."""
    for steps in (3, 5):
        for tp in (2, 4, 8):
            for m in (32, 64):
                for ratio in range(1, 8 * steps):
                    c = compare.tp_newton_schulz_costs((m, m * ratio), 1, tp, steps)
                    assert (c["gram_bytes"] < c["gather_bytes"]) == (ratio > 4 * steps), (steps, tp, m, ratio)
    assert compare.tp_newton_schulz_costs((64, 32), 1, 2)["gram_bytes"] is None  # split cuts the short side


def test_ns_coefficients_table_reports_sigma_of_real_matrices(capsys):
    assert ns_coefficients.main(["--train-steps", "1", "--steps", "2", "--d-model", "16", "--layers", "1",
                                 "--heads", "1"]) == 0
    out = capsys.readouterr().out
    assert "k=1" in out and "k=2" in out and "polar_express" in out and "jordan" in out
    cfg = ns_coefficients.config_of(ns_coefficients.build_parser().parse_args(
        ["--d-model", "16", "--layers", "1", "--heads", "1", "--train-steps", "1"]))
    (name, _, m), *_ = ns_coefficients.real_matrices(cfg, 1)
    per_k = ns_coefficients.sigmas(m, "polar_express", 2)
    expect = torch.linalg.svdvals(distributed_muon_cpu.newton_schulz(m, 2, checks.POLAR_EXPRESS[:2]).double())
    assert len(per_k) == 3 and torch.equal(per_k[-1], expect)
    assert abs(per_k[0].square().sum().item() - 1) < 2**-6  # the input over its Frobenius norm (bf16: 8 bits)
