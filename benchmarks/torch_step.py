"""How long does torch's own step take on the run a --json file describes? torch.optim.Muon + AdamW in one
process on one device, with the run's model, initial parameters, total gradients and options (the reference
the run was checked against: muon_tools.torch_reference_steps), each step timed alone (after
torch.cuda.synchronize() on a GPU); then the run's median step against torch's, and whether the run was
bit-identical to torch.

    torchrun --standalone --nproc-per-node 1 distributed_muon.py --steps 10 --json run.json   # the GPU twin
    python benchmarks/torch_step.py run.json                                                   # torch, same GPU
    python benchmarks/torch_step.py --device cpu run.json        # a CPU run's file (distributed_muon_cpu.py)

benchmarks/on_gpu.sh runs the first two (part 1b): notes/measured/sibling_vs_torch_1gpu_<gpu>.txt.
"""

import json
import os
import signal
import statistics
import sys

if __name__ == "__main__":  # first, before torch loads: a Ctrl-C waits for the runner (one line, exit 130)
    import muon_forkserver

    muon_forkserver.start_command(spawns_ranks=False)


import torch  # noqa: E402

import muon_tools  # noqa: E402


def build_parser():
    p = muon_tools.OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("run", metavar="RUN.json", help="what --json wrote for the run to compare with")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="where to run (default %(default)s)")
    return p


def read_run(path):
    """(RunConfig, the run's median step in ms, whether it passed) from a run's --json file; ValueError naming
    the file for one that is not there or not such a file."""
    try:
        with open(path) as f:
            run = json.load(f)
        return muon_tools.RunConfig(**run["config"]), run["timings"]["step_ms_median"], run["passed"]
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror}") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a run's --json file ({type(e).__name__}: {e})") from None


def main(argv=None):
    args = build_parser().parse_args(argv)
    cfg, ours, passed = read_run(args.run)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("no CUDA GPU here (torch.cuda.is_available() is False); --device cpu runs on this CPU")
    step_ms = []
    muon_tools.torch_reference_steps(tuple(muon_tools.demo_specs(cfg)), cfg, args.device,
                                     step_ms)  # the run's own reference
    on_gpu = args.device == "cuda"
    theirs = statistics.median(step_ms)
    where = torch.cuda.get_device_name(0) if on_gpu else "this CPU, 1 thread"
    print(f"torch.optim.Muon + AdamW on {where}, same model and {cfg.steps} steps: "
          f"median step {theirs:.1f} ms (min {min(step_ms):.1f})")
    print(f"run / torch step time: {ours / theirs:.2f} ({ours:.1f} against {theirs:.1f} ms); "
          f"bit-identical to torch (the run passed): {passed}")
    return 0


if __name__ == "__main__":
    sys.exit(muon_tools.exit_code(main))
