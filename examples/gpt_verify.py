"""examples/train_gpt.py's run against one process: the same GPT trained by torch.optim.Muon + AdamW (with the
references of --ns-blocks, --ns-coefficients and --qk-clip), fed the same micro-batches; the replay of the ranks'
own gradients, each step's gradients at the ranks' weights, and the free-running training compared."""

import torch

import distributed_muon_cpu
from distmuon import checks
from distmuon import large_runs
from distmuon import owners
import muon_tools
from muon_tools import bound_ratio, loss_drift, one_ulp_up
from examples.gpt import GPT, param_groups, qkv_row_layouts
from examples.gpt_hyperparameters import hyperparameters, set_lr
from examples.stdlib_text import load_corpus

# The reference is this GPT in one process (no grid: f and g are identities), trained
# by torch.optim.Muon + torch.optim.AdamW. Each step it runs the DP ranks'
# micro-batches one after the other and accumulates loss / DP's gradients, so it
# sees exactly the batch the ranks see. With TP > 1 it computes TP's pieces apart
# and adds them where f and g do, in rank order (gpt.py, as_tp).
# Three comparisons:
#
#   replay     torch's optimizers fed the ranks' own gradients (TP pieces
#              concatenated, summed over DP in DP-rank order) give the ranks'
#              weights: the optimizer is exact. Checked, bit for bit.
#   gradients  at every step, the one process's loss and gradient at the ranks'
#              own weights (before that step) against the ranks': the TP model
#              computes what the plain model computes. Checked.
#   trained    both runs free-running from the same start. Checked bit for bit
#              where every sum has the ranks' association; otherwise reported
#              beside the chaos floor, never a verdict (below).
#
# Tolerance policy: which bits can differ, and why
#   * Bit for bit whenever every fp32 sum has the ranks' association: TP = 1 (the
#     same matmuls on the same micro-batches) or TP's sums in rank order (below),
#     and the DP sum in DP-rank order. The lesson's Gloo reduce-scatter adds the DP
#     ranks' contributions in rank order (distributed_muon_cpu.py section 2,
#     reduce_scatter and sum_in_order), as the one process accumulates its
#     micro-batches, so on Gloo any DP is exact; NCCL's ReduceOp.SUM has its own
#     order, exact only for DP <= 2 (a + b = b + a). Then replay, gradients and the
#     trained weights and losses are all torch.equal.
#   * The replay is bit for bit on every grid where the DP sum runs in rank order,
#     TP > 1 included: the optimizer never sees TP's reordering, only the gradients.
#     (NCCL with DP > 2: its order changes the moments' last bits, which Muon turns
#     into at most a different bf16 rounding inside Newton-Schulz per step; held to
#     the lesson's BATCHED_NS_BOUND of the update's largest entry per step.)
#   * --tp-newton-schulz gram (TP > 1) sums each Gram matrix over the TP ranks inside Newton-Schulz, which
#     torch does in one bf16 matmul: the replay of every matrix it orthogonalizes is held to the lesson's
#     bound (gram_tolerance, from torch's own bf16 error on each step's Newton-Schulz input), the rest bit for bit.
#   * TP splits sums: g adds the row-parallel layers' partial products (attention-out,
#     MLP-out) over the TP ranks, f's backward the column-parallel layers' input
#     gradients, where one plain process does one long matmul. On Gloo both
#     all-reduces add every element's TP terms left to right in rank order on every
#     rank (gpt.py, tp_all_reduce: the lesson's reduce-scatter, then an all-gather),
#     and the one process computes TP's pieces apart, with the ranks' shapes, and adds
#     them in the same order (the lesson's sum_in_order; gpt.py's FanOut for x's gradient, which
#     autograd would add in its own order). So any TP is as exact as TP = 1:
#     gradients, losses, trained weights, all torch.equal (measured on 1x2 to 2x4,
#     every strategy, AdamW, lr 0.1: notes/11-training.md). NCCL's all-reduce adds in its own
#     order: TP = 2 keeps the ranks' bits there (two terms, a + b == b + a), TP > 2
#     does not.
#   * NCCL with TP > 2: each step's gradients and losses are held, against float64,
#     to the bound derived in muon_tools/training_checks.py (bound_ratio): REALIZED_FACTOR
#     x the one process's own fp32 error on the step, plus one reordered reduction,
#     n u of the largest entry, n = batch x context tokens (a micro-batch's loss: its
#     own tokens).
#     A missing all-reduce or a wrong split moves a gradient by a fraction of itself
#     (1e-1, not 1e-4): the tests break one and see it fail, on TP = 2 and TP = 4.
#   * Free-running with --tp-newton-schulz gram or NCCL's TP > 2 or DP > 2 orders, each
#     step's few different roundings change the next step's weights and so its
#     gradient, and a training amplifies any difference chaotically: one ulp on one
#     weight of the one-process run, with no distributed code at all, moves its
#     losses by as much within a few steps at lr 0.1 (figures in notes/11-training.md). So the
#     drift of the losses is reported beside that chaos floor (the
#     same one-process run with entry 0 of CHAOS_PARAM moved by one ulp), as a ratio,
#     and never fails a run: the replay and the gradients are what catch a bug.
CHAOS_PARAM = "blocks.0.attn.qkv.weight"  # the chaos floor moves its entry 0 by one ulp

# What large runs add has a reference of its own here, from the papers' equations and torch's optimizers
# (never the lesson's code): --ns-blocks, torch.optim.Muon on each block as a separate parameter (its
# rows copied out before the step and back after); --ns-coefficients polar_express, torch.optim.Muon
# with its Newton-Schulz swapped for the same torch ops taking one (a, b, c) per iteration; --qk-clip,
# after torch's step, head h's q and k rows times sqrt(min(1, tau / S_h)), S_h the largest logit of the
# step's forward over every micro-batch (the replay: over every rank's). All three are exact: the same
# ops on the same numbers, so the replay and TP = 1 stay bit for bit.

def reference_blocks(cfg, model):
    """{qkv weight name: [(row indices, a leaf tensor of those rows)]}: the matrices torch.optim.Muon sees
    apart under --ns-blocks (Q, K, V: one segment of every head; heads: each head's q, k, v alone)."""
    if cfg.ns_blocks == "whole" or cfg.optimizer != "muon":
        return {}
    g = cfg.gpt()
    hd = g.d_model // g.n_heads
    segments = [(h, s) for h in range(g.n_heads) for s in range(3)]  # the rows, head by head (gpt.Attention)
    if cfg.ns_blocks == "heads":
        groups = [[(h, s)] for h, s in segments]
    else:
        groups = [[(h, s) for h in range(g.n_heads)] for s in range(3)]
    out = {}
    for name in qkv_row_layouts(g):
        w = model.get_parameter(name)
        out[name] = []
        for group in groups:
            rows = torch.tensor([(3 * h + s) * hd + i for h, s in group for i in range(hd)], device=w.device)
            out[name].append((rows, w.detach()[rows].clone()))
    return out


class ReferenceOptimizers:
    """torch.optim.Muon + AdamW for the one-process GPT, with the reference of each --ns-blocks,
    --ns-coefficients and --qk-clip (above)."""

    def __init__(self, model, cfg):
        self.model, self.cfg, self.blocks = model, cfg, reference_blocks(cfg, model)
        groups = []
        for g in param_groups(model, *hyperparameters(cfg)):
            params = [p for n, p in g["params"] if n not in self.blocks]
            if g["algorithm"] == "muon":
                params += [t for pieces in self.blocks.values() for _, t in pieces]
            groups.append(dict(g, params=params))
        self.optimizers = muon_tools.torch_optimizers(groups)
        # one (a, b, c) per iteration swapped into torch's Newton-Schulz; Jordan's one triple leaves torch's in place
        self.coefficients = (checks.ns_coefficients_of(cfg.ns_coefficients, distributed_muon_cpu.NS_STEPS)
                             if cfg.optimizer != "adamw" and cfg.ns_coefficients != "jordan" else distributed_muon_cpu.NS_COEFFICIENTS)
        # {matrix stepped whole: its Newton-Schulz input at each step}: what bounds --tp-newton-schulz gram's replay
        self.names, self.ns_inputs = {id(p): n for n, p in model.named_parameters()}, {}

    def step(self, step, max_logits=None):
        """Step `step`; with --qk-clip, then clip by max_logits ({qkv weight name: (heads,) S})."""
        set_lr(self.optimizers, self.cfg, step)
        with torch.no_grad():
            for name, pieces in self.blocks.items():
                w = self.model.get_parameter(name)
                for rows, t in pieces:
                    t.copy_(w[rows])
                    t.grad = w.grad[rows]
            with muon_tools.torch_newton_schulz_per_iteration(self.coefficients), \
                    muon_tools.ns_inputs_recorded(self.optimizers, self.names, self.ns_inputs):
                for opt in self.optimizers:
                    opt.step()
            for name, pieces in self.blocks.items():
                w = self.model.get_parameter(name)
                for rows, t in pieces:
                    w[rows] = t
                    t.grad = None
            if self.cfg.qk_clip is not None:
                self.clip_qk_(max_logits)

    def clip_qk_(self, max_logits):
        """Kimi K2's per-head QK-clip: head h's rows of W_q and W_k each times sqrt(min(1, tau / S_h))."""
        g, tau = self.cfg.gpt(), self.cfg.qk_clip
        hd = g.d_model // g.n_heads
        for name, maxima in max_logits.items():
            w = self.model.get_parameter(name)
            for h, s in enumerate(maxima.tolist()):
                muon_tools.clip_rows_(w, slice(3 * h * hd, (3 * h + 2) * hd), s, tau)  # its q rows, then k rows


def reference_model(cfg, device):
    torch.set_num_threads(1)  # as every rank: bf16 matmul bits can depend on the thread count
    model = GPT(cfg.gpt(), as_tp=cfg.tp).to(device)  # TP's pieces apart, added in rank order (policy above)
    model.record_max_logits(cfg.qk_clip is not None)
    return model, ReferenceOptimizers(model, cfg)


def accumulate_gradients(model, cfg, step, device, max_logits=None):
    """loss / DP's gradients of DP rank 0's micro-batch, then rank 1's, ...: [loss of each micro-batch].
    max_logits: a dict to fill with each head's largest logit over the micro-batches (--qk-clip)."""
    corpus, losses = load_corpus(), []
    for d in range(cfg.dp):
        x, y = (t.to(device) for t in corpus.batch(step, cfg.batch, cfg.context, cfg.seed, d, cfg.dp))
        loss = model(x, y)
        (loss / cfg.dp).backward()  # accumulates in .grad: g_0 + g_1 + ..., in DP-rank order
        losses.append(loss.item())
        if max_logits is not None:
            for n, t in model.max_logits().items():
                max_logits[n] = torch.maximum(max_logits[n], t) if n in max_logits else t
    return losses


def ranks_max_logits(results, step):
    """{qkv weight name: (heads,)} of step (0-based): the largest over every rank's reported maxima."""
    out = {}
    for r in results:
        for n, t in r["max_logits"][step].items():
            out[n] = torch.maximum(out[n], t) if n in out else t
    return out


def reference(cfg, device="cpu", replay=None, nudge=False, replay_max_logits=None):
    """Train in one process: {"losses": [[loss of DP rank d's micro-batch] per step], "params"}.

    replay: the total gradient of every step ([{name: tensor}]) to use instead of computing one, and
    with --qk-clip replay_max_logits, the ranks' maxima of every step ([{name: (heads,)}]).
    nudge: start with entry 0 of CHAOS_PARAM one ulp larger (the chaos floor)."""
    model, optimizers = reference_model(cfg, device)
    if nudge:
        one_ulp_up(model.get_parameter(CHAOS_PARAM))
    losses = []
    for step in range(1, cfg.steps + 1):
        max_logits = {} if cfg.qk_clip is not None else None
        if replay is None:
            losses.append(accumulate_gradients(model, cfg, step, device, max_logits))
        else:
            for n, p in model.named_parameters():
                p.grad = replay[step - 1][n].to(device)
            if cfg.qk_clip is not None:
                max_logits = replay_max_logits[step - 1]
        optimizers.step(step, max_logits)
        model.zero_grad(set_to_none=True)
    return dict(losses=losses, params=snapshot(model), ns_inputs=optimizers.ns_inputs)


def param_specs(cfg):
    """The GPT's parameters as the lesson's ParamSpecs (name, global shape, TP split dim, group)."""
    full = GPT(cfg.gpt())
    split = full.tp_split_dims()
    groups = param_groups(full, {}, {}, {})
    group_of = {n: g for g, group in zip(("muon", "adamw", "adamw_no_wd"), groups) for n, _ in group["params"]}
    return [distributed_muon_cpu.ParamSpec(n, tuple(p.shape), split.get(n, -1), group_of[n]) for n,
            p in full.named_parameters()]


def full_tensors(cfg, pieces_of_rank, specs):
    """{name: full tensor} from the TP pieces of DP rank 0's row (every DP rank holds the same weights)."""
    return {s.name: torch.cat([pieces_of_rank(t)[s.name] for t in range(cfg.tp)], dim=s.tp_split_dim)
            if s.tp_split_dim >= 0 else pieces_of_rank(0)[s.name] for s in specs}


def total_gradients(cfg, results, specs):
    """[{name: full gradient summed over DP in DP-rank order}] per step, from every rank's TP pieces.

    Also the largest difference between TP ranks' copies of a replicated gradient (f and g make
    them equal, bit for bit: every TP rank runs the same ops on the same all-reduced values)."""
    by_rank = {r["rank"]: r["grads"] for r in results}
    totals, replica_diff = [], 0.0
    for step in range(cfg.steps):
        total = {}
        for d in range(cfg.dp):
            row = full_tensors(cfg, lambda t: by_rank[d * cfg.tp + t][step], specs)
            for s in specs:
                total[s.name] = row[s.name].clone() if d == 0 else total[s.name] + row[s.name]
                if s.tp_split_dim < 0:
                    copies = [by_rank[d * cfg.tp + t][step][s.name] for t in range(cfg.tp)]
                    replica_diff = max([replica_diff] + [(c - copies[0]).abs().max().item() for c in copies[1:]])
        totals.append(total)
    return totals, replica_diff


def load_weights(model, weights):
    with torch.no_grad():
        for n, w in weights.items():
            model.get_parameter(n).copy_(w)


def step_gradients(cfg, results, specs, totals, device, against_float64):
    """At each step, the one process's loss and gradients at the ranks' own weights against theirs.

    Returns the largest relative differences (losses; gradients, of the tensor's largest entry)
    and, against_float64, each side's largest error against the float64 computation and the
    largest ratio of the ranks' error to its bound (the policy's 3.: <= 1 passes)."""
    model, _ = reference_model(cfg, device)
    exact64 = GPT(cfg.gpt()).to(device).double() if against_float64 else None
    by_rank = {r["rank"]: r for r in results}
    out = dict(step_loss_max_rel_diff=0.0, grad_max_rel_diff=0.0)
    if against_float64:
        out.update(ranks_grad_err=0.0, one_process_grad_err=0.0, ranks_loss_err=0.0, one_process_loss_err=0.0,
                   bound_ratio=0.0)
    tokens = cfg.batch * cfg.context  # summed into every gradient of a step; a micro-batch's loss has / DP

    def worse(key, value):
        out[key] = max(out[key], value)

    for step in range(cfg.steps):
        weights = full_tensors(cfg, lambda t: by_rank[t]["weights"][step], specs)
        load_weights(model, weights)
        losses = accumulate_gradients(model, cfg, step + 1, device)
        ranks_losses = [by_rank[d * cfg.tp]["losses"][step] for d in range(cfg.dp)]
        worse("step_loss_max_rel_diff", max(abs(r - l) / l for r, l in zip(ranks_losses, losses)))
        for n, p in model.named_parameters():
            ref = p.grad.cpu()
            worse("grad_max_rel_diff", ((totals[step][n] - ref).abs().max() / ref.abs().max()).item())
        if against_float64:
            load_weights(exact64, weights)
            for r, l, l64 in zip(ranks_losses, losses, accumulate_gradients(exact64, cfg, step + 1, device)):
                worse("ranks_loss_err", abs(r - l64) / l64)
                worse("one_process_loss_err", abs(l - l64) / l64)
                worse("bound_ratio", bound_ratio(abs(r - l64), abs(l - l64), tokens // cfg.dp, abs(l64)))
            for n, p in model.named_parameters():
                g64 = exact64.get_parameter(n).grad.cpu()
                scale = g64.abs().max().item()
                ranks_err = (totals[step][n].double() - g64).abs().max().item()
                one_err = (p.grad.cpu().double() - g64).abs().max().item()
                worse("ranks_grad_err", ranks_err / scale)
                worse("one_process_grad_err", one_err / scale)
                worse("bound_ratio", bound_ratio(ranks_err, one_err, tokens, scale))
            exact64.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
    return out


def by_gram(cfg, spec):
    """Whether --tp-newton-schulz gram orthogonalizes this parameter with newton_schulz_tp (TP > 1, a Muon
    matrix split along its long side, not taken apart by --ns-blocks)."""
    blocked = cfg.ns_blocks != "whole" and spec.name in qkv_row_layouts(cfg.gpt())
    return (cfg.tp_newton_schulz == "gram" and cfg.tp > 1 and cfg.optimizer == "muon" and spec.group == "muon"
            and not blocked and large_runs.gram_eligible(spec.global_shape, spec.tp_split_dim))


def why_gradients_inexact(cfg, rank_order=True):
    """Why the ranks' step gradients cannot have the one process's bits ("" if they can). rank_order: the
    backend's sums add the ranks in rank order (Gloo: the lesson's reduce-scatter, gpt.tp_all_reduce)."""
    if cfg.tp > 2 and not rank_order:
        return f"TP = {cfg.tp} adds f's and g's {cfg.tp} partial sums in the backend's own order"
    return ""


def why_inexact(cfg, rank_order=True):
    """Why some fp32 sum of the run has another order than the one process's ("" if none: see
    the policy above). rank_order: the DP and TP sums add the ranks in rank order (Gloo, the lesson's)."""
    gradients = why_gradients_inexact(cfg, rank_order)
    reasons = [gradients] if gradients else []
    if cfg.dp > 2 and not rank_order:
        reasons.append(f"the backend sums over DP = {cfg.dp} in its own order")
    if any(by_gram(cfg, spec) for spec in param_specs(cfg)):
        reasons.append("--tp-newton-schulz gram sums Gram matrices over TP inside Newton-Schulz")
    return "; ".join(reasons)


def exact(cfg, rank_order=True):
    """Whether every fp32 sum happens in the same order as in one process (see the policy above)."""
    return not why_inexact(cfg, rank_order)


def replay_tolerance(cfg, spec, ns_inputs, rank_order=True):
    """What the replay may differ by (see the policy above): NCCL's DP sum over DP > 2, another order of it;
    --tp-newton-schulz gram, the Gram matrix summed over TP ranks (the lesson's gram_tolerance of the replay's
    Newton-Schulz inputs, ns_inputs: {name: [each step's]}; lr_at never exceeds cfg.lr)."""
    gram = (muon_tools.gram_tolerance(ns_inputs[spec.name], cfg.lr, "match_rms_adamw", spec.global_shape,
                                      distributed_muon_cpu.NS_STEPS,
                              cfg.ns_coefficients) if by_gram(cfg, spec) else 0.0)
    if cfg.dp <= 2 or rank_order:
        return gram
    if spec.group == "muon" and cfg.optimizer == "muon":
        return gram + muon_tools.batched_ns_tolerance(cfg.steps, cfg.lr, "match_rms_adamw", spec.global_shape)
    return cfg.steps * cfg.lr * owners.BATCHED_NS_BOUND


def verify(cfg, results, device="cpu", rank_order=True):
    """The distributed run (run with cfg.keep) against one process; returns a dict of checks.

    rank_order: whether the ranks' DP and TP sums added their terms in rank order (Gloo: yes)."""
    specs = param_specs(cfg)
    totals, replica_diff = total_gradients(cfg, results, specs)
    logits = [ranks_max_logits(results, s) for s in range(cfg.steps)] if cfg.qk_clip is not None else None
    replay = reference(cfg, device, replay=totals, replay_max_logits=logits)
    replayed = distributed_muon_cpu.check_against_torch(specs, results, replay["params"], cfg.tp)
    for c, spec in zip(replayed, specs):
        c["tolerance"] = replay_tolerance(cfg, spec, replay["ns_inputs"], rank_order)
        c["ok"] = c["identical"] or c["max_abs_diff"] <= c["tolerance"]
    inexact, gradients_inexact = why_inexact(cfg, rank_order), why_gradients_inexact(cfg, rank_order)
    checks = dict(exact=not inexact, gradients_exact=not gradients_inexact, why_inexact=inexact,
                  replay=replayed, replica_max_diff=replica_diff,
                  **step_gradients(cfg, results, specs, totals, device, against_float64=bool(gradients_inexact)))
    plain = reference(cfg, device)
    ranks_losses = [[results[d * cfg.tp]["losses"][s] for d in range(cfg.dp)] for s in range(cfg.steps)]
    checks.update(trained=distributed_muon_cpu.check_against_torch(specs, results, plain["params"], cfg.tp),
                  trained_loss_max_rel_diff=loss_drift(ranks_losses, plain["losses"]))
    if gradients_inexact:
        same_function = checks["bound_ratio"] <= 1
    else:
        same_function = checks["grad_max_rel_diff"] == checks["step_loss_max_rel_diff"] == 0
    if inexact:  # reported beside the chaos floor, never a verdict (the policy above)
        floor = loss_drift(reference(cfg, device, nudge=True)["losses"], plain["losses"])
        checks.update(chaos_floor_loss_max_rel_diff=floor,
                      chaos_ratio=checks["trained_loss_max_rel_diff"] / floor if floor else None)
        same_training = True
    else:
        same_training = checks["trained_loss_max_rel_diff"] == 0 and all(c["identical"] for c in checks["trained"])
    checks["passed"] = all(c["ok"] for c in replayed) and replica_diff == 0 and same_function and same_training
    return checks


def print_verification(cfg, checks, print_fn=print):
    n = len(checks["replay"])
    model = f"DP=1, TP's {cfg.tp} pieces computed apart" if cfg.tp > 1 else "TP=1, DP=1"
    in_order = {1: "every fp32 sum in its order",
                2: "every fp32 sum as the ranks associate it (TP = 2: the reference adds TP's two partial sums as "
                   "the ranks do, a + b = b + a)"}.get(
        cfg.tp, f"every fp32 sum as the ranks associate it (TP = {cfg.tp}: the reference adds TP's {cfg.tp} partial "
                "sums left to right in rank order, as the ranks' Gloo all-reduces do)")
    matrices = {"muon": "torch.optim.Muon + ", "normuon": "NorMuon's reference (muon_tools) + torch.optim."}
    print_fn(f"Against one process ({model}, {matrices.get(cfg.optimizer, '')}AdamW, the same micro-batches): "
             + (checks["why_inexact"] if checks["why_inexact"] else f"{in_order}, every comparison bit for bit"))
    same = sum(c["identical"] for c in checks["replay"])
    within = sum(c["ok"] and not c["identical"] for c in checks["replay"])
    print_fn(f"  replay:    torch's optimizers fed the ranks' summed gradients: {same}/{n} parameters identical"
             + (f", {within} within their derived bound (replay_tolerance: DP order, Gram sums)" if within else "")
             + (f", {n - same - within} beyond it" if n - same - within else ""))
    replicas = (f"; TP copies of replicated gradients differ by {checks['replica_max_diff']:.1e}" if cfg.tp > 1 else "")
    n_same = sum(c["identical"] for c in checks["trained"])
    if checks["gradients_exact"]:
        print_fn(f"  gradients: each step at the ranks' weights: losses within {checks['step_loss_max_rel_diff']:.1e} "
                 f"and gradients within {checks['grad_max_rel_diff']:.1e} relative{replicas}")
    else:
        print_fn(f"  gradients: each step at the ranks' weights, against float64: the ranks' within "
                 f"{checks['ranks_grad_err']:.1e} of the largest entry (losses {checks['ranks_loss_err']:.1e}), "
                 f"the one process's fp32 within {checks['one_process_grad_err']:.1e} ({checks['one_process_loss_err']:.1e}); "
                 f"{checks['bound_ratio']:.2f} of the bound at most (gpt_verify.py){replicas}")
    if checks["exact"]:
        print_fn(f"  trained:   free-running from the same start: losses of all {cfg.steps} steps within "
                 f"{checks['trained_loss_max_rel_diff']:.1e} relative; {n_same}/{n} parameters identical")
    else:
        ratio = checks["chaos_ratio"]
        worst = max(checks["trained"], key=lambda c: c["max_abs_diff"])
        print_fn(f"  trained:   free-running, reported (not checked): losses within "
                 f"{checks['trained_loss_max_rel_diff']:.1e} relative over {cfg.steps} steps; one ulp on {CHAOS_PARAM}"
                 f" moves the one-process run's by {checks['chaos_floor_loss_max_rel_diff']:.1e}: "
                 + (f"{ratio:.2g}x that chaos floor" if ratio is not None else "no chaos floor to compare with")
                 + f"; {n_same}/{n} parameters identical, largest |d| {worst['max_abs_diff']:.1e} ({worst['name']})")
    print_fn(f"Result: {'PASS' if checks['passed'] else 'FAIL'}")



def snapshot(model, grads=False):
    """{name: a CPU copy of the parameter (or of its gradient)}: what verification reads back."""
    return {n: (p.grad if grads else p).detach().cpu().clone() for n, p in model.named_parameters()}
