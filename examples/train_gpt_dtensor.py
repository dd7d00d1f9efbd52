"""Train the GPT of examples/ with FSDP2 x tensor parallel (fully_shard x parallelize_module) and DTensorMuon.

The sibling of train_gpt.py (which trains the same model with the lesson's ZeRO-1 optimizers and
its own Megatron f / g): the same text (stdlib_text), the same model and initial weights (gpt.py),
the same param groups and hyperparameters (gpt_hyperparameters.hyperparameters: Muon with match_rms_adamw
on the hidden matrices, AdamW on the embeddings, AdamW without decay on norms and biases), the same
batches and progress lines. Only the parallelism is PyTorch's own, and the optimizer is
distmuon.dtensor.DTensorMuon.

Launch recipes
--------------
    python examples/train_gpt_dtensor.py                           # 8 Gloo ranks, mesh dp=4 x tp=2
    python examples/train_gpt_dtensor.py --dp 2 --tp 2 --steps 4 --verify   # against one process of torch
    python examples/train_gpt_dtensor.py --dp 2 --tp 2 --steps 40 --save ckpt --save-step 20
    python examples/train_gpt_dtensor.py --dp 4 --tp 1 --steps 40 --resume ckpt --resume-step 20   # another mesh

What a rank does (mesh (dp, tp), rank = dp_rank * tp + tp_rank):
    model     gpt.GPT in one process's form; its Megatron layers become nn.Linear, then
              parallelize_module: qkv and fc ColwiseParallel, the two projections RowwiseParallel
              (whole heads per TP rank: qkv's rows are laid out head by head), then fully_shard
              over "dp", block by block and the root (embeddings, final norm; the head is wte, tied)
    batch     DP rank d's rows of the step's global batch (train_gpt's), the same on its TP ranks
    backward  of the mean loss: FSDP2 reduce-scatters the gradients (a mean over dp), so each
              p.grad is the total gradient with p's placements: DTensorMuon's contract
    step      DTensorMuon: Muon's matrices orthogonalized once each, by an owner among their holders
    --save / --resume: torch's recipe (dcp.save of get_model_state_dict and get_optimizer_state_dict;
              dcp.load, set_model_state_dict, set_optimizer_state_dict), on any other mesh

--verify checks the run as dtensor_verify.verify_training checks the demo's real training (with the
policy every real training here shares, muon_tools/training_checks.py): torch.optim.Muon +
AdamW fed the ranks' own total gradients replay every rank's weights bit for bit at every step (checked); at
the ranks' own weights, the one process's fp32 and float64 gradients and loss bound the ranks' (FSDP2's and
TP's sums run in another order: their error against float64 within muon_tools.REALIZED_FACTOR (4) x the one
process's plus n u, checked);
the free-running losses' gap is reported beside the chaos floor (the one process started one ulp away),
never a verdict.
The one-process model is the same nn.Linear form, unparallelized. The launcher is the lesson's
(muon_tools.spawn_ranks): Ctrl-C 130, SIGTERM 143, a failing or silent rank ends the run naming it.
"""

import os
import sys
import time
from dataclasses import dataclass, fields
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))

if __name__ == "__main__":  # first, before torch loads: Ctrl-C waits for the runner; the ranks' forkserver starts
    import muon_forkserver

    muon_forkserver.start_command()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

import muon_tools  # noqa: E402
from distmuon import dtensor  # noqa: E402
import dtensor_run  # noqa: E402
import dtensor_verify  # noqa: E402
from examples import gpt_verify  # noqa: E402
from examples import train_gpt  # noqa: E402
from examples.gpt import GPT, ColumnParallelLinear, RowParallelLinear, param_groups  # noqa: E402
from examples.gpt_hyperparameters import hyperparameters  # noqa: E402
from examples.stdlib_text import load_corpus  # noqa: E402


# =============================================================================
# 1. The configuration: train_gpt's, with the checkpoint's folders and steps
# =============================================================================
@dataclass(frozen=True)
class Config(train_gpt.TrainConfig):
    steps: int = 40
    log_every: int = 10
    save: str = ""  # a folder: torch's checkpoint after save_step
    save_step: int = 0
    resume: str = ""  # a folder: loaded before step resume_step + 1
    resume_step: int = 0
    train: bool = True  # what dtensor_verify's run_reference and verify_training read: gradients come from the model
    missing_grads: tuple = ()
    halve_grad: str = ""  # tests: this parameter's gradient halved on the last TP rank after each backward


def validate(cfg, on_disk=True):
    """train_gpt's checks (sizes, hyperparameters, the text), and the checkpoint's; ValueError, one line.
    on_disk=False: the --resume folder may not exist yet (train_many: an earlier training writes it)."""
    train_gpt.validate(cfg)
    for folder, step in (("save", "save_step"), ("resume", "resume_step")):
        if getattr(cfg, step) != getattr(Config, step) and not getattr(cfg, folder):
            raise ValueError(f"{muon_tools.flag(step)} {getattr(cfg, step)} applies to --{folder}: give the folder")
    if cfg.save and not 1 <= cfg.save_step <= cfg.steps:
        raise ValueError(f"--save-step must be in [1, --steps {cfg.steps}] (got {cfg.save_step})")
    if cfg.resume and not 0 <= cfg.resume_step < cfg.steps:
        raise ValueError(f"--resume-step must be in [0, --steps {cfg.steps}) (got {cfg.resume_step})")
    if cfg.save:  # before --resume's own check: the same folder is refused, however it holds a checkpoint
        muon_tools.check_not_input(cfg.save, "--save", {"--resume's checkpoint": cfg.resume})
    if on_disk and cfg.resume:  # the checkpoint whole, saved after --resume-step, of this model
        shapes = {n: tuple(p.shape) for n, p in plain_gpt(cfg).named_parameters()}
        muon_tools.check_checkpoint_model(cfg.resume, muon_tools.read_checkpoint(cfg.resume, cfg.resume_step), shapes,
                                  "--layers, --d-model, --heads")
    if cfg.save:
        muon_tools.check_writable(cfg.save, "--save", folder=True)  # DCP makes it, with its parents


# =============================================================================
# 2. The model in PyTorch's parallelism
# =============================================================================
def plain_gpt(cfg):
    """gpt.GPT in one process's form, its Megatron layers as nn.Linear (as_linear)."""
    return as_linear(GPT(cfg.gpt()))


def as_linear(model):
    """model (gpt.GPT or a model built on it) with its Megatron layers (ColumnParallelLinear, RowParallelLinear:
    one process's form) turned into nn.Linear holding the same weights, the form parallelize_module's styles take."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, (ColumnParallelLinear, RowParallelLinear)):
                linear = nn.Linear(child.weight.shape[1], child.weight.shape[0])
                linear.weight, linear.bias = child.weight, child.bias
                setattr(module, name, linear)
    return model


def parallelize(model, mesh):
    """TP inside each row of the mesh (Megatron's split, in DTensor's styles), then FSDP2 over dp."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = mesh["tp"]
    for block in model.blocks:
        parallelize_module(block, tp, {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                                       "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()})
        block.attn.heads = model.config.n_heads // tp.size()  # this rank's whole heads
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def build_optimizer(model, cfg, group=None):
    return dtensor.DTensorMuon(param_groups(model, *hyperparameters(cfg)), group=group)


# =============================================================================
# 3. One rank's training
# =============================================================================
def train_rank(rank, cfg, device):
    """Every rank: build, (resume,) train, (save); its losses and, for --verify, its gradients and weights."""
    from torch.distributed.device_mesh import DeviceMesh

    torch.set_num_threads(1)  # as the reference: bf16 matmul bits may depend on it
    world = cfg.dp * cfg.tp
    mesh = DeviceMesh(torch.device(device).type, torch.arange(world).view(cfg.dp, cfg.tp), mesh_dim_names=("dp", "tp"))
    group = dist.new_group(list(range(world))) if world < dist.get_world_size() else None
    if rank >= world:
        return None
    dp_rank = mesh.get_coordinate()[0]
    corpus = load_corpus()
    model = parallelize(plain_gpt(cfg).to(device), mesh)
    # where each element sits, for --verify only (another model parallelized: not part of every run's start)
    where = dtensor_run.element_places(plain_gpt(cfg), lambda m: parallelize(m, mesh), device) if cfg.keep else None
    opt = build_optimizer(model, cfg, group)
    first = 1
    if cfg.resume:
        dtensor.load_checkpoint(cfg.resume, model, opt)
        first = cfg.resume_step + 1
    losses, val, grads, weights, last = [], [], [], [], time.perf_counter()
    for step in range(first, cfg.steps + 1):
        x, y = (t.to(device) for t in corpus.batch(step, cfg.batch, cfg.context, cfg.seed, dp_rank, cfg.dp))
        if cfg.keep:
            weights.append(dtensor_run.local_params(model))
        loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
        if cfg.halve_grad and mesh.get_coordinate()[1] == cfg.tp - 1:  # tests: a wrong gradient the optimizer takes
            with torch.no_grad():
                model.get_parameter(cfg.halve_grad).grad.to_local().mul_(0.5)
        if cfg.keep:  # this rank's part of the total gradient the optimizer is given
            grads.append(dtensor_run.local_grads(model))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cfg.save and step == cfg.save_step:
            muon_tools.write_folder_atomically(cfg.save, lambda folder: dtensor.save_checkpoint(folder, model, opt),
                                               opt.axis.group)
        if step % cfg.log_every == 0 or step == cfg.steps:
            train_loss, val_loss = dp_mean(losses[-1], mesh, device), validation_loss(model, corpus, cfg, mesh,
                                                                                      dp_rank, device)
            val.append((step, val_loss))
            now = time.perf_counter()
            done = step - (val[-2][0] if len(val) > 1 else first - 1)
            if rank == 0 and cfg.progress:
                print(train_gpt.progress_line(cfg, step, train_loss, val_loss, now - last, done), flush=True)
            last = now
    named = list(model.named_parameters())
    return dict(rank=rank, first=first, losses=losses, val=val, grads=grads, weights=weights,
                params=dtensor_run.local_params(model), where=where, owners=opt.owners,
                placements={n: str(tuple(p.placements)) for n, p in named})


def dp_mean(value, mesh, device):
    """Mean of a number over the dp ranks (for printing; no part of a step)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=mesh.get_group("dp"))
    return t.item() / mesh.size(0)


@torch.no_grad()
def validation_loss(model, corpus, cfg, mesh, dp_rank, device):
    x, y = (t.to(device) for t in corpus.validation(cfg.val_windows, cfg.context, dp_rank, cfg.dp))
    loss = model(x, y).item()
    model.reshard()  # FSDP2 keeps the root's parameters whole after a forward with no backward: shard them again
    return dp_mean(loss, mesh, device)


@dataclass(frozen=True)
class Trainings:
    """Several Configs on one spawn of `dp` x `tp` ranks, one after another, each on its first ranks; body: what a
    rank runs for one of them (train_rank, or another training's, e.g. examples/train_gpt_moe.py's)."""

    configs: tuple
    dp: int
    tp: int = 1
    timeout_s: float = muon_tools.TIMEOUT_S
    body: Callable = None  # None: train_rank


def train_each(rank, trainings, device):
    results = []
    for cfg in trainings.configs:
        results.append((trainings.body or train_rank)(rank, cfg, device))
        dist.barrier()  # the next training may load what this one saved
    return results


def train_many(configs, world, body=None, check=validate):
    """[every rank's result] of each Config, from one spawn of `world` ranks; body and check: another training's
    rank and its validate (default this file's)."""
    for cfg in configs:
        check(cfg, on_disk=False)
    per_rank = muon_tools.spawn_ranks(Trainings(tuple(configs), world, timeout_s=max(c.timeout_s for c in configs),
                                        body=body), train_each)
    return [[r[i] for r in per_rank if r[i] is not None] for i in range(len(configs))]


# =============================================================================
# 4. The one-process reference (dtensor_verify.verify_training's interface)
# =============================================================================
class Reference(dtensor_verify.OneProcess):
    """torch.optim.Muon + AdamW (muon_tools.torch_optimizers, the same groups) on the plain nn.Linear GPT in one process;
    the plain model in fp32 and float64 for the loss and gradients of a whole global batch (OneProcess)."""

    CHAOS_PARAM = gpt_verify.CHAOS_PARAM  # train_gpt's chaos floor moves the same entry

    def __init__(self, cfg, device="cpu"):
        super().__init__(cfg, device)
        self.tokens_per_step = cfg.batch * cfg.context
        self.model = self.make_model()  # what the optimizers step
        self.optimizers = muon_tools.torch_optimizers([dict(g, params=[p for _, p in g["params"]])
                                               for g in param_groups(self.model, *hyperparameters(cfg))])

    def make_model(self):
        return plain_gpt(self.cfg).to(self.device)

    def global_batch(self, step):
        """(x, y) of every DP rank at `step`, concatenated in DP-rank order."""
        corpus = load_corpus()
        return (torch.cat(t) for t in zip(*(corpus.batch(step, self.cfg.batch, self.cfg.context, self.cfg.seed, d,
                                                         self.cfg.dp) for d in range(self.cfg.dp))))

    def stepped(self, name):
        return self.model.get_parameter(name)

    def weights(self):
        return {n: p.detach().to("cpu", copy=True) for n, p in self.model.named_parameters()}

    def step(self, grads, missing=()):
        for n, p in self.model.named_parameters():
            p.grad = None if n in missing else grads[n].to(self.device).clone()
        for opt in self.optimizers:
            opt.step()


def verify(cfg, results):
    """verify_training on this model: the replay bit for bit, the gradients within the derived bound, the
    free-running gap beside the chaos floor."""
    return dtensor_verify.verify_training(cfg, results, reference=Reference)


# =============================================================================
# 5. The command line
# =============================================================================
def build_parser():
    d = Config()
    p = muon_tools.OneLineParser(description="Train the GPT of examples/ on the standard library's text with "
                                            "fully_shard x parallelize_module and DTensorMuon on Gloo ranks.")
    for name, help_text in [("dp", "FSDP2 (mesh dim 'dp') size"), ("tp", "tensor-parallel (mesh dim 'tp') size"),
                            ("steps", "optimizer steps"), ("batch", "windows per step, all DP ranks"),
                            ("context", "tokens per window"), ("d_model", "model width"), ("layers", "blocks"),
                            ("heads", "attention heads"), ("seed", "of the weights and batches"),
                            ("log_every", "steps between progress lines"),
                            ("val_windows", "validation windows"), ("save_step", "the step after which --save"),
                            ("resume_step", "the step the --resume checkpoint was saved after")]:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name),
                       help=f"{help_text} (default %(default)s)")
    for name in ("lr", "weight_decay", "momentum"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name),
                       help="train_gpt's (default %(default)s)")
    p.add_argument("--save", default="", metavar="DIR", help="torch.distributed.checkpoint folder to write")
    p.add_argument("--resume", default="", metavar="DIR", help="torch.distributed.checkpoint folder to load")
    p.add_argument("--timeout", type=float, default=d.timeout_s, dest="timeout_s", metavar="SECONDS",
                   help="a rank silent this long ends the run (default %(default)s)")
    p.add_argument("--verify", action="store_true",
                   help="check against torch.optim.Muon + AdamW in one process (the replay bit for bit, gradients "
                        "within a derived bound; the free-running gap reported beside a one-ulp chaos floor)")
    p.add_argument("--traceback", action="store_true", help="on a rank's failure, print its traceback too")
    return p


def print_verification(out, print_fn=print):
    print_fn(f"Against one process (torch.optim.Muon + AdamW, the plain model on each step's whole batch of "
             f"{out['tokens_per_step']:,} tokens; FSDP2 and TP sum in other orders):")
    print_fn(dtensor_verify.training_table(out))
    print_fn(f"Result: {'PASS' if out['passed'] else 'FAIL'}")


def config_from_args(args, config=Config):
    """The Config (or a subclass's, e.g. examples/train_gpt_moe.py's) that parsed arguments describe; --verify keeps
    every rank's gradients and weights."""
    given = {f.name: getattr(args, f.name) for f in fields(config) if hasattr(args, f.name)}
    return config(**given, keep=args.verify)


def main(argv=None):
    args = build_parser().parse_args(argv)

    def work():
        cfg = config_from_args(args)
        validate(cfg)
        print(f"GPT {cfg.layers} layers x d={cfg.d_model}, {cfg.heads} heads; fully_shard x parallelize_module on "
              f"mesh dp={cfg.dp} x tp={cfg.tp}, DTensorMuon, lr {cfg.lr:g}, torch {torch.__version__}"
              + (f"; resumed from {cfg.resume} after step {cfg.resume_step}" if cfg.resume else ""), flush=True)
        t0 = time.perf_counter()
        results = muon_tools.spawn_ranks(cfg, train_rank)
        print(f"Wall time: {time.perf_counter() - t0:.1f} s")
        if not args.verify:
            return 0
        out = verify(cfg, results)
        print_verification(out)
        return 0 if out["passed"] else 1

    return muon_tools.exit_code(work, args.traceback)


if __name__ == "__main__":
    sys.exit(main())
