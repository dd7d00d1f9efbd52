"""DTensorMuon at the sizes people train: what building it and stepping it cost, beside microsoft/dion's Muon and
torch.optim.Muon, and the plan alone at Llama 3's sizes.

A model of blocks of two bias-free linears (d x 4d, 4d x d; 8 blocks: 67 M parameters at d = 1024, 268 M at 2048,
1.07 B at 4096; --blocks 32: as many parameters in 32 blocks of d / 2, each matrix a quarter of the size, a model as
deep as Llama 3 8B's 32 layers: its largest matrix 1/64 of the parameters, not 1/16) on Gloo ranks, a mesh dp x tp:
TP (ColwiseParallel, RowwiseParallel) inside each block where tp > 1, FSDP2 (fully_shard per block and at the root)
over dp where dp > 1. Each rank builds the model on the meta device and materializes its own shards only, computes
one gradient, warms up (warm_up), then, for each optimizer in turn (in one process, the others' memory freed): its
construction (seconds), the peak RSS over the model's (the model, its
gradients) through construction and through the first step, what construction keeps (RSS after it, over the
model's) and the state it holds, then its first step and the median of its steady steps, with Newton-Schulz and
without it (replaced by its bf16 cast, for every optimizer alike). torch.optim.Muon takes whole tensors: it runs
on a world of one (mesh 1 x 1), the model whole in one process. dion (not on the package registry:
benchmarks/requirements-peers.txt) runs where it is installed and its mesh is 1-D; else its row says why.
"DTensorMuon groups" and "DTensorMuon overlap" are DTensorMuon with exchange_bytes (and overlap): its step group by
group, the first step's transient memory bounded by a group (notes/measured/dtensor_groups_2core.md). "DTensorMuon
per owner" is exchange_bytes="one_per_owner": groups in which each owner has one matrix, every owner at work in each.

    python benchmarks/at_scale.py --size 67M                  # every optimizer, meshes 1x1 2x1 1x2 2x2 (1 to 4 ranks)
    /work/peers-venv/bin/python benchmarks/at_scale.py --size 1B --mesh 2x1   # with dion: 1.07 B parameters, 2 ranks
    python benchmarks/at_scale.py --size 268M --mesh 2x2 --blocks 32        # 32 blocks of d = 1024
    python benchmarks/at_scale.py --plan-only                               # Llama 3 70B and 405B, the plan alone
    /work/peers-venv/bin/python benchmarks/at_scale.py --size 67M --mesh 2x1 --optimizers DTensorMuon dion \
        --without-ns only --interleave --builds 7        # construction alone, the two built in turn, 7 rounds
    ... --interleave --fresh --builds 7                  # each build the first of its own processes, as in a training

--plan-only builds, for one rank, the plan DTensorMuon builds (distmuon/dtensor/plan.py's plan_matrices) for
Llama 3 70B and 405B placed as FSDP2 x TP 8 places them (benchmarks/cost_model.py's placed_copies), at 512 and
16,384 ranks: shapes only, nothing allocated; seconds and the plan's size, printed, and what rank 0 would send at
construction where the ranks' descriptions differ: its Copies pickled as made (their meshes' ranks as describe
keeps them: plan.ranks_of, a range where evenly spaced) and packed (each mesh once: distmuon/dtensor/optimizer.py's
packed; where they agree, a digest of a few bytes is all).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import os
import pickle
import statistics
import sys
import tempfile
import time

if __name__ == "__main__":  # first, before torch loads: Ctrl-C waits for the runner; the ranks' forkserver starts
    import muon_forkserver

    muon_forkserver.start_command(spawns_ranks="--plan-only" not in sys.argv)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from distmuon import dtensor  # noqa: E402
from distmuon.dtensor.optimizer import packed  # noqa: E402
from distmuon.dtensor import plan  # noqa: E402
import muon_tools  # noqa: E402

SIZES = {"38M": 768, "67M": 1024, "268M": 2048, "1B": 4096}  # d of 8 blocks (d x 4d, 4d x d): 8 d^2 parameters each
BLOCKS = 8
DEEP_BLOCKS = 32  # --blocks 32: 4 times the blocks at half the d, as many parameters (Llama 3 8B: 32 layers)
LR, WEIGHT_DECAY, MOMENTUM = 0.02, 0.1, 0.95
STEADY_STEPS = 3
BUILDS = 3
EXCHANGE_BYTES = 2**23  # DTensorMuon's groups ("DTensorMuon groups", "overlap"): 8 MiB of bf16 matrices each
OVERLAP = 2  # "DTensorMuon overlap": 2 groups' gathers in flight


# =============================================================================
# 1. The model and its placement
# =============================================================================
class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def shape_of(size, blocks=BLOCKS):
    """(d, blocks) of a --size: SIZES's d at BLOCKS blocks, d / 2 at 4 times as many (the same parameters)."""
    return {BLOCKS: SIZES[size], DEEP_BLOCKS: SIZES[size] // 2}[blocks], blocks


def placed_model(d, mesh, blocks=BLOCKS):
    """`blocks` blocks on the meta device, TP and FSDP2 applied as the mesh asks, then this rank's shards made."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    with torch.device("meta"):
        model = nn.Sequential(*[Block(d) for _ in range(blocks)])
    if mesh["tp"].size() > 1:
        for block in model:
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if mesh["dp"].size() > 1:
        for block in model:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            dtensor.local_of(p).normal_(0, d ** -0.5)
    return model


def make_gradients(model, d):
    x = torch.randn(4, d, generator=torch.Generator().manual_seed(0))
    model(x).square().mean().backward()


# =============================================================================
# 2. Memory: RSS and its peak (Linux's VmHWM, reset through clear_refs)
# =============================================================================
def rss():
    """(current, peak) resident bytes of this process."""
    fields = dict(line.split(":", 1) for line in open("/proc/self/status") if line.startswith(("VmRSS", "VmHWM")))
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def reset_peak():
    """Free what can be freed, hand it back to the system (glibc keeps freed memory otherwise: the next
    optimizer's RSS would count the last one's), and start the peak from here."""
    import ctypes

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


# =============================================================================
# 3. The optimizers
# =============================================================================
def build_dtensor_muon(model, **options):
    return dtensor.DTensorMuon([dict(params=list(model.named_parameters()), algorithm="muon")], lr=LR,
                          weight_decay=WEIGHT_DECAY, momentum=MOMENTUM, **options)


def build_torch_muon(model):
    return torch.optim.Muon(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, momentum=MOMENTUM,
                            adjust_lr_fn="match_rms_adamw")


def build_dion(model):
    try:
        import dion
    except ImportError:
        raise ValueError("not installed (microsoft/dion is not on the package registry: "
                         "benchmarks/requirements-peers.txt says how to install it)") from None
    import peers  # its options: the nearest dion comes to torch.optim.Muon

    params = dict(model.named_parameters())
    mesh = getattr(next(iter(params.values())), "device_mesh", None)
    if mesh is None:
        raise ValueError("not run here: its distributed_mesh is the parameters' (plain tensors on a 1 x 1 mesh)")
    if mesh.ndim != 1:
        raise ValueError(f"dion takes a 1-D mesh; this one is {mesh.ndim}-D")
    return dion.Muon(peers.dion_groups(params), distributed_mesh=mesh, lr=LR, mu=MOMENTUM,
                     weight_decay=WEIGHT_DECAY, nesterov=True, use_polar_express=False)


BUILDERS = {"DTensorMuon": build_dtensor_muon,
            "DTensorMuon groups": functools.partial(build_dtensor_muon, exchange_bytes=EXCHANGE_BYTES),
            "DTensorMuon per owner": functools.partial(build_dtensor_muon, exchange_bytes="one_per_owner"),
            "DTensorMuon overlap": functools.partial(build_dtensor_muon, exchange_bytes=EXCHANGE_BYTES,
                                                     overlap=OVERLAP),
            "dion": build_dion, "torch.optim.Muon": build_torch_muon}


def without_newton_schulz():
    """Every optimizer's Newton-Schulz replaced by the bf16 cast it begins with (the peers' and torch's, as
    benchmarks/peers.py and scaling.py replace them)."""
    import scaling

    scaling.without_newton_schulz()
    try:
        import peers

        peers.cast_only("dion.megabatch_base", "zeropower_via_newtonschulz5")
    except ImportError:
        pass


def warm_up(d, mesh=None, labels=()):
    """What a process sets up once, whichever optimizer comes first, done before any is measured: oneDNN's bf16
    matmuls on the model's two shapes (one Newton-Schulz iteration each: their kernels and caches), Gloo's all-to-all
    (its buffers); then each optimizer of `labels` built and stepped once on a model of d = 16 (2 blocks) on the same
    mesh, which pages in the library code its operators run (file-backed, shared by the processes: 2.0 MB of
    RssFile at DTensorMuon's first construction, 0.7 MB at its first step, and not one byte of RssAnon more,
    notes/measured/at_scale_2core.md). A training has run its own matmuls and collectives by the time it steps;
    without this the first optimizer of the list would be charged for them. Returns the RSS it added (bytes)."""
    import distributed_muon_cpu

    reset_peak()  # what glibc kept of the model's making handed back first: the warm-up's own RSS after it
    before = rss()[0]
    for shape in ((d, 4 * d), (4 * d, d)):  # wide, and tall (orthogonalized through its transpose)
        distributed_muon_cpu.newton_schulz(torch.randn(shape).bfloat16(), steps=1)
    if dist.is_initialized():
        world = dist.get_world_size()
        dist.all_to_all_single(torch.empty(world * d), torch.zeros(world * d))
        dist.barrier()
    if labels:
        tiny = placed_model(16, mesh, 2)
        for label in labels:
            make_gradients(tiny, 16)
            with contextlib.suppress(Exception):  # every rank alike (the same code, the same shapes): its row says why
                BUILDERS[label](tiny).step()
    reset_peak()
    return rss()[0] - before


def measure(label, build, model, steps, builds):
    """One optimizer's row: construction (the median of `builds`, each discarded but the last), the last one's
    memory, its first and steady steps (seconds, bytes over the RSS before it)."""
    built = []
    for _ in range(builds):
        opt = None  # the last build freed before the next starts
        reset_peak()
        base = rss()[0]
        if dist.is_initialized():  # every rank starts together: no rank's time waits for another's last step
            dist.barrier()
        t0 = time.perf_counter()
        opt = build(model)
        built.append(time.perf_counter() - t0)
    peak = rss()[1]
    reset_peak()  # what construction keeps: its RSS once freed memory is handed back
    now = rss()[0]
    row = dict(label=label, construct_s=statistics.median(built), construct_peak=peak - base, kept=now - base,
               state=sum(dtensor.local_of(t).numel() * dtensor.local_of(t).element_size() for s in opt.state.values()
                         for t in s.values() if torch.is_tensor(t)))
    times = []
    for _ in range(1 + steps):
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
        if len(times) == 1:
            row["first_step_peak"] = max(peak, rss()[1]) - base
    row.update(first_s=times[0], steady_s=statistics.median(times[1:]) if steps else float("nan"),
               state_after=sum(dtensor.local_of(t).numel() * dtensor.local_of(t).element_size() for s in opt.state.values()
                               for t in s.values() if torch.is_tensor(t)))
    del opt
    gc.collect()
    return row


def measured(label, model, steps, builds):
    """measure's row, or the error every rank met (the same code on the same shapes)."""
    try:
        return measure(label, BUILDERS[label], model, steps, builds)
    except Exception as error:
        if dist.is_initialized():
            dist.barrier()
        return dict(label=label, error=muon_tools.one_line(error))


def interleaved(labels, model, rounds):
    """Construction alone, the optimizers built in turn round by round (the order reversed every other round: A B,
    B A, ...), so that whatever else loads the machine hits each alike: one row per optimizer, its seconds per round
    (each build freed before the next starts)."""
    rows = {label: dict(label=label, builds=[]) for label in labels}
    for r in range(rounds):
        for label in [x for x in (labels if r % 2 == 0 else labels[::-1]) if "error" not in rows[x]]:
            reset_peak()  # the last build was freed: its memory handed back before this one starts
            if dist.is_initialized():
                dist.barrier()
            try:
                t0 = time.perf_counter()
                opt = BUILDERS[label](model)
                rows[label]["builds"].append(time.perf_counter() - t0)
                del opt
            except Exception as error:  # every rank fails alike: the same code on the same shapes
                rows[label] = dict(label=label, error=muon_tools.one_line(error))
    return list(rows.values())


def rank_main(rank, world, port, out_dir, shape, dp, tp, labels, without_ns, steps, builds, interleave=False):
    torch.set_num_threads(1)
    with contextlib.suppress(ImportError):  # imported before any clock starts: an import is no construction
        import dion  # noqa: F401
    if without_ns:
        without_newton_schulz()
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=1800))
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    d, blocks = shape
    model = placed_model(d, mesh, blocks)
    make_gradients(model, d)
    local = sum(dtensor.local_of(p).numel() * 4 for p in model.parameters())
    warm = warm_up(d, mesh, () if interleave else labels)  # --interleave: construction as a training meets it
    rows = interleaved(labels, model, builds) if interleave else [measured(label, model, steps, builds)
                                                                   for label in labels]
    torch.save(dict(rows=rows, local=local, warm=warm), os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def on_mesh(shape, dp, tp, labels, without_ns, steps, builds, interleave=False):
    """Every rank's rows on a dp x tp mesh (a world of dp tp processes), the model shape_of's (d, blocks)."""
    world = dp * tp
    with tempfile.TemporaryDirectory() as out_dir:
        muon_tools.run_processes(rank_main, (world, muon_tools.free_port(), out_dir, shape, dp, tp, labels, without_ns,
                                             steps, builds, interleave),
                         world,
                         folders=(out_dir,))
        return [torch.load(os.path.join(out_dir, f"{r}.pt")) for r in range(world)]


def fresh_rounds(shape, dp, tp, labels, without_ns, rounds):
    """--fresh: every build the first of its own processes, as a training's one construction is (the model made and
    one gradient computed first, torch's caches as a training leaves them), the optimizers in turn round by round
    (the order reversed every other round): every rank's rows as on_mesh gives them, each row's builds one a round."""
    merged = None
    for r in range(rounds):
        for label in labels if r % 2 == 0 else labels[::-1]:
            if merged is not None and "error" in merged[0]["rows"][labels.index(label)]:
                continue  # it failed in an earlier round: the same code on the same shapes fails again
            per_rank = on_mesh(shape, dp, tp, [label], without_ns, 0, 1, interleave=True)
            if merged is None:
                merged = [dict(rows=[dict(label=x, builds=[]) for x in labels], local=one["local"]) for one in per_rank]
            for into, one in zip(merged, per_rank):
                row, slot = one["rows"][0], labels.index(label)
                if "error" in row:
                    into["rows"][slot] = row
                else:
                    into["rows"][slot]["builds"] += row["builds"]
    return merged


# =============================================================================
# 4. The table
# =============================================================================
def gb(n):
    return f"{n / 1e9:.2f}"


def row_start(size, dp, tp, without_ns):
    """What every line of a mesh's rows begins with: the size, the mesh, with or without Newton-Schulz."""
    return f"{size:>7} {dp}x{tp} {'no NS' if without_ns else 'NS':>5}  "


def table_rows(size, dp, tp, per_rank, without_ns):
    """One line per optimizer: the slowest rank's times, the largest rank's memory."""
    out = []
    for i, row in enumerate(per_rank[0]["rows"]):
        rows = [r["rows"][i] for r in per_rank]
        name = f"{row_start(size, dp, tp, without_ns)}{row['label']:<21}"
        if "error" in row:
            out.append(f"{name} {row['error']}")
            continue
        worst = lambda key: max(r[key] for r in rows)  # noqa: E731
        beside = max(r["kept"] - r["state"] for r in rows) / 1e6
        over = max((r["first_step_peak"] - r["state"]) / p["local"] for r, p in zip(rows, per_rank)) * 100
        out.append(f"{name} {worst('construct_s'):9.3f} {gb(worst('construct_peak')):>10} {gb(worst('kept')):>8} "
                   f"{gb(worst('state')):>8} {beside:9.1f} {gb(worst('first_step_peak')):>10} {worst('first_s'):8.2f} "
                   f"{worst('steady_s'):9.3f} {gb(max(r['local'] for r in per_rank)):>9} {over:7.1f}")
    warm = max(r["warm"] for r in per_rank) / 1e6
    out.append(f"{row_start(size, dp, tp, without_ns)}(warm-up: {warm:.1f} MB, before them all)")
    return out


def interleaved_rows(size, dp, tp, per_rank, without_ns):
    """One line per optimizer built round by round: each round's slowest rank, their median and minimum, and the
    median over rounds of its build over the last optimizer's in the same round."""
    rounds = {}
    for i, row in enumerate(per_rank[0]["rows"]):
        if "error" not in row:
            rounds[row["label"]] = [max(times) for times in zip(*(r["rows"][i]["builds"] for r in per_rank))]
    base = list(rounds)[-1] if rounds else None
    out = []
    for row in per_rank[0]["rows"]:
        name = f"{row_start(size, dp, tp, without_ns)}{row['label']:<21}"
        if "error" in row:
            out.append(f"{name} {row['error']}")
            continue
        times = rounds[row["label"]]
        ratio = statistics.median(t / b for t, b in zip(times, rounds[base]))
        out.append(f"{name} {len(times):>6} {statistics.median(times):10.3f} {min(times):9.3f} {ratio:9.3f} "
                   f"{base}")
    return out


INTERLEAVED_HEADER = (f"{'size':>7} mesh {'NS':>5}  {'optimizer':<21} {'rounds':>6} {'median s':>10} {'min s':>9} "
                      f"{'ratio':>9} over")
INTERLEAVED_NOTE = ("--interleave: construction alone, the optimizers built in turn round by round (the order\n"
                    "reversed every other round); a round's time is its slowest rank's; median s and min s over the\n"
                    "rounds; ratio: the median over rounds of this optimizer's build over the named one's in the same\n"
                    "round.")
FRESH_NOTE = ("--fresh: each build the first in processes of its own, after the model and one gradient (a training's\n"
              "one construction); otherwise each round's builds follow one another in the same processes.")


HEADER = (f"{'size':>7} mesh {'NS':>5}  {'optimizer':<21} {'build s':>9} {'peak GB':>10} {'kept GB':>8} "
          f"{'state GB':>8} {'plan MB':>9} {'1st peak GB':>10} {'1st s':>8} {'steady s':>9} {'params GB':>9} "
          f"{'step %':>7}")
NOTE = ("build s: construction (seconds, the median of --builds; the slowest rank); peak GB: peak RSS over the\n"
        "model's (its shards and gradients) through construction; kept GB: RSS after it, over the model's; state GB:\n"
        "the optimizer's state tensors; plan MB: what construction keeps beside its state (kept - state, in RSS's\n"
        "pages); 1st peak GB: the peak through construction and the first step; 1st s, steady s: the first step and\n"
        "the median of the next ones; params GB: this rank's parameter bytes (fp32); step %: the 1st peak over the\n"
        "state, in % of params (what construction and the first step hold beside the state). Memory: the largest\n"
        "rank's. size: the parameters, /32 where --blocks 32 holds them in 32 blocks. warm-up: the RSS that one\n"
        "bf16 Newton-Schulz iteration, one all-to-all and each optimizer built and stepped on a model of d = 16 added\n"
        "to each process before any was measured (at_scale.py's warm_up: the code and buffers a process pages in\n"
        "once; the largest rank's), so that the first one is not charged for them.")


# =============================================================================
# 5. The plan alone at Llama 3's sizes
# =============================================================================
def plan_kept_bytes(make):
    """What the plan that make() returns keeps (plan_matrices' matrices, FLOPs and owners, all that DTensorMuon
    keeps of it): the Python objects it leaves allocated (tracemalloc, over what was allocated before) and the
    storages of the tensors its matrices hold (3c's pieces)."""
    import tracemalloc

    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    kept = make()
    matrices = kept[0]
    gc.collect()
    python = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    storages = {}
    for m in matrices:
        for holder in (m, m.gather, m.scatter):
            for t in getattr(holder, "__dict__", {}).values():
                if isinstance(t, torch.Tensor):
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return python + sum(storages.values())


def plan_only(print_fn=print, names=("llama3-70b", "llama3-405b"), worlds=(512, 16384)):
    """DTensorMuon's plan for one rank (rank 0) of Llama 3 70B and 405B (names) on FSDP2 x TP 8 over each of `worlds`
    ranks: seconds, the peak RSS of making it, and what it keeps (plan_kept_bytes, a second making of it: tracemalloc
    slows it), in MB."""
    import cost_model

    models = {"llama3-70b": cost_model.MODELS["llama3-70b"],
              "llama3-405b": cost_model.Model("Llama-3-405B-like", 126, 16384, 128, 8, 53248, 128256, tokens=2**24,
                                      seq=8192, source=cost_model.LLAMA3)}
    models = {name: models[name] for name in names}
    print_fn(f"{'model':<12} {'ranks':>6} {'mesh':>9} {'matrices':>9} {'plan s':>8} {'peak MB':>8} "
             f"{'kept MB':>8} {'local params MB':>16} {'kept %':>7} {'Copies MB':>10} {'packed MB':>10}")
    for key, model in models.items():
        for gpus in worlds:
            mesh = cost_model.Mesh(gpus // 8, 8)
            params = cost_model.param_order(model.params(), cost_model.GROUPS)
            copies = cost_model.placed_copies(params, mesh, {g: i for i, g in enumerate(cost_model.GROUPS)})
            muon = [c for c in copies if cost_model.GROUPS[c.group] == "muon"]
            steps = {i: 5 for i in range(len(cost_model.GROUPS))}
            gc.collect()
            reset_peak()
            before = rss()[0]
            t0 = time.perf_counter()
            matrices, _, _ = plan.plan_matrices(muon, steps, 0, gpus)
            seconds, n_matrices = time.perf_counter() - t0, len(matrices)
            peak = rss()[1]
            del matrices
            kept = plan_kept_bytes(lambda: plan.plan_matrices(muon, steps, 0, gpus))
            local = sum(int(cost_model.held(c, gpus)[0]) * 4 for c in copies)
            mine = [c for c in copies if not c.mesh_ranks or 0 in c.mesh_ranks]  # what rank 0 describes
            described, message = (len(pickle.dumps(x)) / 1e6 for x in (mine, packed(mine)))
            print_fn(f"{key:<12} {gpus:>6} {f'{mesh.dp}x{mesh.tp}':>9} {n_matrices:>9} {seconds:8.2f} "
                     f"{(peak - before) / 1e6:8.1f} {kept / 1e6:8.2f} {local / 1e6:16.1f} {100 * kept / local:7.2f} "
                     f"{described:10.1f} {message:10.2f}")


# =============================================================================
# 6. The command line
# =============================================================================
def parse_mesh(text):
    try:
        dp, tp = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a mesh is DPxTP, e.g. 2x1 (got {text!r})") from None
    if dp < 1 or tp < 1:
        raise argparse.ArgumentTypeError(f"a mesh's sizes are positive (got {text!r})")
    return dp, tp


def main(argv=None):
    parser = muon_tools.OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=SIZES, nargs="+", default=["67M"])
    parser.add_argument("--mesh", type=parse_mesh, nargs="+", default=[(1, 1), (2, 1), (1, 2), (2, 2)],
                        help="DPxTP meshes (default: 1x1 2x1 1x2 2x2; torch.optim.Muon runs on 1x1 only)")
    parser.add_argument("--optimizers", nargs="+", choices=list(BUILDERS), default=list(BUILDERS),
                        help=f"DTensorMuon groups: exchange_bytes={EXCHANGE_BYTES}; overlap: and overlap={OVERLAP}; "
                             f"per owner: exchange_bytes='one_per_owner' (each owner one matrix a group)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"steady steps after the first (default {STEADY_STEPS})")
    parser.add_argument("--builds", type=int, default=BUILDS,
                        help="constructions, their median timed (the last kept); with --interleave, the rounds")
    parser.add_argument("--interleave", action="store_true",
                        help="construction alone: the optimizers built in turn, --builds rounds, no step")
    parser.add_argument("--fresh", action="store_true",
                        help="with --interleave: each build the first in processes of its own (as in a training)")
    parser.add_argument("--without-ns", choices=("both", "no", "only"), default="both",
                        help="with Newton-Schulz, without it (its bf16 cast), or both")
    parser.add_argument("--blocks", type=int, choices=(BLOCKS, DEEP_BLOCKS), default=None,
                        help=f"{BLOCKS} blocks of SIZES's d (default), or {DEEP_BLOCKS} of d / 2: the same parameters")
    parser.add_argument("--plan-only", action="store_true")
    args = parser.parse_args(argv)
    if args.builds < 1:
        parser.error(f"--builds must be >= 1 (got {args.builds})")
    if args.steps is not None and args.steps < 0:
        parser.error(f"--steps must be >= 0 (got {args.steps})")
    if args.interleave and args.steps is not None:
        parser.error(f"--interleave times construction alone: --steps {args.steps} would change nothing")
    if args.fresh and not args.interleave:
        parser.error("--fresh is a way to --interleave: give both")
    if args.plan_only and args.interleave:
        parser.error("--plan-only builds no optimizer: --interleave would change nothing")
    if args.plan_only and args.blocks is not None:
        parser.error(f"--plan-only plans Llama 3's shapes: --blocks {args.blocks} would change nothing")
    if args.plan_only:
        plan_only()
        return
    steps = STEADY_STEPS if args.steps is None else args.steps
    print(INTERLEAVED_HEADER if args.interleave else HEADER)
    blocks = args.blocks or BLOCKS
    for size in args.size:
        shape, label = shape_of(size, blocks), size if blocks == BLOCKS else f"{size}/{blocks}"
        for dp, tp in args.mesh:
            labels = [o for o in args.optimizers if o != "torch.optim.Muon" or dp * tp == 1]
            for without_ns in {"both": (False, True), "no": (False,), "only": (True,)}[args.without_ns]:
                per_rank = (fresh_rounds(shape, dp, tp, labels, without_ns, args.builds) if args.fresh else
                            on_mesh(shape, dp, tp, labels, without_ns, steps, args.builds, args.interleave))
                for line in (interleaved_rows if args.interleave else table_rows)(label, dp, tp, per_rank, without_ns):
                    print(line, flush=True)
    print(INTERLEAVED_NOTE + ("\n" + FRESH_NOTE if args.fresh else "") if args.interleave else NOTE)


if __name__ == "__main__":
    sys.exit(muon_tools.exit_code(main))
