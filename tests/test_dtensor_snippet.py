"""The snippets of notes/10-dtensor.md's "Use it in your FSDP2 x TP training loop" (the one page users find: the
README links to it), extracted and run as written, and their numbers checked against torch:
  * the plain FSDP2 recipe (fully_shard on a 1-D mesh), first on the page and with no private API, under torchrun on
    2 Gloo ranks: its steps replayed by torch.optim.Muon + AdamW fed the ranks' gradients, torch.equal after every
    step; and the gradient contract the page states: each p.grad FSDP2 left is the mean of the two ranks' own
    gradients (recomputed on one process from each rank's inputs), not their sum;
  * the training loop, under torchrun on 4 Gloo CPU ranks (one spawn), with every DTensorMuon.step and
    clip_grad_norm_ recorded (full tensors, every rank) by a wrapper that then runs the snippet unchanged; its
    five steps, through the checkpoint and the fresh build that resumes it, replayed by torch.optim.Muon +
    torch.optim.AdamW(foreach=False) fed the ranks' own gradients: torch.equal after every step; the lr of every
    step the warm-up's (so the scheduler's state came back); each clipped gradient the unclipped one times torch's
    coefficient, from a norm that matches the one-process norm;
  * the one-process block (plain parameters, add_param_group), in this process, replayed the same way, its groups
    holding torch's defaults;
  * the table of options: every option of the installed torch's two signatures, with its default and whether it is
    honoured (distmuon.checks.HONOURED) or refused;
and help(DTensorMuon) documents every argument."""

import logging
import os
import re
import runpy
import subprocess
import sys

import pytest
import torch
from torch.distributed.tensor import DTensor

from distmuon import checks
import page_snippets
from conftest import ROOT

from distmuon import dtensor  # noqa: E402

MARKER = "<!-- dtensor-snippet: tests/test_dtensor_snippet.py runs this block -->"
FSDP2 = "<!-- dtensor-snippet (FSDP2 alone): tests/test_dtensor_snippet.py runs this block -->"
ONE_PROCESS = "<!-- dtensor-snippet (one process): tests/test_dtensor_snippet.py runs this block -->"
PAGE = "notes/10-dtensor.md"
HEADING = "Use it in your FSDP2 × TP training loop"
ANCHOR = "use-it-in-your-fsdp2--tp-training-loop"  # the heading the snippets sit under
FSDP2_STEPS = 4  # the 1-D snippet's steps (a change there must be made here)
# The training snippet's constants (a change there must be made here): 5 steps, lr 0.02 warmed up over 4 steps by
# LambdaLR(min(1, (step + 1) / 4)), gradients clipped to a norm of 0.27.
STEPS, LR, WARMUP, MAX_NORM = 5, 0.02, 4, 0.27
# The ranks' gradient norm sums each shard's squares, then the shards: another order than one process's over the
# full tensors. Each order's float32 error in the norm is below n u / 2 (the sum of squares' n u, halved by the
# square root; Higham 2002, section 4.2), so the two differ by less than n u = 2**-10 relative (n ~ 2**14 elements
# here, u = 2**-24). A lost shard or a mesh dim summed twice moves the norm by a fraction of itself, far beyond.
NORM_BOUND = 2 ** -10


def section():
    return page_snippets.section(PAGE, HEADING)


def snippet(marker=MARKER):
    return page_snippets.code_block(PAGE, HEADING, marker)


def full(t):
    """The whole of t, on every rank. DTensor logs a warning where it gathers a _StridedShard in two steps: the
    recorder's own gathers are kept quiet, so that what the snippet makes torch say still shows."""
    if not isinstance(t, DTensor):
        return t.detach().clone()
    redistribute = logging.getLogger("torch.distributed.tensor._redistribute")
    redistribute.disabled = True
    try:
        return t.full_tensor()
    finally:
        redistribute.disabled = False


def record_local_grads():
    """Make the first module fully_shard is given keep a plain copy of itself (taken before sharding) and the inputs
    of each of its forward calls; the returned function gives, at a step, this rank's own gradient (not reduced over
    the ranks: the plain copy at the step's weights `before`, each forward since the last step run again in this
    process and backpropagated) and forgets those inputs."""
    import copy

    import torch.distributed.fsdp as fsdp

    shard, kept, inputs = fsdp.fully_shard, {}, []

    def recorded_shard(module, *args, **kwargs):
        if not kept:
            kept["plain"] = copy.deepcopy(module)
            module.register_forward_pre_hook(lambda _, a, k: inputs.append((a, k)) and None, with_kwargs=True)
        return shard(module, *args, **kwargs)

    def local_grads(before):
        plain = kept["plain"]
        with torch.no_grad():
            for name, p in plain.named_parameters():
                p.copy_(before[name])
                p.grad = None
        with torch.enable_grad():
            for args, kwargs in inputs:
                plain(*args, **kwargs).backward()
        inputs.clear()
        return {name: p.grad for name, p in plain.named_parameters() if name in before}

    fsdp.fully_shard = recorded_shard
    return local_grads


def record_steps(path, local_grads=False):
    """Make every DTensorMuon.step and torch.nn.utils.clip_grad_norm_ of this process leave, in `path` (torch.save),
    one record per step: each parameter's full tensor before and after, its full gradient as step() takes it and
    as it was before clipping, the total norm, each group's options and names; with local_grads, also this rank's own
    gradient before FSDP2 reduced it (record_local_grads). Collective where the tensors are DTensors (every rank
    records, in the same order)."""
    records, unclipped = [], {}
    clip, step = torch.nn.utils.clip_grad_norm_, dtensor.DTensorMuon.step
    local = record_local_grads() if local_grads else None

    @torch.no_grad()
    def recorded_clip(parameters, *args, **kwargs):
        parameters = list(parameters)
        unclipped.clear()
        unclipped.update({id(p): full(p.grad) for p in parameters if p.grad is not None})
        norm = clip(parameters, *args, **kwargs)
        unclipped["norm"] = full(norm)
        return norm

    def recorded_step(opt, closure=None):
        with torch.no_grad():
            params = opt.param_by_name
            record = dict(before={n: full(p) for n, p in params.items()},
                          grads={n: full(p.grad) for n, p in params.items()},
                          unclipped={n: unclipped.pop(id(p)) for n, p in params.items() if id(p) in unclipped},
                          norm=unclipped.pop("norm", None),
                          groups=[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
        if local:
            record["local_grads"] = local(record["before"])
        loss = step(opt, closure)
        with torch.no_grad():
            record["after"] = {n: full(p) for n, p in params.items()}
        records.append(record)
        torch.save(records, path)
        return loss

    torch.nn.utils.clip_grad_norm_, dtensor.DTensorMuon.step = recorded_clip, recorded_step
    return lambda: setattr(dtensor.DTensorMuon, "step", step) or setattr(torch.nn.utils, "clip_grad_norm_", clip)


def replay(records):
    """torch.optim.Muon + torch.optim.AdamW(foreach=False) from the first record's weights, each group with the
    options it had (every honoured option of distmuon.checks.HONOURED) at each step, fed each record's gradients; the
    weights before each step must be those after the previous one (through a checkpoint's resume too): the first
    step and the parameter where torch's differ from the recorded ones, or None."""
    weights = {n: t.clone() for n, t in records[0]["before"].items()}
    optimizers = []
    for group in records[0]["groups"]:
        muon = group["algorithm"] == "muon"
        cls, extra = (torch.optim.Muon, {}) if muon else (torch.optim.AdamW, dict(foreach=False))
        optimizers.append(cls([weights[n] for n in group["param_names"]],
                              **{k: group[k] for k in checks.HONOURED[group["algorithm"]]}, **extra))
    for k, record in enumerate(records):
        for name, w in weights.items():
            if not torch.equal(w, record["before"][name]):
                return f"before step {k + 1}: {name}"
            w.grad = record["grads"][name].clone()
        for opt, group in zip(optimizers, record["groups"]):
            opt.param_groups[0].update({o: group[o] for o in checks.HONOURED[group["algorithm"]]})
            opt.step()
        for name, w in weights.items():
            if not torch.equal(w, record["after"][name]):
                return f"after step {k + 1}: {name}"
    return None


def run_recorded(code, ranks, tmp, local_grads=False):
    """`code` as written under torchrun (`ranks` Gloo ranks, in `tmp`), each rank's steps recorded (record_steps):
    the finished process and every rank's records."""
    (tmp / "snippet.py").write_text(code)
    (tmp / "recorded.py").write_text(
        "import os, runpy, sys\n"
        f"sys.path[:0] = [{ROOT!r}, {os.path.join(ROOT, 'tests')!r}]\n"
        "from test_dtensor_snippet import record_steps\n"
        f"record_steps(f\"rank{{os.environ['RANK']}}.pt\", local_grads={local_grads!r})\n"
        "runpy.run_path('snippet.py', run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(ranks), "recorded.py"], capture_output=True, text=True, timeout=300, cwd=tmp,
                          env=dict(os.environ, TMPDIR=str(tmp),  # the caller's path kept after ours
                                   PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Warning" not in proc.stderr
    assert not re.search(r"^\[rank\d\]:[WE]\d{4} ", proc.stderr, re.M), proc.stderr[-3000:]  # torch's logged warnings
    return proc, [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(ranks)]


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    """The training snippet as written under torchrun (4 Gloo ranks), each rank's steps recorded."""
    tmp = tmp_path_factory.mktemp("snippet")
    return (tmp, *run_recorded(snippet(), 4, tmp))


@pytest.fixture(scope="module")
def plain_fsdp2(tmp_path_factory):
    """The 1-D FSDP2 snippet as written under torchrun (2 Gloo ranks), each rank's steps and own gradients recorded."""
    tmp = tmp_path_factory.mktemp("fsdp2")
    return run_recorded(snippet(FSDP2), 2, tmp, local_grads=True)


def test_the_readme_links_to_the_one_page_with_the_snippet():
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert f"]({PAGE}#{ANCHOR})" in readme
    assert MARKER not in readme and "dcp.save(" not in readme  # one copy, on one page


def test_the_snippet_runs_as_written_under_torchrun(training):
    tmp, proc, _ = training
    losses = dict(re.findall(r"rank (\d): loss ([\d.]+), lr", proc.stdout))
    assert sorted(losses) == ["0", "1", "2", "3"]
    assert losses["0"] == losses["1"] and losses["2"] == losses["3"]  # the TP ranks of a dp row: one loss
    assert "owners {'up.weight': 0, 'down.weight': 0}" in proc.stdout  # the snippet's assign: the lowest holder
    assert (tmp / "checkpoint" / ".metadata").is_file()


def test_the_training_loop_is_torchs_muon_and_adamw_step_for_step_through_the_resume(training):
    *_, ranks = training
    records = ranks[0]
    assert len(records) == STEPS
    for rank, other in enumerate(ranks[1:], 1):  # replicas agree: every rank's full tensors are rank 0's
        for k, (mine, theirs) in enumerate(zip(records, other)):
            for key in ("before", "grads", "unclipped", "after"):
                assert all(torch.equal(mine[key][n], theirs[key][n]) for n in mine[key]), (rank, k, key)
    muon, adamw = records[0]["groups"]
    assert muon["param_names"] == ["up.weight", "down.weight"]  # muon_param_groups' split
    assert adamw["param_names"] == ["embed.weight", "up.bias", "down.bias"] and adamw["weight_decay"] == 0.0
    assert replay(records) is None
    # The check bites: one weight one ulp off after step 4 (the second after the resume), or the momentum the
    # resume would have lost, fail the replay.
    nudged = [dict(r, after=dict(r["after"])) for r in records]
    nudged[3]["after"]["down.weight"] = torch.nextafter(nudged[3]["after"]["down.weight"], torch.tensor(1.0))
    assert replay(nudged) == "after step 4: down.weight"
    assert replay(records[:3]) is None and replay(records[3:]) == "after step 1: up.weight"


def test_the_plain_fsdp2_recipe_comes_first_and_uses_no_private_api():
    text = section()
    assert text.index(FSDP2) < text.index(MARKER)  # the 1-D recipe before the 2-D one
    code = snippet(FSDP2)
    assert "fully_shard(" in code and "DTensorMuon(muon_param_groups(model)" in code
    assert re.findall(r"\._(?!_)\w*", code) == []  # no private name of torch's or ours (dunders are not private)


def test_the_plain_fsdp2_recipe_is_torchs_muon_and_adamw_step_for_step(plain_fsdp2):
    proc, ranks = plain_fsdp2
    assert sorted(re.findall(r"rank (\d): loss [\d.]+", proc.stdout)) == ["0", "1"]
    records = ranks[0]
    assert len(records) == FSDP2_STEPS and all(len(r) == FSDP2_STEPS for r in ranks)
    for other in ranks[1:]:  # every rank's full tensors are rank 0's
        for mine, theirs in zip(records, other):
            for key in ("before", "grads", "after"):
                assert all(torch.equal(mine[key][n], theirs[key][n]) for n in mine[key]), key
    muon, adamw = records[0]["groups"]
    assert muon["param_names"] == ["up.weight"]  # muon_param_groups' split: the head and the rest to AdamW
    assert adamw["param_names"] == ["embed.weight", "up.bias", "head.weight", "head.bias"]
    assert replay(records) is None
    nudged = [dict(r, after=dict(r["after"])) for r in records]  # the check bites: one ulp on one weight
    nudged[1]["after"]["up.weight"] = torch.nextafter(nudged[1]["after"]["up.weight"], torch.tensor(1.0))
    assert replay(nudged) == "after step 2: up.weight"


def test_fsdp2_hands_the_optimizer_the_mean_of_the_ranks_gradients(plain_fsdp2):
    """The gradient contract the page and the README state for DTensorMuon under FSDP2's defaults: p.grad is the mean
    over the dp ranks of each rank's own gradient (FSDP2 reduce-scatters with ReduceOp.AVG), not their sum, so the
    loss is not to be scaled by 1/DP. Each rank's own gradient is its batch's, backpropagated again on one process
    at the step's weights."""
    _, ranks = plain_fsdp2
    for k, records in enumerate(zip(*ranks)):
        grads = records[0]["grads"]
        for name, g in grads.items():
            own = [r["local_grads"][name] for r in records]
            assert not torch.equal(own[0], own[1]), (k, name)  # the ranks' batches differ
            mean = (own[0] + own[1]) / 2  # with two ranks: one rounding, exact halving, in any order
            assert torch.equal(g, mean), (k, name, (g - mean).abs().max())
            assert not torch.allclose(g, own[0] + own[1]), (k, name)


def test_the_lr_of_every_step_is_the_warm_ups_through_the_resume(training):
    *_, ranks = training
    lrs = [[g["lr"] for g in record["groups"]] for record in ranks[0]]
    warmed_up = [LR * min(1.0, (step + 1) / WARMUP) for step in range(STEPS)]  # LambdaLR's base_lr * lambda(step)
    assert lrs == [[lr, lr] for lr in warmed_up]
    # a scheduler built afresh and not loaded would have started again: step 5 would take LR * 2 / WARMUP
    assert warmed_up[4] != LR * 2 / WARMUP


def test_clipping_scales_the_gradients_by_torchs_coefficient_of_the_true_norm(training):
    *_, ranks = training
    clipped = 0
    for k, record in enumerate(ranks[0]):
        unclipped = record["unclipped"]
        assert sorted(unclipped) == sorted(record["grads"])  # every gradient went through clip_grad_norm_
        one_process = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in unclipped.values()]))
        assert abs(record["norm"] - one_process) <= NORM_BOUND * one_process, (k, record["norm"], one_process)
        coefficient = torch.clamp(MAX_NORM / (record["norm"] + 1e-6), max=1.0)  # torch's clip_grads_with_norm_
        clipped += bool(coefficient < 1)
        for name, g in unclipped.items():
            assert torch.equal(record["grads"][name], g * coefficient), (k, name)
    assert 0 < clipped < STEPS  # the snippet's MAX_NORM clips some steps and not others


def test_the_one_process_snippet_runs_as_written_with_torchs_defaults(tmp_path):
    (tmp_path / "one_process.py").write_text(snippet(ONE_PROCESS))
    restore = record_steps(tmp_path / "steps.pt")
    try:
        runpy.run_path(str(tmp_path / "one_process.py"), run_name="__main__")
    finally:
        restore()
    records = torch.load(tmp_path / "steps.pt", weights_only=False)
    assert len(records) == 2 and replay(records) is None
    muon, adamw = records[0]["groups"]
    assert (muon["param_names"], adamw["param_names"]) == (["0", "1"], ["2", "3"])  # numbered as torch's state_dict
    for group in (muon, adamw):
        assert {k: group[k] for k in checks.TORCH_OPTIONS[group["algorithm"]]} == checks.TORCH_OPTIONS[group["algorithm"]]
    assert dtensor.DTensorMuon.step.__name__ == "step"  # restored: other tests' optimizers step unrecorded


def test_the_table_lists_every_option_of_torchs_signatures_honoured_or_refused():
    rows = re.findall(r"^\| (Muon|AdamW) \| `(\w+)` \| `(.*?)` \| (honoured|refused)", section(), re.M)
    listed = {(a.lower(), option): (default, verdict) for a, option, default, verdict in rows}
    assert len(listed) == len(rows)
    assert listed == {(a, option): (repr(default), "honoured" if option in checks.HONOURED[a] else "refused")
                      for a, options in checks.TORCH_OPTIONS.items() for option, default in options.items()}
    for (a, option), (_, verdict) in listed.items():
        if verdict == "refused":
            assert checks.refusal(a, option) == checks.REFUSED[option]  # a reason the page's row gives


@pytest.mark.parametrize("argument", ["params", "options", "expert_stacks", "distributed_config", "batched_ns", "group",
                                      "row_layouts", "ns_blocks", "tp_newton_schulz", "qk_clip_tau", "exchange_bytes",
                                      "overlap"])
def test_help_documents_every_argument(argument):
    import inspect

    assert list(inspect.signature(dtensor.DTensorMuon.__init__).parameters)[1:] == [
        "params", "expert_stacks", "distributed_config", "batched_ns", "group", "row_layouts", "ns_blocks",
        "tp_newton_schulz", "qk_clip_tau", "exchange_bytes", "overlap", "options"]  # options: every keyword of torch.optim.Muon and AdamW
    assert re.search(rf"(^|[\s,]){argument}( \(keywords\))?[:,]", dtensor.DTensorMuon.__init__.__doc__, re.M), argument
    assert "p.grad is the TOTAL gradient" in dtensor.DTensorMuon.__doc__
    assert "assign: f(ns_flops, holders, world)" in dtensor.DistributedConfig.__doc__
