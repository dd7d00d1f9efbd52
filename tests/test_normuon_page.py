"""notes/14-normuon.md's NorMuon step, written out on the page as a function a reader can paste: extracted and run as
written, and held bit for bit (torch.equal, every step) to the library (DTensorMuon's NorMuon groups, in one process)
and to the suite's own reference (muon_tools.NorMuonReference), with other options than the defaults in a second
group; and the check bites: the moving average written as the paper writes it, beta2 v + (1 - beta2) x, is not the
library's bits."""

import pytest
import torch

import page_snippets
import muon_tools
from distmuon import DTensorMuon

PAGE, HEADING = "notes/14-normuon.md", "The step as computed"
MARKER = "<!-- normuon-snippet: tests/test_normuon_page.py runs this block -->"
LERP = "v.lerp_((o * o).mean(dim=-1, keepdim=True), 1 - beta2)"  # the page's step 4
STEPS = 20
SHAPES = [(24, 40), (40, 24), (32, 32)]  # wide, tall (its own lr adjustment), square
GROUPS = [dict(lr=0.02),  # the rest: the defaults, torch.optim.Muon's and the authors'
          dict(lr=0.05, weight_decay=0.01, momentum=0.9, nesterov=False, ns_steps=4, adjust_lr_fn="match_rms_adamw",
               beta2=0.9, normuon_eps=1e-8)]


def page_step(code=None):
    """normuon_step_ as the page defines it (or as `code` does)."""
    namespace = {"__name__": "normuon_page"}
    exec(compile(code or page_snippets.code_block(PAGE, HEADING, MARKER), PAGE, "exec"), namespace)
    return namespace["normuon_step_"]


def gradients(seed=0):
    """STEPS gradients for each parameter (group, shape), the same every call."""
    g = torch.Generator().manual_seed(seed)
    return [[[torch.randn(shape, generator=g) for shape in SHAPES] for _ in GROUPS] for _ in range(STEPS)]


def start():
    g = torch.Generator().manual_seed(1)
    return [[torch.randn(shape, generator=g) / 8 for shape in SHAPES] for _ in GROUPS]


def run_page(step_fn):
    """Every parameter stepped with the page's function, each group's options: the weights after each step."""
    params, states, after = start(), [[{} for _ in SHAPES] for _ in GROUPS], []
    for grads in gradients():
        for options, ps, gs, ss in zip(GROUPS, params, grads, states):
            for p, g, state in zip(ps, gs, ss):
                step_fn(p, g, state, **options)
        after.append([[p.clone() for p in ps] for ps in params])
    return after, states


def run_optimizer(make):
    """The same with an optimizer over the two groups (make(groups)): the weights after each step, and it."""
    params = start()
    opt = make([dict(params=ps, **options) for ps, options in zip(params, GROUPS)])
    after = []
    for grads in gradients():
        for ps, gs in zip(params, grads):
            for p, g in zip(ps, gs):
                p.grad = g.clone()
        opt.step()
        after.append([[p.clone() for p in ps] for ps in params])
    return after, opt


def first_difference(a, b):
    """(step, group, shape index) of the first weights that differ, or None."""
    for k, (x, y) in enumerate(zip(a, b)):
        for i, (xs, ys) in enumerate(zip(x, y)):
            for j, (p, q) in enumerate(zip(xs, ys)):
                if not torch.equal(p, q):
                    return k + 1, i, j
    return None


@pytest.fixture(scope="module")
def library():
    return run_optimizer(lambda groups: DTensorMuon([dict(g, algorithm="normuon") for g in groups]))


def test_the_pages_function_is_the_librarys_normuon_bit_for_bit(library):
    ours, states = run_page(page_step())
    theirs, opt = library
    assert first_difference(ours, theirs) is None
    assert len(ours) == STEPS and not torch.equal(ours[-1][0][0], start()[0][0])  # it moved
    for group, group_states in zip(opt.param_groups, states):  # and v, the state it adds, is the library's
        assert group["algorithm"] == "normuon"
        for p, state in zip(group["params"], group_states):
            assert torch.equal(opt.state[p]["normuon_v"].view(-1), state["normuon_v"].view(-1))


def test_the_pages_function_is_the_suites_reference(library):
    reference, _ = run_optimizer(lambda groups: muon_tools.NorMuonReference(groups))
    assert first_difference(run_page(page_step())[0], reference) is None


def test_the_papers_form_of_the_moving_average_is_not_these_bits(library):
    """The check bites where the issue was: v updated as beta2 v + (1 - beta2) x, the same in exact arithmetic,
    rounds otherwise and drifts from the library's weights."""
    code = page_snippets.code_block(PAGE, HEADING, MARKER)
    assert code.count(LERP) == 1
    paper = code.replace(LERP, "v.mul_(beta2).add_((1 - beta2) * (o * o).mean(dim=-1, keepdim=True))")
    ours, _ = run_page(page_step(paper))
    theirs, _ = library
    assert first_difference(ours, theirs) is not None
    drift = [max((p - q).abs().max().item() for xs, ys in zip(x, y) for p, q in zip(xs, ys))
             for x, y in zip(ours, theirs)]
    print("paper's form against the library, max |d| of the weights after steps 1, 5, 20:",
          drift[0], drift[4], drift[-1])
    assert drift[-1] > 0
