"""torch.optim.Muon, DTensorMuon, microsoft/dion's Muon and torchtitan's DistMuon on one device, a GPU by default,
at a realistic size: scaling.py's layers (qkv, proj, fc, fc2) at d = 4096, 8 of them (32 matrices, 1.6 G
parameters). Each one's step time, its weights after one step against torch.optim.Muon's (bit for bit, or by how
much they differ), and Newton-Schulz's measured rate on these shapes beside the rate benchmarks/cost_model.py
assumes for its H100 (60 % of the bf16 peak, 594 TFLOP/s).

    python benchmarks/peers_1gpu.py                         # on a GPU: benchmarks/on_gpu.sh, part 5
    /work/peers-venv/bin/python benchmarks/peers_1gpu.py    # with dion, torchtitan (benchmarks/requirements-peers.txt)
    python benchmarks/peers_1gpu.py --device cpu --d 32 --layers 1 --rounds 1   # the plumbing, on this CPU

One process, in a process group of one (NCCL on a GPU, Gloo on the CPU): DTensorMuon, dion and DistMuon take
FSDP2's Shard(0) DTensors on a mesh of that one device, as benchmarks/peers.py builds them (its contenders, its
dion and DistMuon configurations: as close to torch.optim.Muon as their options go), torch.optim.Muon plain
tensors. Each is fed the same gradient, steps once (that step is checked), then --rounds timed steps
(torch.cuda.synchronize() before the clock is read). One optimizer at a time, never interleaved: at d = 4096 each
holds 19 GB (weights, gradients, momentum), and a GPU is not shared as this project's CPU is. dion runs compiled,
as shipped (its first two steps, compiling, reported apart), and eager (its torch.compile'd functions unwrapped);
"not installed" where this Python lacks it. DistMuon (torchtitan/distributed/flex_shard) in both of peers.py's
layouts: every matrix Owned() (whole, against torch.optim.Muon) and each qkv matrix by heads, BlockShard (against
torch.optim.Muon fed each head as a matrix); on a GPU as shipped but for entering its package without
torchtitan/distributed/__init__.py, on the CPU with peers_torchtitan.py's two CPU patches too; "not installed"
likewise. Figures and ratios, never verdicts.
"""

import datetime
import statistics
import time

if __name__ == "__main__":  # first, before torch loads: a Ctrl-C waits for the runner (one line, exit 130)
    import muon_forkserver

    muon_forkserver.start_command(spawns_ranks=False)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import cost_model  # noqa: E402
import importlib  # noqa: E402
import distributed_muon_cpu  # noqa: E402
import muon_tools  # noqa: E402
import newton_schulz_gflops  # noqa: E402
import peers  # noqa: E402
import peers_torchtitan  # noqa: E402
import scaling  # noqa: E402

D, LAYERS, ROUNDS = 4096, 8, 5
GPU_COPIES = 8  # fp32 copies of the matrices on the GPU at once (main's check), one more for temporaries
PEER_DISTRIBUTIONS = ("dion", "torchtitan")  # their Muon rows: dion's compiled and eager, DistMuon's two layouts
ASSUMED_TFLOPS = cost_model.H100.ns_tflops  # the cost model's Newton-Schulz rate on an H100


def build_parser():
    p = muon_tools.OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="where to run (default %(default)s)")
    scaling.model_arguments(p, d=D, rounds=ROUNDS, rounds_help="timed steps of each optimizer")
    p.set_defaults(layers=LAYERS)
    return p


def contenders(device_type):
    """[(label, build(weights) -> peers.Contender, compiles, algorithm)], and one line per peer distribution: its
    patches, or why it does not run. torch's plain Muon, DTensorMuon, then peers.PEERS' Muon rows of dion (compiled,
    eager) and torchtitan (DistMuon whole matrices, per head); NorMuon's are peers.py's alone."""
    def torch_muon(weights):
        params = {n: w.clone() for n, w in weights.items()}
        optimizer = peers.torch_muon(params)

        def sync(local):
            for n, p in params.items():
                p.grad = local[n]
        return peers.Contender(params, sync, optimizer.step, lambda: peers.full_weights(params))

    built = [(peers.TORCH, torch_muon, False, "muon"),
             (peers.DTENSOR, lambda w: peers.dtensor_muon("muon")(w, 1, 0), False, "muon")]
    statuses = []
    for distribution in PEER_DISTRIBUTIONS:
        rows = [p for p in peers.PEERS if p.distribution == distribution and p.algorithm != "normuon"]
        version = peers.installed(rows[0])
        if version is None:
            statuses.append(f"{distribution}: {peers.NOT_INSTALLED} ({rows[0].note})")
            continue
        try:
            module = importlib.import_module(rows[0].module)
            patches = peers_torchtitan.patch(device_type) if distribution == "torchtitan" else rows[0].patch()
        except Exception as error:  # reported, not fatal: the others still run
            statuses.append(f"{distribution} {version}: failed: {muon_tools.one_line(error)}")
            continue
        for peer in rows:
            built.append((peer.label.format(v=version), lambda w, b=peer.build, m=module: b(m, w, 1, 0),
                          peer.compiles, peer.algorithm))
        statuses.append(f"{distribution}: " + "; ".join(patches))
    return built, statuses


def run(label, build, compiles, algorithm, weights, total, references, rounds, sync):
    """One optimizer: built, stepped once and checked against references[algorithm] (peers.REFERENCES' weights after
    one step), (compiling: once more), then timed. A row and its compile times, or its failure as one line."""
    try:
        contender = build(weights)
        firsts = []
        for _ in range(2 if compiles else 1):
            sync()
            t0 = time.perf_counter()
            contender.sync({n: g.clone() for n, g in total.items()})
            contender.step()
            sync()
            firsts.append(time.perf_counter() - t0)
            if len(firsts) == 1:
                checked = "(the reference)" if label == peers.TORCH else peers.check(
                    contender.full(), references[algorithm], weights)
        steps = []
        for _ in range(rounds):
            contender.sync({n: g.clone() for n, g in total.items()})
            sync()
            t0 = time.perf_counter()
            contender.step()
            sync()
            steps.append((time.perf_counter() - t0) * 1e3)
        return dict(label=label, steps=steps, check=checked, firsts=firsts if compiles else [])
    except Exception as error:  # a failing optimizer is a row that says so, never the end of the others
        return dict(label=label, failed=muon_tools.one_line(error))


def newton_schulz_rates(shapes, device, rounds, sync):
    """[(shape, matrices of it, ms, TFLOP/s)]: torch's Newton-Schulz (its coefficients, steps, epsilon: what
    DTensorMuon runs) of one matrix of each shape, the median of `rounds` after a warm-up."""
    counts = {}
    for shape in shapes:
        counts[shape] = counts.get(shape, 0) + 1
    rows = []
    for shape, count in counts.items():
        g = torch.randn(shape, generator=torch.Generator(device).manual_seed(0), device=device)
        ms = newton_schulz_gflops.median_ms(
            lambda: newton_schulz_gflops.torch_newton_schulz(g, distributed_muon_cpu.NS_COEFFICIENTS, distributed_muon_cpu.NS_STEPS,
                                                             distributed_muon_cpu.NS_EPS),
            rounds, sync)
        rows.append((shape, count, ms, distributed_muon_cpu.newton_schulz_flops(shape, distributed_muon_cpu.NS_STEPS) / ms / 1e9))
    return rows


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    on_gpu = args.device == "cuda"
    scaling.check_model(p, args, 0 if on_gpu else 1)  # sizes; and this host's memory where the run lives in it
    if on_gpu and not torch.cuda.is_available():
        raise ValueError("no CUDA GPU here (torch.cuda.is_available() is False); --device cpu runs on this CPU")
    if on_gpu:  # at once: weights, gradient, the two references' results, one optimizer's weights, grads, momentum
        need, has = GPU_COPIES * 4 * 12 * args.d**2 * args.layers, torch.cuda.get_device_properties(0).total_memory
        if need > has:
            raise ValueError(f"--d {args.d} x --layers {args.layers} needs about {muon_tools.human_bytes(need)} of GPU "
                             f"memory (weights, gradient, references, one optimizer's state), more than its "
                             f"{muon_tools.human_bytes(has)}")
    torch.set_num_threads(1)  # on the CPU as benchmarks/peers.py's ranks; on a GPU the host thread only launches
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"tcp://127.0.0.1:{muon_tools.free_port()}",
                            rank=0, world_size=1, timeout=datetime.timedelta(seconds=600))
    try:
        where = torch.cuda.get_device_name(0) if on_gpu else "this CPU, 1 thread"
        weights, total = peers.matrices(args.d, args.layers, args.device)
        built, statuses = contenders(args.device)
        # each reference's weights after one step (torch's; per head where DistMuon runs), before any optimizer
        references = {a: peers.reference_step(weights, total, a) for a in dict.fromkeys(c[3] for c in built)}
        results = [run(*c, weights, total, references, args.rounds, sync) for c in built]
        rates = newton_schulz_rates([tuple(w.shape) for w in weights.values()], args.device, args.rounds, sync)
    finally:
        dist.destroy_process_group()
    print(f"{where}, torch {torch.__version__}; {args.layers} layers at d = {args.d} (Muon's matrices only: "
          f"{len(weights)}, {sum(w.numel() for w in weights.values()) / 1e6:,.1f} M parameters), median of "
          f"{args.rounds} steps of each, one optimizer at a time\n")
    timed = [r for r in results if "steps" in r]
    torch_ms = statistics.median(next(r["steps"] for r in timed if r["label"] == peers.TORCH))
    rows = [[r["label"], f"{statistics.median(r['steps']):.1f}", f"{min(r['steps']):.1f}",
             f"{statistics.median(r['steps']) / torch_ms:.2f}", r["check"]] for r in timed]
    print(muon_tools.format_table(["optimizer", "step ms (median)", "min ms", "time / torch's",
                           "after one step vs torch.optim.Muon"], rows, ["<", ">", ">", ">", "<"]))
    for r in results:
        if "failed" in r:
            print(f"  {r['label']}: failed: {r['failed']}")
        elif r["firsts"]:
            print(f"  {r['label']}: its first two steps (sync + step, compiling) "
                  + ", ".join(f"{s:.1f}" for s in r["firsts"]) + " s, apart from the table")
    if any(c[3] == peers_torchtitan.PER_HEAD for c in built):
        print(f"  the per-head rows against {peers.REFERENCES[peers_torchtitan.PER_HEAD][0]} ({peers_torchtitan.head_dim(args.d)} rows)")
    for status in statuses:
        print(f"  {status}")
    flops = sum(distributed_muon_cpu.newton_schulz_flops(tuple(w.shape), distributed_muon_cpu.NS_STEPS) for w in weights.values())
    measured_ms = sum(count * ms for _, count, ms, _ in rates)
    print(f"\nNewton-Schulz alone (torch's, {distributed_muon_cpu.NS_STEPS} iterations, bf16), one matrix of each shape, median of "
          f"{args.rounds} after a warm-up; the cost model assumes {ASSUMED_TFLOPS:.0f} TFLOP/s on an H100 "
          f"(benchmarks/cost_model.py):")
    print(muon_tools.format_table(
        ["shape", "matrices", "ms each", "TFLOP/s", "/ the assumed rate"],
        [[f"{m} x {n}", count, f"{ms:.3g}", f"{tflops:.3g}", f"{tflops / ASSUMED_TFLOPS:.3g}"]
         for (m, n), count, ms, tflops in rates], [">", ">", ">", ">", ">"]))
    ours = next((statistics.median(r["steps"]) for r in timed if r["label"] == peers.DTENSOR), None)
    print(f"All {len(weights)} matrices: {flops / 1e12:.3g} TFLOP, {measured_ms:.3g} ms at the measured rates "
          f"({flops / measured_ms / 1e9:.3g} TFLOP/s), {flops / ASSUMED_TFLOPS / 1e9:.3g} ms at the assumed "
          f"{ASSUMED_TFLOPS:.0f}" + (f"; DTensorMuon's step {ours:.1f} ms" if ours is not None else ""))
    return 0


if __name__ == "__main__":
    muon_tools.leave(muon_tools.exit_code(main))
