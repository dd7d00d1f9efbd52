"""Where the two-rank step's time goes: benchmarks/scaling.py's model (4 layers at d = 768, DP = 2,
TP = 1), the owner strategies with and without --overlap, one step of each traced with torch.profiler
on the thread of each rank, against half of torch's Newton-Schulz (the ideal: the NS FLOPs split
evenly and nothing else).

    python benchmarks/two_ranks.py
    python benchmarks/two_ranks.py --rounds 4 --without-ns
    git worktree add /tmp/before <commit> && python benchmarks/two_ranks.py --before /tmp/before

Per rank and variant, in ms of one traced step: newton-schulz (and its FLOPs), "state update"
(momentum and AdamW), each collective by its ledger phase (a synchronous one: its whole time; an
overlapped one: its wait, so transfer and waiting for the peer together), then what no label covers,
split by the torch ops that run there: copies (cat, copy_, clone, zeros: assembling and taking apart
the exchanges' buffers), elementwise (the weight update, the sums of the reduction) and the rest
(Python and small ops). The step times above the table are untraced medians, rounds interleaved;
with --before DIR, the distributed_muon_cpu.py in DIR (another commit's) is timed in the same ranks,
its variants interleaved with these: a before/after comparison that drift in the machine's load
hits alike.
"""

import importlib.util
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's logger, quiet (why: examples/train_gpt.py)

if __name__ == "__main__":  # first, before torch loads: Ctrl-C waits for the runner; the ranks' forkserver starts
    import muon_forkserver

    muon_forkserver.start_command()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


import scaling  # noqa: E402
import distributed_muon_cpu  # noqa: E402
from distmuon import owners  # noqa: E402
import muon_tools  # noqa: E402

VARIANTS = {v: s for v, s in scaling.VARIANTS.items() if owners.strategy_class(s[0]).orthogonalizes_once}
COPIES = ("aten::cat", "aten::copy_", "aten::clone", "aten::zeros", "aten::zero_", "aten::fill_", "aten::new_zeros",
          "aten::split", "aten::empty", "aten::new_empty")
ELEMENTWISE = ("aten::add_", "aten::mul_", "aten::lerp_", "aten::lerp", "aten::add", "aten::addcmul_",
               "aten::addcdiv_", "aten::sqrt", "aten::div", "aten::_to_copy", "aten::to")
STEP = "traced step"


def split_of(events, labels):
    """{part: ms} of one traced step on its thread: the labelled phases, then the unlabelled ops by kind."""
    step = next(e for e in events if e.name == STEP)

    def labelled(e):
        parent = e.cpu_parent
        while parent is not None and parent.name not in labels:
            parent = parent.cpu_parent
        return parent is not None

    split = {"copies": 0.0, "elementwise": 0.0}
    for e in events:
        if e.thread != step.thread:
            continue
        if e.name in labels:
            split[e.name] = split.get(e.name, 0.0) + e.cpu_time_total / 1e3
        elif e.name.startswith("aten::") and not (e.cpu_parent and e.cpu_parent.name.startswith("aten::")):
            if labelled(e):
                continue
            kind = "copies" if e.name in COPIES else "elementwise" if e.name in ELEMENTWISE else None
            if kind:
                split[kind] += e.cpu_time_total / 1e3
    total = step.cpu_time_total / 1e3
    split["python and the rest"] = total - sum(split.values())
    split["step"] = total
    return split


BEFORE = " (before)"


def load_as(name, path):
    """The module in `path`, imported as `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)  # dataclasses look it up there
    spec.loader.exec_module(module)
    return module


def other_commit(directory):
    """The modules that hold OPTIMIZERS in `directory` (another commit's checkout), loaded beside ours: [its lesson,
    its owner strategies] (distmuon/owners.py, or muon_owners.py before the library moved into distmuon/; before
    the owner strategies had a file of their own: [its lesson]). While its modules load, they and not ours are the
    library's names in sys.modules, so that they import one another; ours are put back after."""
    ours = {n: m for n, m in sys.modules.items() if n in ("distributed_muon_cpu", "distmuon") or n.startswith("distmuon.")}
    for name in ours:
        del sys.modules[name]
    try:
        package = os.path.join(directory, "distmuon")
        if os.path.isdir(package):  # its package, found where it lies: its submodules are imported from there
            spec = importlib.util.spec_from_file_location("distmuon", os.path.join(package, "__init__.py"),
                                                          submodule_search_locations=[package])
            sys.modules["distmuon"] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(sys.modules["distmuon"])
        lesson = load_as("distributed_muon_cpu", os.path.join(directory, "distributed_muon_cpu.py"))
        owners = next((p for p in (os.path.join(package, "owners.py"), os.path.join(directory, "muon_owners.py"))
                       if os.path.isfile(p)), None)
        return [lesson] if owners is None else [lesson, load_as("mo_before", owners)]
    finally:
        for name in [n for n in sys.modules if n in ("distributed_muon_cpu", "distmuon") or n.startswith("distmuon.")]:
            del sys.modules[name]
        sys.modules.update(ours)


def rank_main(rank, world, port, out_dir, d, layers, rounds, without_ns, before):
    torch.set_num_threads(1)
    if without_ns:
        scaling.without_newton_schulz()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    grid = distributed_muon_cpu.make_grid(world, 1, rank)
    modules = {"": [distributed_muon_cpu, owners]} | ({BEFORE: other_commit(before)} if before else {})
    built, others = {}, {}
    for suffix, (*rest, module) in modules.items():
        if without_ns:
            for m in rest + [module]:
                m.newton_schulz = distributed_muon_cpu.newton_schulz
        for variant in VARIANTS:
            params, grads = scaling.parameters(d, layers)
            (others if suffix else built)[variant + suffix] = (
                scaling.build(variant, params, grid, VARIANTS, module), params, grads)
    times = scaling.step_ms({v: (o.step, p, g) for v, (o, p, g) in (built | others).items()}, rounds,
                            dist.barrier)
    labels = set(muon_tools.PHASES_OF['owner'] + muon_tools.PHASES_OF['comm-free']) | {"newton-schulz", "state update"}
    splits, flops = {}, {}
    for variant, (opt, params, grads) in (built | others).items():
        for n, p in params.items():
            p.grad = grads[n]
        dist.barrier()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with torch.profiler.record_function(STEP):
                opt.step()
        splits[variant] = split_of(prof.events(), labels)
        flops[variant] = sum(c["flops"] for c in opt.ledger.compute if c["step"] == opt.ledger.step)
    muon_tools.write_atomically(os.path.join(out_dir, f"{rank}.pt"),
                        lambda f: torch.save(dict(times=times, splits=splits, flops=flops), f))
    dist.destroy_process_group()


def torch_newton_schulz_ms(d, layers, repeats=3):
    """One thread: the Newton-Schulz of every matrix as torch.optim.Muon runs it (each shape run once
    first: oneDNN prepares its kernels per shape), the median of `repeats`; and its FLOPs."""
    torch.set_num_threads(1)
    matrices, _ = scaling.shapes(d, layers)
    xs = [torch.randn(s) for s in matrices.values()]
    for s in set(matrices.values()):
        distributed_muon_cpu.newton_schulz(torch.randn(s))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for x in xs:
            distributed_muon_cpu.newton_schulz(x)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), sum(distributed_muon_cpu.newton_schulz_flops(s) for s in matrices.values())


def main(argv=None):
    p = muon_tools.OneLineParser(description=__doc__.splitlines()[0])
    scaling.model_arguments(p, rounds=3, rounds_help="untraced interleaved steps before the traced one")
    p.add_argument("--without-ns", action="store_true", help="Newton-Schulz replaced by its bf16 cast")
    p.add_argument("--before", metavar="DIR", help="also time DIR/distributed_muon_cpu.py's variants, interleaved")
    a = p.parse_args(argv)
    scaling.check_model(p, a, 2)
    if a.before and not os.path.isfile(os.path.join(a.before, "distributed_muon_cpu.py")):
        p.error(f"--before {a.before}: no distributed_muon_cpu.py there")
    ns_ms, ns_flops = torch_newton_schulz_ms(a.d, a.layers)
    with tempfile.TemporaryDirectory() as out_dir:
        muon_tools.run_processes(rank_main, (2, muon_tools.free_port(), out_dir, a.d, a.layers, a.rounds, a.without_ns,
                                             a.before), 2,
                         folders=(out_dir,))
        ranks = [torch.load(os.path.join(out_dir, f"{r}.pt")) for r in range(2)]
    print(f"{a.layers} layers at d = {a.d}, DP = 2 x TP = 1, 1 thread per rank; torch {torch.__version__}"
          + (" (WITHOUT Newton-Schulz)" if a.without_ns else ""))
    print(f"torch's Newton-Schulz of every matrix, one thread: {ns_ms:.0f} ms, {ns_flops / 1e9:.4g} GFLOP; "
          f"half: {ns_ms / 2:.0f} ms")
    for v in ranks[0]["times"]:
        slowest = [max(r["times"][v][i] for r in ranks) for i in range(a.rounds)]
        after = ranks[0]["times"].get(v.removesuffix(BEFORE)) if v.endswith(BEFORE) else None
        ratio = ""
        if after:
            now = statistics.median(max(r["times"][v.removesuffix(BEFORE)][i] for r in ranks) for i in range(a.rounds))
            ratio = f"; this commit's / before: {now / statistics.median(slowest):.3f}"
        print(f"  {v:<31} untraced step, slowest rank: median {statistics.median(slowest):.0f} ms "
              f"(min {min(slowest):.0f}) over {a.rounds} rounds{ratio}")
    for suffix in ("", BEFORE) if a.before else ("",):
        variants = [v + suffix for v in VARIANTS]
        parts = []
        for s in (r["splits"][v] for r in ranks for v in variants):
            parts += [k for k in s if k not in parts and k != "step"]
        head = [f"ms of one traced step{suffix}"] + [f"{v.replace(' --overlap ', ' ov')} r{i}" for v in VARIANTS
                                                    for i in range(2)]
        rows = [["NS GFLOP"] + [f"{r['flops'][v] / 1e9:.4g}" for v in variants for r in ranks]]
        rows += [[k] + [f"{r['splits'][v].get(k, 0.0):.0f}" for v in variants for r in ranks] for k in parts]
        rows += [["step (traced)"] + [f"{r['splits'][v]['step']:.0f}" for v in variants for r in ranks]]
        print()
        print(muon_tools.format_table(head, rows, ["<"] + [">"] * (len(head) - 1)))
    return 0


if __name__ == "__main__":
    sys.exit(muon_tools.exit_code(main))
