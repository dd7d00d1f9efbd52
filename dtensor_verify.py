"""The demo's runs against torch.optim.Muon / AdamW in one process: exact gradients bit for bit (verify), and a
real FSDP2 x TP training (verify_training: its replay bit for bit, its gradients within the bound muon_tools/training_checks.py
derives, its free-running drift beside a one-ulp chaos floor). examples/train_gpt_dtensor.py and
train_gpt_moe.py check their trainings with it too."""

import math
import statistics

import torch
import torch.nn as nn

import muon_tools
from dtensor_run import BATCH, SEQ, DemoModel, batch, exact_grads, expert_stack_names, is_muon, param_groups

class OneProcess:
    """What every one-process reference of a real training shares (this demo's Reference and the GPT's in
    examples/train_gpt_dtensor.py): the plain model's loss and gradients of a step's whole global batch at
    any weights, in fp32 (the ranks' precision) or float64 (the yardstick of verify_training's bound), and
    the chaos floor's one-ulp start. A subclass sets CHAOS_PARAM and tokens_per_step, builds make_model()
    and global_batch(step), and steps torch's optimizers: weights(), step(grads, missing), stepped(name)."""

    CHAOS_PARAM = ""  # the parameter whose entry 0 the chaos floor moves by one ulp

    def __init__(self, cfg, device="cpu"):
        torch.set_num_threads(1)  # bf16 matmul bits may depend on it: the ranks run with one thread too
        self.cfg, self.device = cfg, device
        self.plain = {}  # {dtype: the plain model in that dtype}, built at first use

    def gradients_at(self, weights, step, dtype=torch.float32):
        """(loss, {name: gradient}, on the CPU) of the whole global batch of `step`, every DP rank's tokens at
        once (one mean loss, one matmul per layer), by the plain model in `dtype` at `weights` ({name: full})."""
        if dtype not in self.plain:
            self.plain[dtype] = self.make_model().to(self.device, dtype)
        model = self.plain[dtype]
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(weights[name])
        model.zero_grad(set_to_none=True)
        loss = model(*(t.to(self.device) for t in self.global_batch(step)))
        loss.backward()
        return loss.item(), {n: p.grad.to("cpu", copy=True) for n, p in model.named_parameters()}

    def nudge(self):
        """Entry 0 of CHAOS_PARAM one ulp up, where torch's optimizers hold it: the chaos floor's start
        (muon_tools/training_checks.py)."""
        muon_tools.one_ulp_up(self.stepped(self.CHAOS_PARAM))


class Reference(OneProcess):
    """torch.optim.Muon (one 2-D tensor per matrix, per expert) + torch.optim.AdamW(foreach=False) in one process,
    from the demo's initial weights; and the plain model, for the loss and gradients of a whole batch."""

    CHAOS_PARAM = "layers.0.fc1.weight"  # the first layer's first matrix, as train_gpt's CHAOS_PARAM

    def __init__(self, cfg, device="cpu"):
        super().__init__(cfg, device)
        self.model = self.plain[torch.float32] = self.make_model()
        self.tokens_per_step = BATCH * SEQ * cfg.dp
        self.stacks = expert_stack_names(self.model)
        self.tensors = {}  # what the optimizers step: each expert of a stack its own 2-D matrix
        for name, p in self.model.named_parameters():
            self.tensors.update((key, nn.Parameter(piece.clone())) for key, piece in self.pieces(name, p.detach()))
        groups = param_groups(self.model, cfg)
        of = lambda g: [self.tensors[key] for n, p in g["params"] for key, _ in self.pieces(n, p)]
        self.optimizers = [
            (muon_tools.NorMuonReference if cfg.normuon else torch.optim.Muon)(
                of(groups[0]), lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum, nesterov=True,
                adjust_lr_fn=cfg.adjust_lr_fn),
            torch.optim.AdamW([dict(params=of(g), weight_decay=g["weight_decay"]) for g in groups[1:]], lr=cfg.lr,
                              foreach=False)]

    def make_model(self):
        return DemoModel(self.cfg).to(self.device)

    def global_batch(self, step):
        """(tokens, targets) of every DP rank at `step`, concatenated in DP-rank order."""
        return (torch.cat(t) for t in zip(*(batch(self.cfg, step, d) for d in range(self.cfg.dp))))

    def pieces(self, name, tensor):
        """[(the optimizers' name, tensor)] of a parameter (or its gradient): a stack's experts one by one."""
        if name in self.stacks:
            return [(f"{name}[{e}]", tensor[e]) for e in range(tensor.shape[0])]
        return [(name, tensor)]

    def stepped(self, name):
        """The tensor torch's optimizers step that starts with the parameter's entry 0."""
        return self.tensors[self.pieces(name, self.model.get_parameter(name))[0][0]]

    def step(self, grads, missing=()):
        """One step of both optimizers, given every full gradient {name: tensor}; the names in missing get None."""
        for name, g in grads.items():
            for key, piece in self.pieces(name, g.to(self.device)):
                self.tensors[key].grad = None if name in missing else piece.clone()
        for opt in self.optimizers:
            opt.step()

    def weights(self):
        """{name: the full parameter as the optimizers hold it now}, CPU copies."""
        return {name: torch.stack([self.tensors[key] for key, _ in self.pieces(name, p)]).detach().to("cpu")
                if name in self.stacks else self.tensors[name].detach().to("cpu", copy=True)
                for name, p in self.model.named_parameters()}


def run_reference(cfg, device="cpu", losses=None, reference=None, nudge=False):
    """{name: full parameter, on the CPU} after cfg.steps steps of torch's optimizers, fed exact_grads; with
    cfg.train, free-running instead: each step the gradient of the whole batch at its own weights (each step's
    loss appended to `losses`). reference: another model's OneProcess class (examples/train_gpt_dtensor.py).
    nudge: start with entry 0 of the reference's CHAOS_PARAM one ulp up (the chaos floor)."""
    ref = (reference or Reference)(cfg, device)
    if nudge:
        ref.nudge()
    shapes = {n: tuple(t.shape) for n, t in ref.weights().items()}
    for step in range(1, cfg.steps + 1):
        if cfg.train:
            loss, grads = ref.gradients_at(ref.weights(), step)
            if losses is not None:
                losses.append(loss)
        else:
            grads = exact_grads(shapes, cfg.seed, step)
        ref.step(grads, {n for n, s in cfg.missing_grads if s == step})
    return ref.weights()


def verify(cfg, results, reference):
    """One check per parameter: every rank's local elements against torch's at the same places (torch.equal),
    every element held by some rank, and the largest difference.

    "ok" is "identical", except that with cfg.batched_ns a Muon parameter is also ok when every element is
    held and within batched_ns_tolerance (batched Newton-Schulz need not give torch's bits); every other
    parameter must still be bit-identical. cfg may be None (no batched run: tolerance 0).
    """
    checks = []
    for name, ref in reference.items():
        flat = ref.reshape(-1)
        same = all(torch.equal(r["params"][name].reshape(-1), flat[r["where"][name]]) for r in results)
        covered = torch.zeros(flat.numel(), dtype=torch.bool)
        for r in results:
            covered[r["where"][name]] = True
        diff = max(((r["params"][name].reshape(-1) - flat[r["where"][name]]).abs().max().item()
                    if r["where"][name].numel() else 0.0) for r in results)
        batched = cfg is not None and cfg.batched_ns and is_muon(name, ref.ndim)
        # the lesson's bound, per matrix (each expert of a stack: its (out, in))
        tolerance = muon_tools.batched_ns_tolerance(cfg.steps, cfg.lr, cfg.adjust_lr_fn,
                                                    ref.shape[-2:]) if batched else 0.0
        checks.append(dict(name=name, shape=tuple(ref.shape), placements=results[0]["placements"][name],
                           identical=same and bool(covered.all()), max_abs_diff=diff,
                           optimizer="Muon" if is_muon(name, ref.ndim) else "AdamW", tolerance=tolerance,
                           ok=(same or diff <= tolerance) and bool(covered.all())))
    return checks


# A real training run (cfg.train): FSDP2 x TP forward and backward on real
# tokens, against the same model in one process on the whole batch. Checked as
# every real training of the repository is (muon_tools/training_checks.py: the
# policy, the bound and the chaos floor, shared with examples/train_gpt.py):
#
#   replay     torch's optimizers, from the same initial weights, fed the ranks'
#              own total gradients (every rank's part of every .grad before each
#              step, put together at its places: total_grads): every element
#              every rank holds is torch.equal to theirs, at every step. The
#              optimizer is exact on a real FSDP2 x TP run.
#   gradients  before each step, the plain model at the ranks' own weights takes
#              the loss and gradients of the whole global batch, in fp32 and in
#              float64: the ranks' error against float64 within muon_tools.bound_ratio's
#              bound, REALIZED_FACTOR x the one process's + n u max |G_fp64|.
#   trained    both runs free-running from the same start: the losses' largest
#              relative gap, reported beside the chaos floor (the same one-process
#              run started with entry 0 of CHAOS_PARAM one ulp up), as a ratio;
#              never a verdict.
#
# Why the gradients are not bit-identical. Four sums run in another order here
# than in the one process (the demo's step batch: BATCH x SEQ = 16 tokens per DP
# rank, 64 on the 4 x 2 mesh; the GPT's: --batch x --context):
#   * FSDP2's reduce-scatter over dp: each rank sums a weight's gradient over its
#     own tokens, then dp of those partial sums are added (and divided by dp);
#   * the reference's one matmul per layer sums all the step's tokens at once;
#   * RowwiseParallel (fc2, the GPT's projections): each TP rank sums its part
#     of the inner dimension, and the all-reduce over tp adds the partial sums;
#   * ColwiseParallel's backward (fc1, qkv, fc): the gradient of the input sums
#     over the output rows as tp partial sums, all-reduced over tp.
#   (The experts are gathered whole by full_tensor() and run the reference's own
#   einsum; every other layer is replicated over tp and sums as the reference does.)
# The bound's n is the step's tokens (one reordered reduction; FSDP2's division by
# dp is one rounding more, of at most u); a loss is the mean of the DP ranks'
# losses against the float64 loss of the whole batch, with the same n. A test
# halves one rank's gradient and sees FAIL (the replay stays exact: the optimizer
# did what it was given).


def step_errors(ref, weights, step, ranks_loss, ranks_grads):
    """At the ranks' own weights before `step`: the one process's fp32 and float64 loss and gradients against
    the ranks'. {figure: largest value}, each relative to the float64 loss or the tensor's largest float64
    entry, and bound_ratio (with where: its (step, parameter or "loss"))."""
    loss, grads = ref.gradients_at(weights, step)
    loss64, grads64 = ref.gradients_at(weights, step, torch.float64)
    n = ref.tokens_per_step
    out = dict(step_loss_max_rel_diff=abs(ranks_loss - loss) / abs(loss), ranks_loss_err=abs(ranks_loss - loss64)
               / abs(loss64), one_process_loss_err=abs(loss - loss64) / abs(loss64),
               bound_ratio=muon_tools.bound_ratio(abs(ranks_loss - loss64), abs(loss - loss64), n, abs(loss64)),
               bound_worst=(step, "loss"))
    for name, g64 in grads64.items():
        scale = g64.abs().max().item()
        ranks_err = (ranks_grads[name].double() - g64).abs().max().item()
        one_err = (grads[name].double() - g64).abs().max().item()
        figures = dict(grad_max_rel_diff=((ranks_grads[name] - grads[name]).abs().max() / grads[name].abs().max())
                       .item(), ranks_grad_err=ranks_err / scale, one_process_grad_err=one_err / scale)
        out.update((k, largest([out.get(k, 0.0), v])) for k, v in figures.items())
        ratio = muon_tools.bound_ratio(ranks_err, one_err, n, scale)
        if worse(ratio, out["bound_ratio"]):
            out.update(bound_ratio=ratio, bound_worst=(step, name))
    return out


def worse(a, b):
    """Whether figure a is worse than b: larger, or NaN where b is not (a NaN must show, and fail)."""
    return not math.isnan(b) and (math.isnan(a) or a > b)


def worst_errors(a, b):
    """Two steps' step_errors, the largest of each figure (bound_worst goes with bound_ratio)."""
    out = {k: largest([a[k], b[k]]) for k in a if k != "bound_worst"}
    out["bound_worst"] = b["bound_worst"] if worse(b["bound_ratio"], a["bound_ratio"]) else a["bound_worst"]
    return out


def replay_differs(ref, ranks, steps, first=1):
    """Feed ref (a OneProcess) the ranks' own total gradients of `steps` steps from step `first` (their grads and
    weights lists start there; params: after their last step): [(step, name)] where some rank's elements after
    that step are not torch.equal to torch's (step first - 1: the weights before step first)."""
    def ranks_at(s):  # every rank's local weights before step first + s; after the last when the list ends
        return [dict(r, params=r["weights"][s] if s < len(r["weights"]) else r["params"]) for r in ranks]

    shapes = {n: tuple(t.shape) for n, t in ref.weights().items()}
    differs = [(first - 1, c["name"]) for c in verify(None, ranks_at(0), ref.weights()) if not c["identical"]]
    for s in range(steps):
        ref.step(total_grads(ranks, s, shapes))
        differs += [(first + s, c["name"]) for c in verify(None, ranks_at(s + 1), ref.weights()) if not c["identical"]]
    return differs


def assemble(ranks, shapes):
    """{name: full tensor} put together from every rank's local elements (r["params"]) at their places."""
    full = {n: torch.full((math.prod(shape),), float("nan")) for n, shape in shapes.items()}
    for r in ranks:
        for name, local in r["params"].items():
            full[name][r["where"][name]] = local.reshape(-1)
    return {n: t.view(shapes[n]) for n, t in full.items()}


def total_grads(ranks, s, shapes):
    """{name: the total gradient of the ranks' step s (0-based in their grads lists)}: every rank's part at its
    places (the last rank's where replicas overlap; replica_gap says whether they agree)."""
    return assemble([dict(r, params=r["grads"][s]) for r in ranks], shapes)


def replica_gap(ranks, s, full):
    """The largest |d| between a rank's part of a gradient of step s and the total at its places: 0 when every
    copy of an element (the ranks a Replicate dim or a plain parameter repeats it on) is the same."""
    return largest([(r["grads"][s][n].reshape(-1) - full[n].reshape(-1)[r["where"][n]]).abs().max()
                    for r in ranks for n in full if r["where"][n].numel()])


def largest(values):
    """The largest of some numbers (or 0-d tensors), NaN if any is NaN (Python's max() may skip a NaN)."""
    return torch.tensor([float(v) for v in values] or [0.0], dtype=torch.float64).max().item()


def verify_training(cfg, results, device="cpu", reference=None):
    """The real FSDP2 x TP training (cfg.train; every rank's result) against one process, the three comparisons
    above: a dict of the figures and "passed" (the replay exact, the replicas equal, bound_ratio <= 1; the
    free-running gap only reported). reference: a OneProcess class for another model (the GPT of
    examples/train_gpt_dtensor.py); None: the demo's."""
    by_rank = {r["rank"]: r for r in results}
    ranks = [by_rank[r] for r in sorted(by_rank)]
    row_heads = [by_rank[d * cfg.tp] for d in range(cfg.dp)]  # the TP ranks of a DP row share its batch and loss
    ranks_loss = [statistics.fmean(r["losses"][s] for r in row_heads) for s in range(cfg.steps)]
    reference = reference or Reference
    ref, errors = reference(cfg, device), None
    shapes = {n: tuple(t.shape) for n, t in ref.weights().items()}
    grads = [total_grads(ranks, s, shapes) for s in range(cfg.steps)]
    replica_diff = largest([replica_gap(ranks, s, grads[s]) for s in range(cfg.steps)])
    for s in range(cfg.steps):
        weights = assemble([dict(r, params=r["weights"][s]) for r in ranks], shapes)
        step = step_errors(ref, weights, s + 1, ranks_loss[s], grads[s])
        errors = step if errors is None else worst_errors(errors, step)
    differs = replay_differs(ref, ranks, cfg.steps)  # ref's optimizers have not stepped yet
    free_losses, nudged_losses = [], []
    trained = verify(None, ranks, run_reference(cfg, device, free_losses, reference))
    run_reference(cfg, device, nudged_losses, reference, nudge=True)
    drift = muon_tools.loss_drift([[x] for x in ranks_loss],
                                  [[x] for x in free_losses])  # one loss per step: the batch's
    floor = muon_tools.loss_drift([[x] for x in nudged_losses], [[x] for x in free_losses])
    worst = max(trained, key=lambda c: c["max_abs_diff"])
    out = dict(replay_differs=differs, replica_max_diff=replica_diff, **errors, tokens_per_step=ref.tokens_per_step,
               trained_loss_max_rel_diff=drift, chaos_floor_loss_max_rel_diff=floor, chaos_param=ref.CHAOS_PARAM,
               chaos_ratio=drift / floor if floor else None, trained_identical=sum(c["identical"] for c in trained),
               trained_max_abs_diff=worst["max_abs_diff"], trained_worst=worst["name"], n_params=len(shapes),
               steps=cfg.steps)
    out["passed"] = not differs and replica_diff == 0 and out["bound_ratio"] <= 1
    return out


def training_table(out):
    """verify_training's figures for people: one row per comparison, what was measured, against what."""
    n, steps = out["n_params"], out["steps"]
    replay = (f"{n}/{n} parameters identical after each of {steps} steps" if not out["replay_differs"] else
              f"{len(out['replay_differs'])} (step, parameter) differ, first {out['replay_differs'][0]}")
    where, ratio, share = out["bound_worst"], out["chaos_ratio"], out["bound_ratio"]
    share = f"{share:.2g}" if share < 100 else f"{share:,.0f}"  # NaN: "nan" (and FAIL)
    rows = [["replay", "torch's optimizers fed the ranks' own gradients", replay, "torch.equal",
             "PASS" if not out["replay_differs"] else "FAIL"],
            ["replicas", "each rank's part of each gradient vs the total at its places, max |d|",
             f"{out['replica_max_diff']:.1e}", "0",
             "PASS" if out["replica_max_diff"] == 0 else "FAIL"],
            ["gradients", "error vs float64, of each tensor's largest entry",
             f"ranks {out['ranks_grad_err']:.1e}, one process {out['one_process_grad_err']:.1e}",
             f"{muon_tools.REALIZED_FACTOR} x one process + n u", ""],
            ["losses", "error vs float64, relative",
             f"ranks {out['ranks_loss_err']:.1e}, one process {out['one_process_loss_err']:.1e}",
             f"n = {out['tokens_per_step']:,} tokens", ""],
            ["", "largest share of the bound (step, where)", f"{share} ({where[0]}, {where[1]})",
             "<= 1", "PASS" if out["bound_ratio"] <= 1 else "FAIL"],
            ["trained", f"free-running loss gap over {steps} steps, relative",
             f"{out['trained_loss_max_rel_diff']:.1e}",
             f"chaos floor {out['chaos_floor_loss_max_rel_diff']:.1e}: {ratio:.2g}x" if ratio is not None else
             "chaos floor 0: one ulp did not reach the losses", "reported"]]
    return (muon_tools.format_table(["check", "what", "measured", "bound / baseline", "verdict"], rows,
                            ["<", "<", ">", "<", "<"])
            + f"\nchaos floor: the one-process run with entry 0 of {out['chaos_param']} one ulp up; free-running "
              f"weights: {out['trained_identical']}/{n} identical, largest |d| {out['trained_max_abs_diff']:.1e} "
              f"({out['trained_worst']})")

