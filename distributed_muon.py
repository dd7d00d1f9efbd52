"""Distributed Muon on GPUs: the NCCL sibling of distributed_muon_cpu.py.

Launch recipes (torchrun starts one process per GPU):
    torchrun --standalone --nproc-per-node 8 distributed_muon.py --dp 4 --tp 2
    torchrun --standalone --nproc-per-node 1 distributed_muon.py            # one GPU: DP=1 x TP=1
    torchrun --standalone --nproc-per-node 8 distributed_muon.py --dp 4 --tp 2 --strategy owner
    torchrun --standalone --nproc-per-node 4 distributed_muon.py --backend gloo --device cpu --dp 2 --tp 2
    torchrun --standalone --nproc-per-node 8 distributed_muon.py --dp 4 --tp 2 --ns-blocks heads --qk-clip 100
By default TP=1 and DP = the number of processes. Every --strategy works here, and
every option of what large runs add (--ns-coefficients, --ns-blocks, --tp-newton-schulz, --qk-clip);
to compare strategies, launch once per --strategy (benchmarks/compare.py runs
them all in one go on CPU ranks). An error on any rank is printed by that rank, in one
line that names it; torchrun then stops the other ranks.

Nothing of the algorithm lives here. The math, the grid, the virtual buffer and
the step (distributed_muon_cpu.py, and muon_owners.py's strategies), the
verification against torch.optim.Muon / AdamW and the accounting (muon_tools.py)
are imported; this file launches them the way GPU jobs are launched. What
differs on GPUs, and why:

  1. Backend: NCCL instead of Gloo. NCCL runs the collectives on the GPUs
     themselves, over NVLink inside a node and InfiniBand/RoCE between nodes;
     Gloo would copy through host memory. NCCL needs CUDA tensors.
  2. Device placement: rank <-> GPU `cuda:LOCAL_RANK`, set once with
     torch.cuda.set_device. Parameters, gradients and every bucket the optimizer
     allocates live on that GPU (it allocates on the parameters' device).
  3. Launcher: torchrun starts the processes and sets RANK, WORLD_SIZE,
     LOCAL_RANK, MASTER_ADDR and MASTER_PORT, so init_process_group reads them
     (env://): no launcher of our own, no free-port search. Results reach rank 0 through
     gather_object instead of files.
  4. Synchronization: CUDA kernels and NCCL collectives return to Python before
     they finish, so a step is timed only after torch.cuda.synchronize().
  5. bf16 on tensor cores: Newton-Schulz's bf16 matmuls run on tensor cores
     with cuBLAS's own summation order, so a GPU result differs from a CPU one in
     the low bits. Bit-identity therefore holds against torch run on the same
     kind of device: the reference runs on rank 0's GPU.
"""

import datetime
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

import distributed_muon_cpu as dm
import muon_tools as mt


def parse(argv):
    parser = mt.build_parser("Distributed Muon on GPUs (NCCL, one process per GPU, launched with torchrun), "
                             "checked bit for bit against torch.optim.Muon / AdamW on the same device.",
                             launcher="torchrun")
    parser.add_argument("--backend", choices=["nccl", "gloo"], default="nccl", help="(default %(default)s)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="(default %(default)s)")
    return parser.parse_args(argv)


def environment():
    """RANK, WORLD_SIZE, LOCAL_RANK from torchrun, or a ValueError saying how to launch."""
    missing = [v for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if v not in os.environ]
    if missing:
        raise ValueError(f"{', '.join(missing)} not set: launch with torchrun --standalone "
                         f"--nproc-per-node N {os.path.basename(__file__)}")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])


def check(args, world):
    if args.dp is None:
        if world % args.tp:
            raise ValueError(f"TP {args.tp} does not divide the world size {world}")
        args.dp = world // args.tp
    cfg = mt.config_from_args(args)
    dm.check_topology(cfg.dp, cfg.tp, world)
    mt.validate(cfg, mt.demo_specs(cfg))
    if args.json:
        mt.check_writable(args.json)
    return cfg


def check_devices(backend, device_kind, local_rank=0):
    """The backend and device flags, and a GPU for LOCAL_RANK local_rank (ValueError)."""
    if backend == "nccl" and device_kind != "cuda":
        raise ValueError("NCCL needs --device cuda; on CPUs use --backend gloo --device cpu")
    if device_kind == "cuda" and torch.cuda.device_count() <= local_rank:
        raise ValueError(f"no CUDA device for LOCAL_RANK {local_rank} here ({torch.cuda.device_count()} GPUs): "
                         f"use --backend gloo --device cpu")


def join_world(backend, device_kind, local_rank, timeout_s):
    """Bind this process to its GPU (cuda:LOCAL_RANK) or the CPU and join torchrun's world; returns the device."""
    device = f"cuda:{local_rank}" if device_kind == "cuda" else "cpu"
    if device_kind == "cuda":
        torch.cuda.set_device(device)
    # device_id binds the NCCL communicator to this rank's GPU up front (else NCCL guesses it from the rank).
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=torch.device(device) if device_kind == "cuda" else None)
    return device


def run_under_torchrun(backend, device_kind, prepare, body, finish, show_traceback=False):
    """What every torchrun entry point of the project does (this file's, examples/train_gpt.py's and
    distributed_muon_dtensor.py's), around its own three parts:

      prepare(world) -> cfg: every check that can be made before joining; a ValueError is the same
          on every rank, so rank 0 alone prints it (exit 2). cfg.timeout_s bounds every collective.
      body(cfg, rank, device) -> this rank's result, gathered at rank 0 (gather_object).
      finish(cfg, results, device, seconds) -> the exit code; rank 0 only, after every rank's body.

    Before joining, a refusal returns 2 (a rank without its GPU says so itself). Once joined, the
    process ends here, with os._exit (below): 0, or finish's code on rank 0. An error in a rank's
    body is printed by that rank, in one line naming it (exit 1); no teardown then: the peers may
    be waiting in a collective, and torchrun stops them.
    """
    try:
        rank, world, local_rank = environment()
        cfg = prepare(world)
        check_devices(backend, device_kind)  # the flags, and a GPU at all: the same on every rank
    except ValueError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        check_devices(backend, device_kind, local_rank)  # this rank's own GPU
    except ValueError as e:
        print(f"error: rank {rank}: {e}", file=sys.stderr)
        return 2
    device = join_world(backend, device_kind, local_rank, cfg.timeout_s)
    try:
        t0 = time.perf_counter()
        result = body(cfg, rank, device)
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
        seconds = time.perf_counter() - t0
    except Exception as e:
        print(f"error: rank {rank} failed: {mt.one_line(e)}", file=sys.stderr, flush=True)
        if show_traceback:
            traceback.print_exc()
        code = 1
    else:
        try:
            code = finish(cfg, gathered, device, seconds) if rank == 0 else 0
        finally:
            dist.destroy_process_group()
    # End the process without Python's interpreter shutdown, as multiprocessing ends a forked rank.
    # destroy_process_group does not stop every Gloo worker thread: DTensor's caches still hold the
    # mesh's process groups. A worker that has just finished this rank's last collective
    # (gather_object's gather, on every rank but 0, which leaves at once) may drop that work's
    # tensors only after the main thread began shutting the interpreter down; freeing them takes
    # the GIL, Python then ends the thread (pthread_exit), and unwinding through the work's
    # destructor calls std::terminate: "terminate called without an active exception", exit -6
    # (a core dump showed exactly this stack; pytorch/pytorch PR 179291 describes the same crash). Without
    # the shutdown, no thread can meet it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv=None):
    args = parse(argv)
    torch.set_num_threads(1)  # as in the CPU script: the CPU-side reference and any CPU ranks agree

    def body(cfg, rank, device):
        if rank == 0:  # the layout every rank builds, printed once
            backend = {"gloo": "Gloo", "nccl": "NCCL"}[args.backend]
            mt.print_header(cfg, mt.plan_optimizer(cfg), "GPU" if args.device == "cuda" else "CPU", backend,
                            args.explain, print)
        return mt.run_steps(rank, cfg, device)

    def finish(cfg, gathered, device, ranks_s):
        if args.device == "cuda":
            print(f"device: {torch.cuda.get_device_name(device)}\n")
        checks, ref_s = mt.verify(cfg, gathered, device)
        results = mt.report(cfg, mt.plan_optimizer(cfg), gathered, checks, ranks_s, ref_s, backend=args.backend)
        results["launcher"] = dict(backend=args.backend, device=args.device,
                                   gpu=torch.cuda.get_device_name(device) if args.device == "cuda" else None)
        mt.write_json(args.json, results)
        return 0 if results["passed"] else 1

    return run_under_torchrun(args.backend, args.device, lambda world: check(args, world), body, finish,
                              args.traceback)


if __name__ == "__main__":
    sys.exit(main())
