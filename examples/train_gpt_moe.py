"""Train a mixture-of-experts GPT with expert parallel x FSDP2 x tensor parallel and DTensorMuon, on Gloo ranks.

The sibling of train_gpt_dtensor.py, for gpt_moe.py's model: every block's MLP is routed experts (top-2 of
softmax, 3-D expert stacks, an optional shared expert, Switch Transformer's load-balance loss, dropless).
The text, the batches, the hyperparameters and the progress lines are train_gpt's; the attention is TP as
there; the optimizer is DTensorMuon, each expert orthogonalized as its own matrix, once in the world, the
routers and embeddings with AdamW. --optimizer adamw-experts gives the expert stacks AdamW instead (Muon keeps the
attention and shared-expert matrices), --optimizer adamw gives every parameter AdamW (train_gpt's yardstick).

Launch recipes
--------------
    python examples/train_gpt_moe.py                        # 8 Gloo ranks: DP 4 (EP 2 of it) x TP 2, 4 experts
    python examples/train_gpt_moe.py --dp 2 --ep 2 --tp 2 --experts 3 --steps 4 --verify   # EP ranks of 2 and 1 experts
    python examples/train_gpt_moe.py --dp 4 --ep 2 --tp 1 --experts 7 --save ckpt --save-step 20
    python examples/train_gpt_moe.py --dp 4 --ep 4 --tp 1 --experts 7 --resume ckpt --resume-step 20  # another EP
    python examples/train_gpt_moe.py --json run.json --figure ledger.png   # the run's figures, the ledger's picture
    python examples/train_gpt_moe.py --optimizer adamw-experts --lr 0.015 --experts-lr 0.002   # AdamW on the experts
    python benchmarks/moe_optimizers.py          # the three --optimizer values, each at its best lr, over seeds

The two meshes, over the same dp x tp ranks (rank = d * tp + t for DP rank d, TP rank t; EP borrows from DP,
as torchtitan lays it out):
    dense  (dp, tp)        attention TP over "tp" (parallelize_module: qkv ColwiseParallel, proj RowwiseParallel;
                           the shared expert as gpt.py's MLP), FSDP2 over "dp": embeddings, norms, attention,
                           routers, shared expert
    moe    (edp, ep, tp)   edp = dp / ep ("expert data parallel"). The expert stacks: Shard(0) over "ep" (each EP
                           rank its torch.chunk of the experts), Replicate over "tp" (the TP ranks of a row see the
                           same tokens and hold the same experts), then FSDP2 over "edp" (dim 1 when edp divides
                           it, else the expert dim)
An EP group is ep consecutive DP ranks (the same d // ep and TP rank): their tokens meet their experts there,
over one all_to_all_single each way per layer. So an expert's gradient sums the tokens of ep DP ranks, FSDP2
over edp sums the rest, and it is divided by dp (set_gradient_divide_factor), as FSDP2 divides the dense ones.

--verify checks the run as train_gpt_dtensor.py's (dtensor_verify.verify_training, muon_tools/training_checks.py):
torch.optim.Muon on every expert as its own matrix + AdamW (torch.optim.AdamW on each whole 3-D stack where the
experts take AdamW), fed the ranks' own total gradients, replay every rank's weights bit for bit at every step;
each step's gradients and loss against float64 within the derived bound (FSDP2, TP and the all-to-all sum in
other orders; the one process takes the ranks' routing decisions, so both compute the same branch of the routed
function); the router's decisions of every token, layer and step
against the one process's own at the ranks' weights: identical, or each difference a near-tie the router
probabilities' difference explains (reported); the free-running gap beside the chaos floor, never a verdict.
Bad flags exit 2 with one line before any rank starts (a --resume checkpoint of another model or optimizer
too, read from its metadata); the launcher is the lesson's (muon_tools.spawn_ranks): Ctrl-C 130, SIGTERM 143, a failing
or silent rank ends the run naming it. There is no torchrun mode: under torchrun, rank 0 says so in one line and
every process exits 2 before anything starts.
"""

import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from functools import partial

HERE = os.path.dirname(os.path.abspath(__file__))

if __name__ == "__main__":  # first, before torch loads: Ctrl-C waits for the runner; the ranks' forkserver starts
    import muon_forkserver

    muon_forkserver.start_command()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.tensor import Replicate, Shard, distribute_tensor  # noqa: E402

import distributed_muon_cpu  # noqa: E402
from distmuon import dtensor  # noqa: E402
import dtensor_run  # noqa: E402
import dtensor_verify  # noqa: E402
import muon_tools  # noqa: E402
from examples import gpt_hyperparameters  # noqa: E402
from examples import gpt_verify  # noqa: E402
from examples import train_gpt  # noqa: E402
from examples import train_gpt_dtensor  # noqa: E402
from examples.gpt_moe import MoEConfig, MoEGPT, check_moe, experts_per_rank, muon_stacks, param_groups  # noqa: E402
from examples.stdlib_text import load_corpus  # noqa: E402


# =============================================================================
# 1. The configuration: train_gpt_dtensor's, with EP, the experts and what steps them
# =============================================================================
# --optimizer: what steps the matrices and the expert stacks (DTensorMuon either way; the routers, embeddings, norms
# and biases take AdamW in all three, as in the dense GPT). One lr serves both algorithms (Muon's adjust_lr_fn
# "match_rms_adamw", gpt_hyperparameters.hyperparameters), except that with adamw-experts --experts-lr may give the expert
# stacks their own.
OPTIMIZERS = {"muon": "Muon on every matrix, each expert its own",
              "adamw-experts": "AdamW on the expert stacks, Muon on the other matrices",
              "adamw": "AdamW on every parameter"}
OPTIMIZER_NAMES = {"muon": "Muon", "adamw": "AdamW"}  # a param group's algorithm, in words


@dataclass(frozen=True)
class Config(train_gpt_dtensor.Config):
    # optimizer: train_gpt's field, here one of OPTIMIZERS
    ep: int = 2  # EP size: divides dp
    experts: int = 4
    top_k: int = 2
    expert_hidden: int = 128
    shared_expert: bool = False
    aux_loss_weight: float = 0.01
    experts_lr: float = None  # adamw-experts: the expert stacks' AdamW lr (None: --lr, every group's)

    def moe(self):
        return MoEConfig(self.experts, self.top_k, self.expert_hidden, self.shared_expert, self.aux_loss_weight)


def dense_config(cfg):
    """cfg as the dense GPT's checks and hyperparameters read it: the optimizer of its matrices (Muon unless adamw),
    so that they refuse Muon's options (--momentum) where no matrix takes Muon, and only there."""
    return replace(cfg, optimizer="adamw" if cfg.optimizer == "adamw" else "muon")


def validate(cfg, on_disk=True):
    """train_gpt_dtensor's checks, EP's and the experts', and a --resume checkpoint's (on_disk: it exists already);
    ValueError, one line (before any rank starts)."""
    if cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZERS)} (got {cfg.optimizer!r})")
    train_gpt_dtensor.validate(dense_config(cfg), on_disk=False)  # the checkpoint: check_checkpoint, this model's
    if cfg.ep < 1 or cfg.dp % cfg.ep:
        raise ValueError(f"EP {cfg.ep} does not divide DP {cfg.dp}: an EP group is EP of the DP ranks")
    check_moe(cfg.moe(), cfg.ep)
    if cfg.experts_lr is not None and cfg.optimizer != "adamw-experts":
        raise ValueError(f"--experts-lr applies to --optimizer adamw-experts (got --optimizer {cfg.optimizer}): only "
                         f"there do the expert stacks take another algorithm than the other matrices")
    if cfg.experts_lr is not None and not (cfg.experts_lr > 0 and math.isfinite(cfg.experts_lr)):
        raise ValueError(f"--experts-lr must be > 0 and finite (got {cfg.experts_lr})")
    if on_disk and cfg.resume:
        check_checkpoint(cfg)


def check_checkpoint(cfg):
    """The --resume checkpoint against the model and optimizer this run builds, from its metadata alone (ValueError,
    one line): every parameter's shape (the expert count first), none missing or extra, and each parameter's state
    of the algorithm that will step it (Muon's momentum, AdamW's moments), as a load would need them."""
    saved = muon_tools.read_checkpoint(cfg.resume, cfg.resume_step)  # whole, and saved after --resume-step
    where = f"--resume {cfg.resume}: its checkpoint"
    model = moe_gpt(cfg)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    held = {k.removeprefix("model."): tuple(m.size) for k, m in saved.items() if k.startswith("model.")}
    stack = next(n for n, shape in shapes.items() if len(shape) == 3)
    if stack in held and held[stack][0] != cfg.experts:
        raise ValueError(f"{where} has {held[stack][0]} experts a layer ({stack} {held[stack]}), this run "
                         f"--experts {cfg.experts}: resume with --experts {held[stack][0]}")
    muon_tools.check_checkpoint_model(cfg.resume, saved, shapes, "--shared-expert, --layers")
    state = {"muon": ("momentum_buffer", "Muon's momentum"), "adamw": ("exp_avg", "AdamW's moments")}
    for g in groups(model, cfg):  # each algorithm's state exists from DTensorMuon's construction: always saved
        for name, _ in g["params"]:
            kept = [what for key, what in state.values() if f"optim.state.{name}.{key}" in saved]
            if kept != [state[g["algorithm"]][1]]:
                raise ValueError(f"{where} holds {' and '.join(kept) or 'no optimizer state'} for {name}, which this "
                                 f"run steps with {OPTIMIZER_NAMES[g['algorithm']]} (--optimizer {cfg.optimizer}): "
                                 f"resume with the --optimizer it was saved with")


# =============================================================================
# 2. The model in PyTorch's parallelism
# =============================================================================
def moe_gpt(cfg, micro_batches=1):
    """gpt_moe.MoEGPT in one process's form, its Megatron layers as nn.Linear (the form parallelize_module takes)."""
    return train_gpt_dtensor.as_linear(MoEGPT(cfg.gpt(), cfg.moe(), micro_batches))


def meshes(cfg, device):
    """The dense mesh (dp, tp) and the experts' (edp, ep, tp), over the same first dp x tp ranks (collective: every
    rank of the world creates both, a larger world's others too)."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks, kind = torch.arange(cfg.dp * cfg.tp), torch.device(device).type
    return (DeviceMesh(kind, ranks.view(cfg.dp, cfg.tp), mesh_dim_names=("dp", "tp")),
            DeviceMesh(kind, ranks.view(cfg.dp // cfg.ep, cfg.ep, cfg.tp), mesh_dim_names=("edp", "ep", "tp")))


def ep_axis(moe_mesh):
    """This rank's EP group as the lesson's Axis (what gpt_moe's exchanges send over)."""
    group = moe_mesh.get_group("ep")
    ranks = tuple(dist.get_process_group_ranks(group))
    return distributed_muon_cpu.Axis("EP", len(ranks), moe_mesh.get_local_rank("ep"), ranks, group)


def parallelize(model, dense, moe_mesh, ledger):
    """TP inside each row of the dense mesh, the experts over "ep", then FSDP2: the experts over "edp", each block
    and the root over "dp"."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp, dp = dense["tp"], dense.size(0)
    on_dim_1 = lambda p: Shard(1) if p.shape[1] % moe_mesh.size(0) == 0 else None  # FSDP2 cuts dim 1 only evenly
    for block in model.blocks:
        plan = {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel()}
        if block.mlp.shared is not None:
            plan.update({"mlp.shared.fc": ColwiseParallel(), "mlp.shared.proj": RowwiseParallel()})
        parallelize_module(block, tp, plan)
        block.attn.heads = model.config.n_heads // tp.size()  # this rank's whole heads
        experts = block.mlp.experts
        for name in ("w1", "w2"):
            w = getattr(experts, name).detach()
            setattr(experts, name, nn.Parameter(distribute_tensor(w, moe_mesh["ep", "tp"], [Shard(0), Replicate()],
                                                                  src_data_rank=None)))
        fully_shard(experts, mesh=moe_mesh["edp"], shard_placement_fn=on_dim_1)
        experts.set_gradient_divide_factor(dp)  # the mean over every DP rank's tokens, as the dense gradients
        if moe_mesh.size(0) > 1:  # a sum, then the division (Gloo has no PREMUL_SUM); on one edp rank FSDP2 divides
            experts.set_force_sum_reduction_for_comms(True)  # once by itself, and this would divide a second time
        block.mlp.ep, block.mlp.ledger = ep_axis(moe_mesh), ledger
        fully_shard(block, mesh=dense["dp"])
    fully_shard(model, mesh=dense["dp"])
    return model


def hyperparameters(cfg):
    """param_groups' hyperparameters: train_gpt's three (the matrices', the embeddings' and routers', the norms' and
    biases') and the expert stacks' own, AdamW's (at --experts-lr if given), where they leave the matrices' Muon (None:
    they stay with it)."""
    matrices, adamw, no_decay = gpt_hyperparameters.hyperparameters(dense_config(cfg))
    experts = None if cfg.optimizer == "muon" else dict(adamw, lr=cfg.experts_lr or cfg.lr)
    return matrices, adamw, no_decay, experts


def groups(model, cfg):
    """The param groups of --optimizer (the ranks' and the one process's alike)."""
    return param_groups(model, *hyperparameters(cfg))


def build_optimizer(model, cfg, group=None):
    """DTensorMuon over the groups; each expert of a stack that takes Muon is its own matrix."""
    named = groups(model, cfg)
    return dtensor.DTensorMuon(named, expert_stacks=muon_stacks(named), group=group)


def exchange_bytes(opt):
    """Bytes this rank sends and receives in a step of DTensorMuon's two all-to-alls (gather at owner, scatter from
    owner: bf16), the expert matrices apart from the rest: {kind: [sent, received]}, from its plan."""
    out = {"experts": [0, 0], "other": [0, 0]}
    for m in opt.matrices:
        kind = out["experts" if m.copy.expert_stack else "other"]
        for source, destination, numel, *_ in m.gather + m.scatter:
            if source != destination:
                kind[0] += 2 * numel * (source == opt.me)
                kind[1] += 2 * numel * (destination == opt.me)
    return out


# =============================================================================
# 3. One rank's training
# =============================================================================
def train_rank(rank, cfg, device):
    """Every rank: build, (resume,) train, (save); its losses, routing and ledgers and, for --verify, its gradients
    and weights."""
    torch.set_num_threads(1)  # as the reference: bf16 matmul bits may depend on it
    dense, moe_mesh = meshes(cfg, device)
    world = cfg.dp * cfg.tp
    group = dist.new_group(list(range(world))) if world < dist.get_world_size() else None
    if rank >= world:
        return None
    dp_rank, tp_rank = dense.get_coordinate()
    corpus, ledger = load_corpus(), distributed_muon_cpu.Ledger()
    model = parallelize(moe_gpt(cfg).to(device), dense, moe_mesh, ledger)
    # where each element sits, for --verify only (another model parallelized: not part of every run's start)
    where = dtensor_run.element_places(moe_gpt(cfg), lambda m: parallelize(m, dense, moe_mesh, distributed_muon_cpu.Ledger()),
                                       device) if cfg.keep else None
    opt = build_optimizer(model, cfg, group)
    first = 1
    if cfg.resume:
        dtensor.load_checkpoint(cfg.resume, model, opt)
        first = cfg.resume_step + 1
    out = dict(losses=[], aux=[], val=[], grads=[], weights=[], routing=[], received=[])
    last = time.perf_counter()
    for step in range(first, cfg.steps + 1):
        x, y = (t.to(device) for t in corpus.batch(step, cfg.batch, cfg.context, cfg.seed, dp_rank, cfg.dp))
        if cfg.keep:
            out["weights"].append(dtensor_run.local_params(model))
        ledger.step = step
        model.record_routing()
        loss = model(x, y)
        loss.backward()
        out["losses"].append(loss.item())
        out["aux"].append(model.aux.item())
        if cfg.halve_grad and tp_rank == cfg.tp - 1:  # tests: a wrong gradient the optimizer takes
            with torch.no_grad():
                model.get_parameter(cfg.halve_grad).grad.to_local().mul_(0.5)
        if cfg.keep:  # this rank's part of the total gradient the optimizer is given
            out["grads"].append(dtensor_run.local_grads(model))
        opt.step()
        opt.zero_grad(set_to_none=True)
        records = model.routing()
        out["received"].append([r["received"] for r in records])
        if cfg.keep:
            out["routing"].append([dict(chosen=r["chosen"], probs=r["probs"]) for r in records])
        model.record_routing(False)
        if cfg.save and step == cfg.save_step:
            muon_tools.write_folder_atomically(cfg.save, lambda folder: dtensor.save_checkpoint(folder, model, opt),
                                               opt.axis.group)
        if step % cfg.log_every == 0 or step == cfg.steps:
            log_progress(cfg, model, corpus, dense, dp_rank, device, out, step, first, last, rank == 0)
            last = time.perf_counter()
    named = list(model.named_parameters())
    split = experts_per_rank(cfg.experts, cfg.ep)
    ep_rank = dp_rank % cfg.ep
    return dict(out, rank=rank, first=first, coordinate=(dp_rank // cfg.ep, ep_rank, tp_rank),
                experts_held=(sum(split[:ep_rank]), sum(split[:ep_rank + 1])), params=dtensor_run.local_params(model),
                where=where, owners=opt.owners, ns_flops=dict(opt.ns_flops),
                expert_matrices=sorted(m.name for m in opt.matrices if m.copy.expert_stack),
                exchange=exchange_bytes(opt), ledger=asdict(opt.ledger), model_ledger=asdict(ledger),
                placements={n: str(tuple(p.placements)) for n, p in named})


def log_progress(cfg, model, corpus, dense, dp_rank, device, out, step, first, last, printing):
    """Validate (the cross-entropy alone, in eval mode, nothing counted) and print train_gpt's progress line (train:
    the cross-entropy, as val) with the load-balance loss a layer (1 when the routing is even; means over DP ranks)."""
    train_ce, aux = (train_gpt_dtensor.dp_mean(v, dense, device) for v in (model.ce.item(), out["aux"][-1]))
    model.eval()
    with model.uncounted():
        val = train_gpt_dtensor.validation_loss(model, corpus, cfg, dense, dp_rank, device)
    model.train()
    out["val"].append((step, val))
    now = time.perf_counter()
    done = step - (out["val"][-2][0] if len(out["val"]) > 1 else first - 1)
    if printing and cfg.progress:
        print(train_gpt.progress_line(cfg, step, train_ce, val, now - last,
                                      done) + f"  aux/layer {aux / cfg.layers:.3f}",
              flush=True)


def train_many(configs, world):
    """[every rank's result] of each Config, from one spawn of `world` ranks (train_gpt_dtensor's, with this rank)."""
    return train_gpt_dtensor.train_many(configs, world, body=train_rank, check=validate)


# =============================================================================
# 4. The one-process reference, and the router's decisions
# =============================================================================
class Reference(dtensor_verify.Reference):
    """torch.optim.Muon on each expert as its own matrix (the demo's Reference) + torch.optim.AdamW, with the run's
    groups (--optimizer: AdamW steps an expert stack whole, a 3-D tensor, where it takes AdamW), on the plain MoE GPT
    in one process; the plain model in fp32 and float64 for the loss and gradients of a whole global batch
    (dtensor_verify.OneProcess), its aux loss per DP rank's micro-batch, as the ranks compute it.

    routing: {step: [(N, k) expert indices per layer]}, the ranks' decisions. At weights other than its own (the
    ranks', in verify_training's gradient bound) the plain models take them, so that fp32, float64 and the ranks
    compute the same branch of the routed function (a near-tie may route differently in another precision or
    order; routing_check reports that apart); at its own weights (free-running) it routes itself."""

    CHAOS_PARAM = gpt_verify.CHAOS_PARAM  # train_gpt's chaos floor moves the same entry
    global_batch = train_gpt_dtensor.Reference.global_batch  # every DP rank's rows of the step, in DP-rank order

    def __init__(self, cfg, device="cpu", routing=None):
        dtensor_verify.OneProcess.__init__(self, cfg, device)
        self.routing, self.own = routing or {}, None
        self.model = self.plain[torch.float32] = self.make_model()
        self.tokens_per_step = cfg.batch * cfg.context
        model_groups = groups(self.model, cfg)
        self.stacks = muon_stacks(model_groups)  # split into experts (pieces); a stack that takes AdamW stays whole
        self.tensors = {key: nn.Parameter(piece.clone()) for name, p in self.model.named_parameters()
                        for key, piece in self.pieces(name, p.detach())}
        of = lambda g: [self.tensors[key] for n, p in g["params"] for key, _ in self.pieces(n, p)]
        self.optimizers = muon_tools.torch_optimizers([dict(g, params=of(g)) for g in model_groups])

    def make_model(self):
        return moe_gpt(self.cfg, micro_batches=self.cfg.dp).to(self.device)

    def weights(self):
        self.own = super().weights()
        return self.own

    def gradients_at(self, weights, step, dtype=torch.float32):
        if dtype not in self.plain:
            self.plain[dtype] = self.make_model().to(self.device, dtype)
        self.plain[dtype].force_routing(None if weights is self.own else self.routing.get(step))
        return super().gradients_at(weights, step, dtype)


def ranks_routing(cfg, results):
    """{step: [(N, k) per layer]}: every DP rank's decisions (TP rank 0's), in DP-rank order, the global batch's."""
    heads = sorted((r for r in results if r["coordinate"][2] == 0), key=lambda r: r["rank"])
    return {heads[0]["first"] + s: [torch.cat([r["routing"][s][layer]["chosen"] for r in heads])
                                    for layer in range(cfg.layers)] for s in range(len(heads[0]["routing"]))}


def routing_check(cfg, results):
    """The ranks' routing decisions against the one process's own at the ranks' weights, every step, layer and token:
    the top-k experts in order. A decision can only differ where two of the reference's first k + 1 probabilities
    are within twice the largest difference between the ranks' and its probabilities for that token (each moved by
    at most that): such a difference is a near-tie, explained; any other is a bug."""
    ranks = sorted(results, key=lambda r: r["rank"])
    heads = [r for r in ranks if r["coordinate"][2] == 0]
    replicas_agree = all(torch.equal(r["routing"][s][layer]["chosen"], heads[r["rank"] // cfg.tp]["routing"][s][layer]
                                     ["chosen"]) for r in ranks for s in range(cfg.steps) for layer in range(cfg.layers))
    ref = Reference(cfg)
    shapes = {n: tuple(t.shape) for n, t in ref.weights().items()}
    model = ref.plain[torch.float32]
    decisions, prob_diff, differ = 0, 0.0, []
    for s in range(cfg.steps):
        model.record_routing()
        ref.gradients_at(dtensor_verify.assemble([dict(r, params=r["weights"][s]) for r in ranks], shapes), s + 1)
        for layer, mine in enumerate(model.routing()):
            chosen = torch.cat([r["routing"][s][layer]["chosen"] for r in heads])
            probs = torch.cat([r["routing"][s][layer]["probs"] for r in heads])
            gap = (probs - mine["probs"]).abs().amax(-1)
            prob_diff = max(prob_diff, gap.max().item())
            decisions += chosen.shape[0]
            ranked = mine["probs"].sort(-1, descending=True).values[:, :cfg.top_k + 1]
            gaps = torch.cat([ranked[:, :-1] - ranked[:, 1:], torch.full_like(ranked[:, :1], math.inf)], -1)
            margin = gaps.amin(-1)  # inf: one expert, no decision to make
            for token in (chosen != mine["chosen"]).any(-1).nonzero().view(-1).tolist():
                differ.append(dict(step=s + 1, layer=layer, token=token, ranks=chosen[token].tolist(),
                                   one_process=mine["chosen"][token].tolist(), margin=margin[token].item(),
                                   prob_diff=gap[token].item(), near_tie=bool(margin[token] <= 2 * gap[token])))
    model.record_routing(False)
    return dict(routing_decisions=decisions, routing_differ=differ, routing_prob_max_diff=prob_diff,
                routing_replicas_agree=replicas_agree,
                routing_ok=replicas_agree and all(d["near_tie"] for d in differ))


def verify(cfg, results):
    """verify_training on this model (the replay bit for bit, the gradients within the derived bound at the
    ranks' routing, the free-running gap beside the chaos floor), and the router's decisions (routing_check)."""
    reference = partial(Reference, routing=ranks_routing(cfg, results))
    out = dtensor_verify.verify_training(cfg, results, reference=reference)
    out.update(routing_check(cfg, results))
    out["passed"] = out["passed"] and out["routing_ok"]
    return out


REFERENCE_OPTIMIZERS = {"muon": "torch.optim.Muon, each expert its own matrix, + AdamW",
                        "adamw-experts": "torch.optim.Muon + AdamW, the expert stacks AdamW's, whole",
                        "adamw": "torch.optim.AdamW on every parameter"}


def print_verification(cfg, out, print_fn=print):
    print_fn(f"Against one process ({REFERENCE_OPTIMIZERS[cfg.optimizer]}; the plain model on each step's whole batch "
             f"of {out['tokens_per_step']:,} tokens; FSDP2, TP and the all-to-all sum in other orders):")
    print_fn(dtensor_verify.training_table(out))
    n, differ = out["routing_decisions"], out["routing_differ"]
    print_fn(f"router: each token's top-k of every layer and step ({n:,} decisions) against the one process's own at "
             f"the ranks' weights: {n - len(differ):,} identical; router probabilities within "
             f"{out['routing_prob_max_diff']:.1e}; TP replicas {'agree' if out['routing_replicas_agree'] else 'DIFFER'}"
             f"  {'PASS' if out['routing_ok'] else 'FAIL'}")
    for d in differ:
        cause = "a near-tie" if d["near_tie"] else "NOT a near-tie"
        print_fn(f"  step {d['step']} layer {d['layer']} token {d['token']}: ranks {d['ranks']}, one process "
                 f"{d['one_process']}; closest probabilities {d['margin']:.1e} apart, moved by up to "
                 f"{d['prob_diff']:.1e}: {cause}")
    print_fn(f"Result: {'PASS' if out['passed'] else 'FAIL'}")


# =============================================================================
# 5. What MoE adds to the optimizer: the ledger
# =============================================================================
ACTIVATION_NUMBERS = lambda cfg: 2 * cfg.d_model + 2 * cfg.expert_hidden  # noqa: E731
# fp32 numbers an expert keeps per row it processes for the backward: the row received (d), its hidden units before
# and after GELU (2 H), its output (d), sent back; what dropless puts on the EP rank whatever the routing gives it.
CAPACITY_FACTOR = 1.25  # the usual cut of capacity-based MoEs (Switch Transformer, Fedus et al. 2021), for comparison


def summarize(cfg, results):
    """Per rank: its experts, owned expert matrices, Newton-Schulz FLOPs, optimizer exchange and token exchange bytes,
    tokens its experts processed; the balance over ranks and EP ranks; each expert orthogonalized once a step in
    the world (from the ledgers); dropless's rows and their memory."""
    ranks = sorted(results, key=lambda r: r["rank"])
    owners, flops, experts = ranks[0]["owners"], ranks[0]["ns_flops"], set(ranks[0]["expert_matrices"])
    last = ranks[0]["ledger"]["step"]
    done = [c["name"] for r in ranks for c in r["ledger"]["compute"] if c["step"] == last]
    rows_per_layer = [max(sum(layer) for step in r["received"] for layer in step) for r in ranks]
    per_rank = []
    for r in ranks:
        mine = [n for n, o in owners.items() if o == r["rank"]]
        token_bytes = sum(c["sent"] for c in r["model_ledger"]["comm"] if c["step"] == last)
        optimizer_sent = sum(c["sent"] for c in r["ledger"]["comm"] if c["step"] == last
                             and c["phase"] in ("gather at owner", "scatter from owner"))
        per_rank.append(dict(rank=r["rank"], coordinate=r["coordinate"], experts_held=r["experts_held"],
                             owned_experts=sum(n in experts for n in mine),
                             ns_flops_experts=sum(flops[n] for n in mine if n in experts),
                             ns_flops_other=sum(flops[n] for n in mine if n not in experts),
                             exchange=r["exchange"], optimizer_sent_ledger=optimizer_sent, token_bytes=token_bytes,
                             tokens=statistics.fmean(sum(layer) for step in r["received"] for layer in step)))
    # an EP rank's rows over its edp groups (other tokens), once per TP row (its TP replicas take the same rows)
    by_ep = [sum(p["tokens"] for p in per_rank if p["coordinate"][1:] == (e, 0)) for e in range(cfg.ep)]
    ns = [p["ns_flops_experts"] + p["ns_flops_other"] for p in per_rank]
    # an expert's owner is one of its holders, the ranks of its EP rank: the EP split is the experts' NS split
    ns_by_ep = [sum(p["ns_flops_experts"] for p in per_rank if p["coordinate"][1] == e) for e in range(cfg.ep)]
    per_row = 4 * ACTIVATION_NUMBERS(cfg)
    group_pairs = cfg.ep * cfg.batch // cfg.dp * cfg.context * cfg.top_k  # the pairs of one EP group, per layer
    return dict(per_rank=per_rank, expert_ns_flops=flops[min(experts)] if experts else 0,
                expert_matrices=len(experts), matrices=len(owners),
                each_once=sorted(done) == sorted(owners) and len(done) == len(owners),
                ns_balance=max(ns) / statistics.fmean(ns) if sum(ns) else 1.0, expert_ns_by_ep=ns_by_ep,
                tokens_by_ep=by_ep, token_balance=max(by_ep) / statistics.fmean(by_ep),
                rows_max=max(rows_per_layer), rows_even=group_pairs // cfg.ep, rows_worst=group_pairs,
                bytes_per_row=per_row, rows_capacity=math.ceil(CAPACITY_FACTOR * group_pairs / cfg.experts)
                * max(experts_per_rank(cfg.experts, cfg.ep)))


def print_summary(cfg, s, print_fn=print):
    kib = lambda n: muon_tools.human_bytes(n)
    rows = [[p["rank"], "{}/{}/{}".format(*p["coordinate"]), f"{p['experts_held'][0]}-{p['experts_held'][1] - 1}",
             p["owned_experts"], f"{p['ns_flops_experts'] / 1e6:.2f}", f"{p['ns_flops_other'] / 1e6:.2f}",
             kib(p["exchange"]["experts"][0]), kib(p["exchange"]["other"][0]), f"{p['tokens']:.0f}",
             kib(p["token_bytes"])] for p in s["per_rank"]]
    print_fn("\nWhat MoE adds to the optimizer (last step; per rank):")
    print_fn(muon_tools.format_table(["rank", "edp/ep/tp", "experts held", "experts owned", "NS MFLOP experts", "other",
                              "exchange sent experts", "other", "rows in/layer", "token all-to-all sent"], rows,
                             [">"] * 10))
    total = lambda kind: sum(p["exchange"][kind][0] for p in s["per_rank"])
    once = 'once in the world (the ledgers)' if s['each_once'] else 'NOT once'
    if s["expert_matrices"]:
        print_fn(f"Newton-Schulz per expert: {s['expert_ns_flops'] / 1e6:.2f} MFLOP ({cfg.expert_hidden} x "
                 f"{cfg.d_model}); {s['expert_matrices']} expert matrices ({cfg.layers} layers x 2 stacks x "
                 f"{cfg.experts}), each orthogonalized {once}; NS FLOPs max/mean over ranks {s['ns_balance']:.2f}")
        print_fn(f"Newton-Schulz of the experts per EP rank (each among the ranks holding it): "
                 f"{', '.join(f'{f / 1e6:.2f}' for f in s['expert_ns_by_ep'])} MFLOP a step")
        print_fn(f"Expert exchange (gather at owner + scatter from owner, bf16): {kib(total('experts'))} a step over "
                 f"all ranks, {total('experts') / max(1, total('experts') + total('other')):.0%} of DTensorMuon's")
    else:  # AdamW is elementwise: each rank steps its own shard of the stacks, nothing moves
        muon = (f"Newton-Schulz on the {s['matrices']} other matrices only, each orthogonalized {once}; NS FLOPs "
                f"max/mean over ranks {s['ns_balance']:.2f}" if s["matrices"] else "no Newton-Schulz at all")
        print_fn(f"The expert stacks take AdamW (--optimizer {cfg.optimizer}), on each rank's own shard: no expert "
                 f"exchange; {muon}")
    print_fn(f"Tokens per EP rank (rows its experts took, a layer, mean over steps): "
             f"{', '.join(f'{t:.0f}' for t in s['tokens_by_ep'])}; max/mean {s['token_balance']:.2f}")
    print_fn(f"Dropless: an EP rank's experts took up to {s['rows_max']} rows in one layer ({s['rows_max'] / s['rows_even']:.2f}x "
             f"the even share, {s['rows_even']}), {kib(s['rows_max'] * s['bytes_per_row'])} of activations kept for "
             f"the backward ({s['bytes_per_row']} B a row); the worst case, every pair of its EP group, "
             f"{s['rows_worst']} rows, {kib(s['rows_worst'] * s['bytes_per_row'])}; a capacity factor of "
             f"{CAPACITY_FACTOR:g} would cap it at {s['rows_capacity']} rows and drop the rest")


def plot_ledger(cfg, s, path):
    """The ledger as one picture: per rank, Newton-Schulz FLOPs and DTensorMuon's bytes sent (experts / other), and
    the rows each EP rank's experts took (a layer, mean over steps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = [p["rank"] for p in s["per_rank"]]
    fig, (ns, sent, tokens) = plt.subplots(1, 3, figsize=(14, 4))
    for ax, key, scale, unit in ((ns, "ns_flops", 1e6, "Newton-Schulz MFLOP a step"),
                                 (sent, "exchange", 1024, "DTensorMuon's exchange, KiB sent a step")):
        value = (lambda p, kind: p[f"ns_flops_{kind}"]) if key == "ns_flops" else (lambda p, kind: p[key][kind][0])
        experts = [value(p, "experts") / scale for p in s["per_rank"]]
        ax.bar(ranks, experts, label="expert matrices")
        ax.bar(ranks, [value(p, "other") / scale for p in s["per_rank"]], bottom=experts, label="other matrices")
        ax.set_xlabel("rank")
        ax.set_ylabel(unit)
        ax.legend(fontsize=8)
    tokens.bar(range(cfg.ep), s["tokens_by_ep"], color="tab:green")
    tokens.set_xticks(range(cfg.ep))
    tokens.axhline(statistics.fmean(s["tokens_by_ep"]), color="black", linestyle="--", label="mean")
    tokens.set_xlabel("EP rank (experts " + ", ".join(map(str, experts_per_rank(cfg.experts, cfg.ep))) + ")")
    tokens.set_ylabel("rows its experts took, a layer")
    tokens.legend(fontsize=8)
    fig.suptitle(f"MoE GPT: {cfg.experts} experts, top-{cfg.top_k}, DP {cfg.dp} (EP {cfg.ep}) x TP {cfg.tp}")
    fig.tight_layout()
    muon_tools.save_figure(fig, path, dpi=110)
    plt.close(fig)


# =============================================================================
# 6. The command line
# =============================================================================
def build_parser():
    p = train_gpt_dtensor.build_parser()
    p.description = ("Train a mixture-of-experts GPT on the standard library's text with expert parallel x "
                     "fully_shard x parallelize_module and DTensorMuon on Gloo ranks.")
    d = Config()
    p.add_argument("--ep", type=int, default=d.ep, help="expert-parallel size, divides --dp (default %(default)s)")
    p.add_argument("--experts", type=int, default=d.experts, help="experts per layer (default %(default)s)")
    p.add_argument("--top-k", type=int, default=d.top_k, help="experts per token (default %(default)s)")
    p.add_argument("--expert-hidden", type=int, default=d.expert_hidden, help="an expert's hidden units "
                                                                              "(default %(default)s)")
    p.add_argument("--shared-expert", action="store_true", help="gpt.py's dense MLP beside the experts, every token")
    p.add_argument("--aux-loss-weight", type=float, default=d.aux_loss_weight,
                   help="of the load-balance loss (default %(default)s, Switch Transformer's)")
    p.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default=d.optimizer,
                   help="; ".join(f"{name}{' (default)' if name == d.optimizer else ''}: {what}"
                                  for name, what in OPTIMIZERS.items())
                   + " (the routers, embeddings, norms and biases take AdamW in all three; Muon-only flags, "
                     "--momentum, are refused where no matrix takes Muon)")
    p.add_argument("--experts-lr", type=float, metavar="LR",
                   help="--optimizer adamw-experts: the expert stacks' AdamW lr (default --lr, every group's)")
    p.add_argument("--json", metavar="PATH", help="write the run's figures")
    p.add_argument("--figure", metavar="PATH", help="draw the ledger (a PNG)")
    return p


def header(cfg):
    shared = ", a shared expert" if cfg.shared_expert else ""
    return (f"MoE GPT {cfg.layers} layers x d={cfg.d_model}, {cfg.heads} heads, {cfg.experts} experts of "
            f"{cfg.expert_hidden} (top-{cfg.top_k}{shared}); DP {cfg.dp} (EP {cfg.ep}) x TP {cfg.tp} = "
            f"{cfg.dp * cfg.tp} Gloo ranks, experts per EP rank {', '.join(map(str, experts_per_rank(cfg.experts, cfg.ep)))}"
            f"; DTensorMuon: {OPTIMIZERS[cfg.optimizer]}, lr {cfg.lr:g}"
            + (f" (the experts' {cfg.experts_lr:g})" if cfg.experts_lr is not None else "")
            + f", torch {torch.__version__}"
            + (f"; resumed from {cfg.resume} after step {cfg.resume_step}" if cfg.resume else ""))


def main(argv=None):
    args = build_parser().parse_args(argv)

    def work():
        cfg = train_gpt_dtensor.config_from_args(args, Config)
        if args.verify and cfg.resume:
            raise ValueError("--verify replays the run from its initial weights: it takes no --resume")
        validate(cfg)
        for option, path in (("--json", args.json), ("--figure", args.figure)):
            if path:
                muon_tools.check_writable(path, option)
        print(header(cfg), flush=True)
        t0 = time.perf_counter()
        results = muon_tools.spawn_ranks(cfg, train_rank)
        print(f"Wall time: {time.perf_counter() - t0:.1f} s")
        summary = summarize(cfg, results)
        print_summary(cfg, summary)
        out = dict(config=asdict(cfg), torch=torch.__version__,
                   losses=[statistics.fmean(r["losses"][s] for r in results if r["coordinate"][2] == 0)
                           for s in range(len(results[0]["losses"]))], val=results[0]["val"], ledger=summary)
        if args.verify:
            print()
            checks = verify(cfg, results)
            print_verification(cfg, checks)
            out["checks"] = {k: v for k, v in checks.items() if k != "replay_differs"}
            out["passed"] = checks["passed"]
        muon_tools.write_json(args.json, out)
        if args.figure:
            plot_ledger(cfg, summary, args.figure)
        return 0 if out.get("passed", True) else 1

    return muon_tools.exit_code(work, args.traceback)


if __name__ == "__main__":
    sys.exit(main())
