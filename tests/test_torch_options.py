"""The options of torch's own optimizers, as the lesson's optimizers take them (issue 30): every option of the
installed torch.optim.Muon and torch.optim.AdamW honoured bit for bit or refused at construction, torch's
defaults, add_param_group, plain parameters, and a refused step that changes nothing on any rank.

DistributedMuon, OwnerMuon and CommFreeMuon run every case on ONE spawn of 4 Gloo ranks (DP 2 x TP 2), each
against torch.optim.Muon and torch.optim.AdamW(foreach=False) on one process, fed the gradients summed over
DP (multiples of 2**-10: the sum is exact in any order, so every comparison is torch.equal). DTensorMuon's
groups take the same options through distmuon.checks (tests/test_dtensor.py steps them against torch).
"""

import copy
from dataclasses import dataclass

import pytest
import torch

from distmuon import checks
import distributed_muon_cpu
from distmuon import owners
import muon_tools
from distmuon.dtensor import DTensorMuon

DP, TP, SEED, STEPS = 2, 2, 3, 2
SPECS = [distributed_muon_cpu.ParamSpec("w1", (8, 6), 0, "muon"), distributed_muon_cpu.ParamSpec("w2", (6, 8), 1, "muon"),
         distributed_muon_cpu.ParamSpec("w3", (5, 4), -1, "muon"), distributed_muon_cpu.ParamSpec("b1", (8,), 0, "adamw"),
         distributed_muon_cpu.ParamSpec("s", (), -1, "adamw")]
ADDED = [distributed_muon_cpu.ParamSpec("w4", (4, 6), 1,
                                        "muon")]  # the matrix add_param_group brings, with an lr of its own
# One case per honoured option: a value other than torch's default (tests below check the list is complete and
# that each value changes the result). Muon's eps of 100 is above every update's norm here: it scales them;
# amsgrad needs a second moment that falls, which betas (0.9, 0.5) gives it within three steps.
OPTION_CASES = [("muon", "lr", 0.05), ("muon", "weight_decay", 0.3), ("muon", "momentum", 0.8),
                ("muon", "nesterov", False), ("muon", "ns_coefficients", (3.0, -3.2, 1.2)), ("muon", "eps", 100.0),
                ("muon", "ns_steps", 3), ("muon", "adjust_lr_fn", "match_rms_adamw"),
                ("adamw", "lr", 0.05), ("adamw", "betas", (0.8, 0.95)), ("adamw", "eps", 1e-3),
                ("adamw", "weight_decay", 0.3), ("adamw", "amsgrad", True), ("adamw", "maximize", True)]
ALONGSIDE = {"amsgrad": dict(betas=(0.9, 0.5))}  # options a case sets beside its own (kept when it is dropped)
CONSTRUCTOR = dict(lr=0.05, weight_decay=0.2, eps=1e-3)  # keywords: the default of every group taking them
CASES = [("option", a, k, v) for a, k, v in OPTION_CASES] + [("defaults",), ("constructor",), ("added",),
                                                              ("plain",), ("refused",)]


def groups_of(case, params, drop_option=False):
    """The case's param groups over `params` ({name: tensor}, pieces or full), and the constructor's keywords;
    drop_option: without the case's own option (torch's default instead), what an optimizer ignoring it does."""
    muon, adamw = [(s.name, params[s.name]) for s in SPECS if s.group == "muon"], \
        [(s.name, params[s.name]) for s in SPECS if s.group == "adamw"]
    groups = [dict(params=muon, algorithm="muon"), dict(params=adamw, algorithm="adamw")]
    if case[0] == "option":
        groups[case[1] == "adamw"].update(ALONGSIDE.get(case[2], {}), **({} if drop_option else {case[2]: case[3]}))
    return groups, (CONSTRUCTOR if case[0] == "constructor" else {})


def exact_grads(step, dp_rank):
    return distributed_muon_cpu.dp_rank_grads(SPECS + ADDED, SEED, step, dp_rank)


@dataclass(frozen=True)
class Spawn:
    dp: int = DP
    tp: int = TP
    timeout_s: float = 120.0


def run_case(grid, strategy, case):
    """One case on this rank: {"params": its pieces after the steps} (and the refusal's record)."""
    start = distributed_muon_cpu.initial_params(SPECS + ADDED, SEED)
    pieces = {s.name: distributed_muon_cpu.rank_piece(start[s.name], s, grid, "cpu") for s in SPECS + ADDED}
    splits = {s.name: s.tp_split_dim for s in SPECS + ADDED if s.tp_split_dim >= 0}
    build = lambda groups, **options: owners.OPTIMIZERS[strategy](groups, grid=grid, bucket_size=32, **options)

    def added():  # the matrix and the AdamW group join after the first step, as the fresh optimizer rebuilds it
        opt.add_param_group(dict(params=[("w4", pieces["w4"])], lr=0.03, tp_split_dims={"w4": 1}))
        opt.add_param_group(groups_of(case, pieces)[0][1] | dict(tp_split_dims={"b1": 0}))

    if case[0] == "plain":
        names = [s.name for s in SPECS if s.group == "muon"]
        opt = build([pieces[n] for n in names], tp_split_dims={str(i): splits[n] for i, n in enumerate(names)
                                                                 if n in splits})
    else:
        groups, options = groups_of(case, pieces)
        opt = build(groups[:1] if case[0] == "added" else groups,
                    tp_split_dims={n: d for n, d in splits.items() if n in ("w1", "w2") or case[0] != "added" and n != "w4"},
                    **options)
    out = {}
    for step in range(1, STEPS + 2):
        grads = exact_grads(step, grid.dp.rank)
        for s in SPECS + ADDED:
            pieces[s.name].grad = distributed_muon_cpu.rank_piece(grads[s.name], s, grid, "cpu")
        if case[0] == "refused" and step == 2:
            if grid.rank == 1:
                opt.param_groups[0]["lr"] = -1.0  # a bad option, set on one rank only after construction
            before = copy.deepcopy(({n: p.detach() for n, p in pieces.items()}, opt.state_dict()["state"]))
            try:
                opt.step()
                out["refusal"] = None
            except ValueError as e:
                out["refusal"] = str(e)
            out["unchanged"] = same(before, ({n: p.detach() for n, p in pieces.items()}, opt.state_dict()["state"]))
            break
        opt.step()
        if case[0] == "added" and step == 1:
            added()
        if case[0] == "added" and step == 2:  # a checkpoint round trip: a fresh optimizer built the same way
            state, opt = opt.state_dict(), build(groups_of(case, pieces)[0][:1], tp_split_dims={"w1": 0, "w2": 1})
            added()
            opt.load_state_dict(state)
    return dict(out, rank=grid.rank, params={n: p.detach().clone() for n, p in pieces.items()})


def same(a, b):
    """Whether two nests of dicts, tuples and tensors hold the same keys and bits."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


def run_cases(rank, spawn, device):
    torch.set_num_threads(1)
    grid = distributed_muon_cpu.make_grid(DP, TP, rank)
    return {(strategy, case): run_case(grid, strategy, case) for strategy in owners.STRATEGIES for case in CASES}


@pytest.fixture(scope="module")
def spawned():
    ranks = muon_tools.spawn_ranks(Spawn(), run_cases)
    return {key: [r[key] for r in ranks] for key in ranks[0]}


def torch_run(case, drop_option=False):
    """{name: full tensor} after the case's steps of torch.optim.Muon / AdamW(foreach=False) on one process, fed
    each step's gradient summed over DP; drop_option: the case's option left at torch's default."""
    torch.set_num_threads(1)
    full = {n: torch.nn.Parameter(t) for n, t in distributed_muon_cpu.initial_params(SPECS + ADDED, SEED).items()}
    groups, options = groups_of(case, full, drop_option)
    muon_options = {k: v for k, v in options.items() if k in checks.TORCH_OPTIONS["muon"]}
    adamw_options = {k: v for k, v in options.items() if k in checks.TORCH_OPTIONS["adamw"]}
    strip = lambda g: {k: v for k, v in g.items() if k != "algorithm"} | dict(params=[p for _, p in g["params"]])
    muon = torch.optim.Muon([strip(groups[0])], **muon_options)
    adamw = None if case[0] in ("added", "plain") else torch.optim.AdamW([strip(groups[1])], foreach=False,
                                                                          **adamw_options)
    for step in range(1, (2 if case[0] == "refused" else STEPS + 2)):
        total = [exact_grads(step, d) for d in range(DP)]
        for n, p in full.items():
            p.grad = sum(g[n] for g in total)
        muon.step()
        if adamw is not None:
            adamw.step()
        if case[0] == "added" and step == 1:
            muon.add_param_group(dict(params=[full["w4"]], lr=0.03))
            adamw = torch.optim.AdamW([strip(groups[1])], foreach=False)
    return {n: p.detach() for n, p in full.items()}


@pytest.mark.parametrize("strategy", owners.STRATEGIES)
@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_every_case_steps_as_torch_does(spawned, strategy, case):
    ranks = spawned[strategy, case]
    specs = SPECS + (ADDED if case[0] == "added" else [])
    checks = distributed_muon_cpu.check_against_torch(specs, ranks, torch_run(case), TP)
    assert [c["name"] for c in checks if not c["identical"]] == []
    if case[0] == "option":  # the option changes the result: an option ignored would fail above
        moved = [s for s in SPECS if s.group == case[1]]
        ignored = distributed_muon_cpu.check_against_torch(moved, ranks, torch_run(case, drop_option=True), TP)
        assert not all(c["identical"] for c in ignored), case
    if case[0] in ("added", "plain"):
        untouched = [s.name for s in SPECS + ADDED if s not in specs or s.group == "adamw" and case[0] == "plain"]
        start = distributed_muon_cpu.initial_params(SPECS + ADDED, SEED)
        assert all(torch.equal(r["params"][n],
                               distributed_muon_cpu.rank_piece(start[n], s, distributed_muon_cpu.plan_grid(DP, TP, r["rank"]), "cpu"))
                   for r in ranks for s in SPECS + ADDED for n in [s.name] if n in untouched)


@pytest.mark.parametrize("strategy", owners.STRATEGIES)
def test_a_step_refused_on_one_rank_changes_nothing_on_any(spawned, strategy):
    ranks = spawned[strategy, ("refused",)]
    assert all(r["unchanged"] for r in ranks)  # parameters, momentum buffers, AdamW moments and step counts
    assert ranks[1]["refusal"] == "rank 1: param group 0 (muon): lr must be >= 0 and finite (got -1.0)"
    assert all(r["refusal"] == "rank 1 refused the step (it raised why); nothing changed"
               for r in ranks if r["rank"] != 1)
    # the launcher names the rank that says why, not one that heard of it (muon_tools.culprit_failure)
    assert [muon_tools.is_secondhand(r["refusal"]) for r in ranks] == [r["rank"] != 1 for r in ranks]


def test_every_option_of_torchs_signatures_is_honoured_or_refused():
    """The walk over the installed torch's signatures: an option a newer torch adds fails here until it is
    honoured (with a case above) or refused with a reason."""
    for algorithm, options in checks.TORCH_OPTIONS.items():
        assert options == {n: p.default for n, p in __import__("inspect").signature(
            checks.ALGORITHMS[algorithm].__init__).parameters.items() if n not in ("self", "params")}
        honoured = {k for a, k, _ in OPTION_CASES if a == algorithm}
        assert honoured == set(checks.HONOURED[algorithm])
        for option in set(options) - honoured:
            assert option in checks.REFUSED, option
            with pytest.raises(ValueError, match=rf"^param group 0 \({algorithm}\): {option}=True is refused: "):
                checks.fill_param_group(dict(params=[torch.zeros(2, 2)], algorithm=algorithm, **{option: True}), {}, 0)


def test_the_defaults_are_torchs():
    assert checks.TORCH_OPTIONS["muon"]["lr"] == checks.TORCH_OPTIONS["adamw"]["lr"] == 1e-3
    group = checks.fill_param_group(dict(params=[torch.zeros(3)], algorithm="adamw"), {}, 0)
    assert group["weight_decay"] == 0.01 and group["eps"] == 1e-8 and group["amsgrad"] is False
    group = checks.fill_param_group(dict(params=[torch.zeros(3, 3)]), dict(lr=0.5, betas=(0.5, 0.5)), 0)
    assert (group["algorithm"], group["lr"], group["weight_decay"], group["eps"]) == ("muon", 0.5, 0.1, 1e-7)
    assert "betas" not in group  # the AdamW option goes to AdamW groups only


def test_muon_param_groups_splits_a_model_as_muon_users_do():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.block = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))
            self.lm_head = torch.nn.Linear(4, 10, bias=False)

    muon, adamw = checks.muon_param_groups(Net())
    assert [n for n, _ in muon["params"]] == ["block.0.weight", "block.2.weight"] and muon["algorithm"] == "muon"
    assert [n for n, _ in adamw["params"]] == ["embed.weight", "block.0.bias", "block.1.weight", "block.1.bias",
                                               "block.2.bias", "lm_head.weight"]
    muon, _ = checks.muon_param_groups(Net(), adamw=(), muon=("embed.weight",))
    assert [n for n, _ in muon["params"]] == ["embed.weight", "block.0.weight", "block.2.weight", "lm_head.weight"]
    with pytest.raises(ValueError, match="muon names no parameter of the model: nope"):
        checks.muon_param_groups(Net(), muon=("nope",))


def one_rank_refusals(build):
    """{case: the one line `build` (an optimizer over a param group list, on one rank) refuses it with}."""
    w, v = torch.nn.Parameter(torch.zeros(4, 3)), torch.nn.Parameter(torch.zeros(3))
    cases = {
        "the same tensor twice": [dict(params=[("a", w), ("b", w)])],
        "an empty group": [dict(params=[("a", w)]), dict(params=[], algorithm="adamw")],
        "a string lr": [dict(params=[("a", w)], lr="0.02")],
        "a bool momentum": [dict(params=[("a", w)], momentum=True)],
        "two coefficients": [dict(params=[("a", w)], ns_coefficients=(3.4445, -4.775))],
        "foreach": [dict(params=[("v", v)], algorithm="adamw", foreach=True)],
        "a project name for torch's eps": [dict(params=[("a", w)], ns_eps=1e-6)],
        "an AdamW option in a Muon group": [dict(params=[("a", w)], betas=(0.9, 0.99))],
        "a vector in a Muon group": [dict(params=[("v", v)])],
    }
    out = {}
    for case, groups in cases.items():
        try:
            build(groups)
            out[case] = None
        except ValueError as e:
            out[case] = str(e)
    return out


REFUSALS = {
    "the same tensor twice": "parameters a and b are the same tensor: ZeRO-1's layout gives each entry its own range "
                             "of the flat buffers and its own state, so it would be stepped as two parameters, not "
                             "once per entry with one state as torch's optimizers step it: pass it once (DTensorMuon "
                             "steps it as torch does)",
    "an empty group": "param group 1 (adamw) has no parameters",
    "a string lr": "param group 0 (muon): lr must be a number (got '0.02', a str)",
    "a bool momentum": "param group 0 (muon): momentum must be a number (got True, a bool)",
    "two coefficients": "param group 0: ns_coefficients must be one (a, b, c) triple, a name (jordan, "
                        "polar_express) or 5 triples, one per iteration (got (3.4445, -4.775))",
    "foreach": "param group 0 (adamw): foreach=True is refused: " + checks.REFUSED["foreach"],
    "a project name for torch's eps": "param group 0 (muon): ns_eps: not an option of torch.optim.Muon, which takes "
                                      + ", ".join(checks.TORCH_OPTIONS["muon"]),
    "an AdamW option in a Muon group": "param group 0 (muon): betas: not an option of torch.optim.Muon, which takes "
                                       + ", ".join(checks.TORCH_OPTIONS["muon"]),
    "a vector in a Muon group": "Muon only supports 2D parameters whereas we found a parameter with size: "
                                "torch.Size([3]). Muon needs 2-D parameters; v has shape (3,): put it in a group of "
                                "algorithm 'adamw' (muon_param_groups splits a model the way Muon users do)",
}


@pytest.mark.parametrize("family", ["lesson", "dtensor"])
def test_bad_constructor_arguments_are_refused_in_one_line_naming_them(single_process_group, family):
    build = ((lambda groups: distributed_muon_cpu.DistributedMuon(groups, grid=single_process_group)) if family == "lesson"
             else DTensorMuon)
    # DTensorMuon takes a tensor twice, as torch does (torch warns): tests/test_duplicate_params.py
    assert one_rank_refusals(build) == dict(REFUSALS, **{"the same tensor twice": None} if family == "dtensor" else {})
    if family == "lesson":
        with pytest.raises(ValueError, match=r"^grid must be the Grid of make_grid\(dp, tp, rank\) \(got NoneType\)$"):
            distributed_muon_cpu.DistributedMuon([torch.nn.Parameter(torch.zeros(2, 2))], grid=None)
    with pytest.raises(TypeError, match="unexpected keyword argument 'nesterow'"):
        build([torch.nn.Parameter(torch.zeros(2, 2))], **dict(nesterow=False)) if family == "dtensor" else \
            distributed_muon_cpu.DistributedMuon([torch.nn.Parameter(torch.zeros(2, 2))], grid=single_process_group,
                                                 nesterow=False)


@pytest.mark.parametrize("family", ["lesson", "dtensor"])
def test_a_group_given_as_a_generator_keeps_every_parameter(single_process_group, family):
    """torch reads a group's params once, whatever iterable they come in: model.parameters() in a group, and in
    add_param_group, keeps every tensor (a check for emptiness once used the generator up), and each steps."""
    build = ((lambda groups: distributed_muon_cpu.DistributedMuon(groups, grid=single_process_group)) if family == "lesson"
             else DTensorMuon)
    body, head = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)), torch.nn.Linear(2, 2)
    opt = build([dict(params=(p for p in body.parameters() if p.ndim == 2)),
                 dict(params=(p for p in body.parameters() if p.ndim != 2), algorithm="adamw")])
    opt.add_param_group(dict(params=head.parameters(), algorithm="adamw"))
    expected = [[body[0].weight, body[1].weight], [body[0].bias, body[1].bias], [head.weight, head.bias]]
    assert [[id(p) for p in g["params"]] for g in opt.param_groups] == [[id(p) for p in ps] for ps in expected]
    before = [p.detach().clone() for ps in expected for p in ps]
    for p in (*body.parameters(), *head.parameters()):
        p.grad = torch.ones_like(p)
    opt.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, (p for ps in expected for p in ps)))
