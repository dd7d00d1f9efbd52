"""The singular values each Newton-Schulz choice reaches on real gradients from the GPT, iteration by
iteration, at equal FLOPs: Keller Jordan's one quintic (3.4445, -4.7750, 2.0315) every iteration
("jordan", torch.optim.Muon's) against Polar Express's one quintic per iteration ("polar_express",
Amsel et al., arXiv 2505.16932, Algorithm 1; its Figure shows the same thing on random matrices).
Both do the same three matmuls per iteration, so k iterations of either cost the same FLOPs.

    python benchmarks/ns_coefficients.py                      # the GPT of examples/train_gpt.py, 20 steps
    python benchmarks/ns_coefficients.py --steps 8 --train-steps 50

What it does: trains examples/gpt.py (one process, TP = 1, torch.optim.Muon + AdamW, the defaults of
examples/train_gpt.py, on the standard library's text) for --train-steps steps, takes one more
step's gradient G of every hidden matrix and the matrix Muon would orthogonalize with it (the
Nesterov update U = G.lerp(B', momentum), B' = B.lerp(G, 1 - momentum), torch.optim.Muon's), runs
the lesson's newton_schulz (distributed_muon_cpu.py, section 1: bf16, torch's normalization) on each
with the first k iterations of each choice, k = 1 .. --steps, and prints the range of the result's
singular values (float64 torch.linalg.svdvals of the bf16 result) over the matrices of each shape.
Orthogonal would be 1 everywhere; the paper's figure plots exactly this range.
"""

import os
import statistics
import sys
import time
from dataclasses import replace

if __name__ == "__main__":  # first, before torch loads: a Ctrl-C waits for the runner (one line, exit 130)
    import muon_forkserver

    muon_forkserver.start_command(spawns_ranks=False)

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

import distributed_muon_cpu  # noqa: E402
from distmuon import checks  # noqa: E402
import muon_tools  # noqa: E402
from examples import gpt_verify  # noqa: E402
from examples import train_gpt  # noqa: E402
from examples.gpt import muon_params  # noqa: E402

CHOICES = tuple(checks.NS_COEFFICIENT_CHOICES)  # jordan, polar_express
WITHIN = 0.1  # the summary counts the singular values within this of 1


def real_matrices(cfg, train_steps):
    """[(name, source, matrix)] of every hidden matrix after train_steps steps of one-process training:
    source "gradient" (the next step's total gradient) and "update" (what Muon orthogonalizes with it)."""
    model, optimizers = gpt_verify.reference_model(cfg, "cpu")
    for step in range(1, train_steps + 1):
        gpt_verify.accumulate_gradients(model, cfg, step, "cpu")
        optimizers.step(step)
        model.zero_grad(set_to_none=True)
    gpt_verify.accumulate_gradients(model, cfg, train_steps + 1, "cpu")
    muon = next(o for o in optimizers.optimizers if isinstance(o, torch.optim.Muon))
    out = []
    for name in muon_params(model):
        p = model.get_parameter(name)
        grad = p.grad.detach().clone()
        buf = muon.state[p]["momentum_buffer"].lerp(grad, 1 - cfg.momentum) if train_steps else grad
        out += [(name, "gradient", grad), (name, "update", grad.lerp(buf, cfg.momentum))]
    return out


def sigmas(matrix, choice, steps):
    """[singular values (float64) after k iterations of `choice`] for k = 0 (the normalized input, bf16
    as newton_schulz casts it) .. steps."""
    x = matrix.bfloat16()
    out = [x / x.norm().clamp(min=distributed_muon_cpu.NS_EPS)]
    for k in range(1, steps + 1):
        out.append(distributed_muon_cpu.newton_schulz(matrix, k, checks.ns_coefficients_of(choice, k)))
    return [torch.linalg.svdvals(y.double()) for y in out]


def measure(cfg, train_steps, steps):
    """{(shape, source, choice): [(min, max) over the matrices, per k]}, {(choice, k): every matrix's sigma
    after k iterations}, {(shape, source): how many matrices}."""
    table, finals = {}, {}
    matrices = real_matrices(cfg, train_steps)
    for name, source, m in matrices:
        for choice in CHOICES:
            per_k = sigmas(m, choice, steps)
            ranges = [(s.min().item(), s.max().item()) for s in per_k]
            key = (tuple(m.shape), source, choice)
            prev = table.get(key)
            table[key] = ranges if prev is None else [(min(a[0], b[0]), max(a[1], b[1]))
                                                       for a, b in zip(prev, ranges)]
            for k, s in enumerate(per_k):
                finals.setdefault((choice, k), []).append(s)
    counts = {}
    for name, source, m in matrices:
        counts[(tuple(m.shape), source)] = counts.get((tuple(m.shape), source), 0) + 1
    return table, finals, counts


def cell(lo_hi):
    return f"{lo_hi[0]:.3g}..{lo_hi[1]:.3g}"


def format_report(cfg, train_steps, steps, table, finals, counts):
    lines = [f"Singular values after Newton-Schulz on the GPT's real matrices (examples/gpt.py, {cfg.layers} layers x "
             f"d={cfg.d_model}, after {train_steps} steps of torch.optim.Muon + AdamW at lr {cfg.lr:g}), "
             f"torch {torch.__version__}",
             "sigma: float64 svdvals of the bf16 result; 'input': the bf16 matrix over its Frobenius norm, as "
             "Newton-Schulz starts; k: iterations (equal FLOPs at equal k: the same 3 matmuls each)", ""]
    header = ["shape", "matrix", "n", "choice", "input"] + [f"k={k}" for k in range(1, steps + 1)] + \
             [f"MFLOP at k={steps}"]
    rows = []
    for (shape, source, choice), ranges in table.items():
        rows.append([f"{shape[0]}x{shape[1]}", source, counts[shape, source], choice] + [cell(r) for r in ranges]
                    + [f"{distributed_muon_cpu.newton_schulz_flops(shape, steps) / 1e6:.2f}"])
    lines.append(muon_tools.format_table(header, rows, ["<", "<", ">", "<"] + [">"] * (steps + 2)))
    lines.append("")
    for k in sorted({min(distributed_muon_cpu.NS_STEPS, steps), steps}):
        for choice in CHOICES:
            s = torch.cat(finals[choice, k])
            near = (s - 1).abs().le(WITHIN).double().mean().item()
            lines.append(f"k={k} {choice:<14} all {len(finals[choice, k])} matrices: sigma {s.min().item():.3g} .. "
                         f"{s.max().item():.3g}, median {statistics.median(s.tolist()):.3f}, {near:.1%} of the "
                         f"{s.numel()} within {WITHIN:g} of 1")
    return "\n".join(lines)


def build_parser():
    p = muon_tools.OneLineParser(description="Singular values after each Newton-Schulz choice on the GPT's real gradients.")
    p.add_argument("--steps", type=int, default=distributed_muon_cpu.NS_STEPS,
                   help="Newton-Schulz iterations shown (default %(default)s)")
    p.add_argument("--train-steps", type=int, default=20,
                   help="training steps before the gradients are taken (default %(default)s)")
    p.add_argument("--d-model", type=int, default=train_gpt.TrainConfig.d_model, help="(default %(default)s)")
    p.add_argument("--layers", type=int, default=train_gpt.TrainConfig.layers, help="(default %(default)s)")
    p.add_argument("--heads", type=int, default=train_gpt.TrainConfig.heads, help="(default %(default)s)")
    p.add_argument("--lr", type=float, default=train_gpt.TrainConfig.lr, help="(default %(default)s)")
    return p


def config_of(args):
    if args.steps < 1 or args.train_steps < 0:
        raise ValueError(f"--steps must be >= 1 and --train-steps >= 0 (got {args.steps}, {args.train_steps})")
    cfg = replace(train_gpt.TrainConfig(), dp=1, tp=1, d_model=args.d_model, layers=args.layers, heads=args.heads,
                  lr=args.lr, steps=max(args.train_steps, 1))
    train_gpt.validate(cfg)
    return cfg


def main(argv=None):
    args = build_parser().parse_args(argv)

    def work():
        cfg = config_of(args)
        torch.set_num_threads(1)
        t0 = time.perf_counter()
        table, finals, counts = measure(cfg, args.train_steps, args.steps)
        print(format_report(cfg, args.train_steps, args.steps, table, finals, counts))
        print(f"\nWall time: {time.perf_counter() - t0:.1f} s")
        return 0

    return muon_tools.exit_code(work)


if __name__ == "__main__":
    sys.exit(main())
