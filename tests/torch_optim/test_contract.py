"""torch's optimizer contract, held by DTensorMuon on the suite's one-rank Gloo world, in tests of our own that need
no file of PyTorch's (test_torch_optim_dtensor_muon.py runs PyTorch's own tests where their file is put by hand).

What torch tests its Muon with comes from the installed torch: optim_db's Muon entry, its optim inputs (the kwargs,
"Tensor lr" among them) and its error inputs (the refusals). Every check feeds DTensorMuon and torch.optim.Muon (and
torch.optim.AdamW, for an adamw group) the same gradients and compares the parameters bit for bit (torch.equal):
  1. each optim input, several steps;            2. parameters of float32, float64, bfloat16 and float16;
  3. state_dict saved mid-run and loaded into a fresh optimizer, named <-> unnamed;
  4. copy.deepcopy and pickle of a stepped optimizer: the copy steps as torch's copy, the original stays;
  5. defaults as torch.optim.Muon's; LR schedulers drive the lr as they drive torch's;
  6. each error input refused as torch refuses it (its type and words), before anything moves.
KNOWN_GAPS lists the cases DTensorMuon does not hold yet, each with its cause (README.md beside this file says more
of each cause and its fix).
"""

import copy
import pickle
import re
import sys
import types
import unittest
import warnings

import pytest
import torch
from torch.optim import lr_scheduler

from distmuon import DTensorMuon


def optim_db_muon():
    """optim_db's Muon entry. torch's test helpers import expecttest for expect-file asserts no check here makes;
    where it is not installed, a stand-in serves this one import and is removed after it (so that the upstream
    harness still sees it absent)."""
    try:
        import expecttest  # noqa: F401
        stand_in = False
    except ImportError:
        stand_in = True
        sys.modules["expecttest"] = types.ModuleType("expecttest")
        sys.modules["expecttest"].TestCase = unittest.TestCase
    try:
        from torch.testing._internal import common_optimizers
    finally:
        if stand_in:
            sys.modules.pop("expecttest")
    entry = next(info for info in common_optimizers.optim_db if info.name == "Muon")
    return entry, common_optimizers.OptimizerErrorEnum


MUON_ENTRY, ERROR_ON = optim_db_muon()


def ident(desc):
    return re.sub(r"\W+", "_", desc).strip("_")


def optim_inputs():
    """{id: kwargs} of the entry's optim inputs, made anew (a Tensor lr is filled in place by schedulers)."""
    return {ident(i.desc): i.kwargs for i in MUON_ENTRY.optim_inputs_func("cpu")}


def error_inputs():
    """{id: ErrorOptimizerInput} of the entry, made anew from one seed (its parameters come from torch.randn)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return {ident(e.optimizer_error_input.desc): e
                for e in MUON_ENTRY.optim_error_inputs_func(device="cpu", dtype=torch.float32)}


# The parameters: a tall and a wide matrix (the lr adjustments differ by shape) for Muon, a vector for AdamW.
MUON_SHAPES = {"tall.weight": (8, 5), "wide.weight": (4, 12)}
ADAMW_SHAPES = {"bias": (8,)}
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)  # an adamw group's own options
STEPS = 3


# torch's LR schedulers, each made for an optimizer (test_scheduler gives ReduceLROnPlateau a loss that never improves)
SCHEDULERS = {
    "StepLR": lambda opt: lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    "LambdaLR": lambda opt: lr_scheduler.LambdaLR(opt, lambda epoch: 0.8 ** epoch),
    "OneCycleLR": lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=0.02, total_steps=2 * STEPS, cycle_momentum=False),
    "OneCycleLR_momentum": lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=0.02, total_steps=2 * STEPS,
                                                              base_momentum=0.8, max_momentum=0.9),
    "CyclicLR": lambda opt: lr_scheduler.CyclicLR(opt, base_lr=1e-3, max_lr=1e-2, step_size_up=2, cycle_momentum=False),
    "CyclicLR_momentum": lambda opt: lr_scheduler.CyclicLR(opt, base_lr=1e-3, max_lr=1e-2, step_size_up=2,
                                                          base_momentum=0.8, max_momentum=0.9),
    "ReduceLROnPlateau": lambda opt: lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0),
}

# Each case here is held to failing (xfail, strict): one that passes fails the run until its line goes, so this
# dict shrinks as fixes land and ends empty.
KNOWN_GAPS = {}  # {case: why DTensorMuon does not hold it yet: where in distmuon}
CASES = set()  # every test[id] parametrized below: a gap naming none is a stale line


def cases(test, ids_values):
    """pytest.param for each (id, values), a known gap marked xfail(strict=True) with its cause."""
    out = []
    for id_, values in ids_values:
        key = f"{test}[{id_}]"
        CASES.add(key)
        marks = [pytest.mark.xfail(strict=True, reason=KNOWN_GAPS[key])] if key in KNOWN_GAPS else []
        out.append(pytest.param(*values, id=id_, marks=marks))
    return out


def gap(test):
    """A test without parameters, marked as cases() marks one."""
    CASES.add(test)
    return pytest.mark.xfail(strict=True, reason=KNOWN_GAPS[test]) if test in KNOWN_GAPS else (lambda f: f)


@pytest.fixture(scope="module", autouse=True)
def one_rank_world(single_process_group):
    """DTensorMuon runs on the suite's one-rank Gloo world (tests/conftest.py), made once per session."""


def values(shape, seed, dtype):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def start(dtype=torch.float32, adamw=False):
    """Two equal sets of starting parameters, {name: tensor}: DTensorMuon's and torch's."""
    shapes = dict(MUON_SHAPES, **(ADAMW_SHAPES if adamw else {}))
    return [{name: values(shape, i, dtype) for i, (name, shape) in enumerate(shapes.items())} for _ in range(2)]


def fresh(kwargs):
    """The kwargs with a tensor of their own (a scheduler fills a Tensor lr in place)."""
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in kwargs.items()}


def ours(params, kwargs=None, adamw=None, named=True):
    """DTensorMuon over params ({name: tensor}): the matrices in a Muon group, the rest in an adamw group."""
    pick = lambda shapes: [(n, p) if named else p for n, p in params.items() if n in shapes]
    groups = [dict(params=pick(MUON_SHAPES))]
    if any(n in ADAMW_SHAPES for n in params):
        groups.append(dict(params=pick(ADAMW_SHAPES), algorithm="adamw", **fresh(adamw or ADAMW)))
    return DTensorMuon(groups, **fresh(kwargs or {}))


def theirs(params, kwargs=None, adamw=None):
    """torch.optim.Muon over the matrices and torch.optim.AdamW over the rest: the reference."""
    opts = [torch.optim.Muon([p for n, p in params.items() if n in MUON_SHAPES], **fresh(kwargs or {}))]
    if any(n in ADAMW_SHAPES for n in params):
        opts.append(torch.optim.AdamW([p for n, p in params.items() if n in ADAMW_SHAPES], **fresh(adamw or ADAMW)))
    return opts


def run(optimizers, params, first, count=STEPS):
    """Steps first .. first + count - 1 of every optimizer over params (a list, in the order of the names): each
    step's gradients from its index and the parameter's position, so that every run is fed the same."""
    for step in range(first, first + count):
        for i, p in enumerate(params):
            p.grad = values(p.shape, 1000 + 100 * step + i, p.dtype)
        for opt in optimizers:
            opt.step()


def assert_same_bits(got, want, what="parameter", whose="torch's"):
    """Lists of tensors equal bit for bit, else each difference named: which, how many elements, the largest."""
    assert len(got) == len(want), f"{len(got)} {what}s against {whose} {len(want)}"
    diffs = []
    for i, (g, w) in enumerate(zip(got, want)):
        if g.dtype != w.dtype or g.shape != w.shape:
            diffs.append(f"{what} {i}: {g.dtype} {tuple(g.shape)}, {whose} {w.dtype} {tuple(w.shape)}")
        elif not torch.equal(g, w):
            delta = (g.double() - w.double()).abs()
            diffs.append(f"{what} {i}: {int((g != w).sum())} of {g.numel()} elements differ, "
                         f"by up to {delta.max():.3g}")
    assert not diffs, f"not {whose} bits: " + "; ".join(diffs)


def group_params(optimizers):
    return [p for opt in optimizers for group in opt.param_groups for p in group["params"]]


# -- 1, 2: torch's inputs and dtypes -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", cases("test_optim_input", [(i, (k,)) for i, k in optim_inputs().items()]))
def test_optim_input(kwargs):
    """Each optim input of optim_db's Muon entry: STEPS steps, torch.optim.Muon's bits."""
    mine, torchs = start()
    run([ours(mine, kwargs)], list(mine.values()), 0)
    run(theirs(torchs, kwargs), list(torchs.values()), 0)
    assert_same_bits(list(mine.values()), list(torchs.values()))


@pytest.mark.parametrize("adamw", cases("test_adamw_group", [
    ("float_lr", (ADAMW,)), ("tensor_lr", (dict(ADAMW, lr=torch.tensor(ADAMW["lr"])),))]))
def test_adamw_group(adamw):
    """A Muon group beside an adamw group: torch.optim.Muon's and torch.optim.AdamW's bits."""
    mine, torchs = start(adamw=True)
    run([ours(mine, adamw=adamw)], list(mine.values()), 0)
    run(theirs(torchs, adamw=adamw), list(torchs.values()), 0)
    assert_same_bits(list(mine.values()), list(torchs.values()))


@pytest.mark.parametrize("dtype, adamw", cases("test_dtype", [
    (f"{str(d).split('.')[1]}-{g}", (d, g == "muon_adamw"))
    for d in (torch.float32, torch.float64, torch.bfloat16, torch.float16) for g in ("muon", "muon_adamw")]))
def test_dtype(dtype, adamw):
    """Parameters (and gradients) of each floating dtype, stepped as torch steps them."""
    mine, torchs = start(dtype, adamw)
    run([ours(mine)], list(mine.values()), 0)
    run(theirs(torchs), list(torchs.values()), 0)
    assert_same_bits(list(mine.values()), list(torchs.values()))


# -- 3: state_dict -----------------------------------------------------------------------------------------------------

def resume(kwargs, named_before, named_after):
    """DTensorMuon stepped, saved, loaded into a fresh one (over the same tensors) that steps on: its parameters and
    the saved-then-loaded state dict's param_names, and torch's (uninterrupted, and the same load done by torch)."""
    mine, torchs = start(adamw=True)
    before = ours(mine, kwargs, named=named_before)
    run([before], list(mine.values()), 0)
    saved = copy.deepcopy(before.state_dict())
    after = ours(mine, kwargs, named=named_after)
    after.load_state_dict(saved)
    run([after], list(mine.values()), STEPS)
    run(theirs(torchs, kwargs), list(torchs.values()), 0, 2 * STEPS)
    # torch's own load between the same namings (on tensors of its own), for the param_names it keeps
    loaded, probe = [], start(adamw=True)[0]
    for algorithm, shapes in (("muon", MUON_SHAPES), ("adamw", ADAMW_SHAPES)):
        cls = torch.optim.Muon if algorithm == "muon" else torch.optim.AdamW
        options = fresh(kwargs) if algorithm == "muon" else fresh(ADAMW)
        params = lambda named: [(n, p) if named else p for n, p in probe.items() if n in shapes]
        opt = cls(params(named_before), **options)
        run([opt], [p for n, p in probe.items() if n in shapes], 0, 1)
        again = cls(params(named_after), **options)
        again.load_state_dict(copy.deepcopy(opt.state_dict()))
        loaded.append(again.state_dict()["param_groups"][0].get("param_names"))
    return mine, torchs, [g.get("param_names") for g in after.state_dict()["param_groups"]], loaded


@pytest.mark.parametrize("named_before, named_after", cases("test_state_dict_resume", [
    (f"{'named' if a else 'unnamed'}-{'named' if b else 'unnamed'}", (a, b))
    for a in (True, False) for b in (True, False)]))
def test_state_dict_resume(named_before, named_after):
    """Saved after STEPS steps and loaded into a fresh optimizer (named or not, either side), which steps STEPS more:
    the uninterrupted torch run's bits, and the param_names torch's optimizers keep after the same load."""
    mine, torchs, names, torch_names = resume({}, named_before, named_after)
    assert_same_bits(list(mine.values()), list(torchs.values()))
    assert names == torch_names, f"param_names after the load: {names}; torch's: {torch_names}"


@gap("test_state_dict_resume_tensor_lr")
def test_state_dict_resume_tensor_lr():
    """The same with optim_db's Tensor lr: the loaded lr steps on as torch's does."""
    mine, torchs, _, _ = resume(optim_inputs()["Tensor_lr"], True, True)
    assert_same_bits(list(mine.values()), list(torchs.values()))


# -- 4: deepcopy and pickle --------------------------------------------------------------------------------------------

COPIERS = {"deepcopy": copy.deepcopy, "pickle": lambda obj: pickle.loads(pickle.dumps(obj))}


@pytest.mark.parametrize("copier", cases("test_copy", [(name, (name,)) for name in COPIERS]))
def test_copy(copier):
    """A stepped optimizer copied with its parameters (as torch's deepcopy and pickling tests do): the copy steps on as
    torch's copy does, on tensors of its own; the original is left as it was."""
    mine, torchs = start(adamw=True)
    original = ours(mine)
    run([original], list(mine.values()), 0)
    torch_originals = theirs(torchs)
    run(torch_originals, list(torchs.values()), 0)
    kept = [p.clone() for p in mine.values()]
    clone = COPIERS[copier](original)
    torch_clones = [COPIERS[copier](opt) for opt in torch_originals]
    assert not {id(p) for p in group_params([clone])} & {id(p) for p in mine.values()}, "the copy shares parameters"
    run([clone], group_params([clone]), STEPS)
    run(torch_clones, group_params(torch_clones), STEPS)
    assert_same_bits(group_params([clone]), group_params(torch_clones))
    assert_same_bits(list(mine.values()), kept, "original parameter", "the copied")


# -- 5: defaults and LR schedulers -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", cases("test_defaults", [(i, (k,)) for i, k in optim_inputs().items()]))
def test_defaults(kwargs):
    """defaults holds torch.optim.Muon's (each key, its value) for each optim input, and beside them only options of
    torch.optim.AdamW (an adamw group's)."""
    mine, torchs = start()
    got, want = ours(mine, kwargs).defaults, theirs(torchs, kwargs)[0].defaults
    same = lambda a, b: torch.equal(a, b) if torch.is_tensor(a) and torch.is_tensor(b) else (
        not torch.is_tensor(a) and not torch.is_tensor(b) and a == b)
    wrong = {k: (got.get(k, "absent"), v) for k, v in want.items() if k not in got or not same(got[k], v)}
    assert not wrong, f"defaults differ from torch.optim.Muon's ({{key: (ours, torch's)}}): {wrong}"
    extra = set(got) - set(want) - set(torch.optim.AdamW(list(torchs.values())).defaults)
    assert not extra, f"defaults holds keys neither torch.optim.Muon's nor AdamW's: {sorted(extra)}"


def scheduled(optimizer, params, scheduler):
    """2 * STEPS steps, the scheduler stepped after each; the (lr, momentum) of the first group at every step."""
    sched = SCHEDULERS[scheduler](optimizer)
    seen = []
    for step in range(2 * STEPS):
        group = optimizer.param_groups[0]
        seen.append((float(group["lr"]), group["momentum"]))
        run([optimizer], params, step, 1)
        sched.step(float(step)) if scheduler == "ReduceLROnPlateau" else sched.step()
    return seen


@pytest.mark.parametrize("scheduler, lr", cases("test_scheduler", [
    (f"{s}-{kind}", (s, lr)) for s in SCHEDULERS
    for kind, lr in (("float_lr", 0.01), ("tensor_lr", torch.tensor(0.01)))]))
def test_scheduler(scheduler, lr):
    """torch's LR schedulers drive DTensorMuon's lr (and momentum, where they cycle it) as torch.optim.Muon's: the same
    values at every step, and torch's bits."""
    mine, torchs = start()
    got = scheduled(ours(mine, dict(lr=lr)), list(mine.values()), scheduler)
    want = scheduled(theirs(torchs, dict(lr=lr))[0], list(torchs.values()), scheduler)
    assert len({lr for lr, _ in want}) > 1, f"{scheduler} left torch's lr as it was: this case checks nothing"
    assert got == want, f"(lr, momentum) at each step: {got}; torch's: {want}"
    assert_same_bits(list(mine.values()), list(torchs.values()))


# -- 6: refusals -------------------------------------------------------------------------------------------------------

def tensors_in(params):
    """Every tensor an error input's params hold (a tensor, (name, tensor) pairs, param groups)."""
    if torch.is_tensor(params):
        return [params]
    if isinstance(params, dict):
        return tensors_in(params["params"])
    if isinstance(params, tuple) and len(params) == 2 and isinstance(params[0], str):
        return [params[1]]
    return [t for item in params or () for t in tensors_in(item)]


def snapshot(tensors):
    return [t.detach().clone() for t in tensors] + [t.grad.clone() for t in tensors if t.grad is not None]


def state_snapshot(optimizer):
    return [t.clone() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]


def refusal(optimizer_class, error):
    """What optimizer_class does with the error input, as torch's test_errors drives it (constructed; stepped where
    the entry says the step refuses it): (where it was refused: "construction", "step" or None; the exception type;
    its words, or the warnings'; the optimizer where one was built; its state before the refused step)."""
    params, kwargs = error.optimizer_error_input.params, error.optimizer_error_input.kwargs
    opt, state, stage = None, None, "construction"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            opt = optimizer_class(params, **kwargs)
            if error.error_on == ERROR_ON.STEP_ERROR:
                stage, state = "step", state_snapshot(opt)
                opt.step()
        except Exception as e:  # noqa: BLE001  (any type: compared with torch's below)
            return stage, type(e), str(e), opt, state
    warned = " | ".join(str(w.message) for w in caught if issubclass(w.category, error.error_type))
    return None, None, warned, opt, state


@pytest.mark.parametrize("desc", cases("test_error_input", [(i, (i,)) for i in error_inputs()]))
def test_error_input(desc):
    """Each error input of optim_db's Muon entry, refused as torch.optim.Muon refuses it: at construction or at the
    step, the same exception type and torch's words (or, for a warning, the warning and the same steps after it);
    nothing it was given changed, and a refused step left the optimizer's state as it was."""
    error = error_inputs()[desc]
    given = tensors_in(error.optimizer_error_input.params)
    before = snapshot(given)
    stage, kind, words, opt, state = refusal(DTensorMuon, error)
    torch_stage, torch_kind, torch_words, torch_opt, _ = refusal(torch.optim.Muon, error_inputs()[desc])
    warning = issubclass(error.error_type, Warning)
    assert torch_kind is (None if warning else error.error_type) and re.search(error.error_regex, torch_words), \
        f"torch.optim.Muon no longer does what optim_db says: {torch_kind} {torch_words!r}"
    assert (stage, kind) == (torch_stage, torch_kind), \
        f"refused at {stage}: {kind} ({words}); torch's at {torch_stage}: {torch_kind} ({torch_words})"
    assert re.search(error.error_regex, words), f"our words {words!r} lack torch's {error.error_regex!r}"
    assert_same_bits(snapshot(given), before, "given tensor (or its grad)", "the input's")
    if state is not None:
        assert_same_bits(state_snapshot(opt), state, "state tensor", "the pre-step state's")
    if warning:  # accepted with torch's warning: it steps as torch's does
        mine, torch_params = group_params([opt]), group_params([torch_opt])
        run([opt], mine, 0)
        run([torch_opt], torch_params, 0)
        assert_same_bits(mine, torch_params)


STEP_ERRORS = [i for i, e in error_inputs().items() if e.error_on == ERROR_ON.STEP_ERROR]


@pytest.mark.parametrize("desc", cases("test_refused_step_moves_nothing", [(i, (i,)) for i in STEP_ERRORS]))
def test_refused_step_moves_nothing(desc):
    """A step error of the entry, its parameters in a second group beside a stepped Muon group: refused as torch
    refuses it (torch has stepped the first group by then; DTensorMuon moves nothing), and once their gradients are
    gone the optimizer steps on as torch.optim.Muon over the first group alone, never having seen the refused step."""
    error = error_inputs()[desc]
    bad, kwargs = tensors_in(error.optimizer_error_input.params), error.optimizer_error_input.kwargs
    bad_grads = [t.grad for t in bad]
    mine, torchs = start()
    opt = DTensorMuon([dict(params=list(mine.values())), dict(params=bad, **kwargs)])
    reference = torch.optim.Muon(list(torchs.values()))
    for t in bad:
        t.grad = None
    run([opt], list(mine.values()), 0, 1)
    run([reference], list(torchs.values()), 0, 1)
    for t, g in zip(bad, bad_grads):
        t.grad = g
    before, state = snapshot(list(mine.values()) + bad), state_snapshot(opt)
    with pytest.raises(error.error_type, match=error.error_regex):
        opt.step()
    assert_same_bits(snapshot(list(mine.values()) + bad), before, "parameter (or its grad)", "the pre-step")
    assert_same_bits(state_snapshot(opt), state, "state tensor", "the pre-step state's")
    for t in bad:
        t.grad = None
    run([opt], list(mine.values()), 1, 1)
    run([reference], list(torchs.values()), 1, 1)
    assert_same_bits(list(mine.values()), list(torchs.values()))


# -- the checks themselves ---------------------------------------------------------------------------------------------

def test_the_bit_check_sees_one_ulp():
    """torch's run nudged by one ulp in one element fails the comparison every check above makes."""
    mine, torchs = start()
    run([ours(mine)], list(mine.values()), 0)
    run(theirs(torchs), list(torchs.values()), 0)
    assert_same_bits(list(mine.values()), list(torchs.values()))
    nudged = [t.clone() for t in torchs.values()]
    nudged[1].view(-1)[7] = torch.nextafter(nudged[1].view(-1)[7], torch.tensor(float("inf")))
    with pytest.raises(AssertionError, match="parameter 1: 1 of 48 elements differ"):
        assert_same_bits(list(mine.values()), nudged)


def test_the_known_gaps_name_cases():
    """A gap that names no case here is a stale line."""
    stale = sorted(set(KNOWN_GAPS) - CASES)
    assert not stale, f"KNOWN_GAPS names no case of this file: {stale}"
