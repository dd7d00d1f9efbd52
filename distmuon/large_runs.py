"""What large runs add to the lesson's optimizers: fused QKV by blocks, Newton-Schulz on TP pieces, QK-clip.

Section 8 of the lesson, in a file of its own: read distributed_muon_cpu.py's sections 1-6 and
distmuon/owners.py's section 7 first.
torch.optim.Muon orthogonalizes each parameter whole, with one quintic, and does nothing after the
update. Large runs do more; each addition is an option of every optimizer of the lesson
(DistributedMuon, OwnerMuon, CommFreeMuon; the Gram form of the gather strategy only: an owner
receives the whole matrix anyway) and of DTensorMuon, off by default (torch's behaviour), and a flag
of the script:

    row_layouts + ns_blocks   8.1-8.2  a fused QKV orthogonalized as the matrices it stands for
    tp_newton_schulz="gram"   8.3      a matrix TP cuts along its long side orthogonalized where it lies
    qk_clip_tau               8.4      QK-clip (MuonClip) after the step
    ns_coefficients           section 1 of the lesson: one (a, b, c) per iteration (Polar Express);
                                       nothing new moves

The keywords of LargeRuns (8.5), which the lesson's optimizers take as large_runs=LargeRuns(...), and of
DTensorMuon itself (the flags: --ns-blocks, --tp-newton-schulz, --qk-clip TAU, --ns-coefficients):
    row_layouts       {name: RowLayout of its FULL matrix}, which the options below read
    ns_blocks         "whole" (torch's), "blocks" (Q, K, V, each with every head's rows) or "heads" (each
                      head's q, k, v): each block orthogonalized alone, its lr adjusted for its own shape, as
                      torch.optim.Muon on the blocks as separate parameters
    tp_newton_schulz  "gather" (torch's), or "gram" (the gather strategy and DTensorMuon): TP pieces cut
                      along the long side orthogonalized where they lie; not bit-identical, within a bound
    qk_clip_tau       None (off), or a number > 0: clip_qk_(max_logits), called by every rank after step()

An optimizer given a LargeRuns (ns_coefficients is not one of its options: it is section 1's, a param
group's) wraps its strategy in it (LargeRuns.around: WithLargeRuns, 8.5), which changes three points of the
step: where a matrix is orthogonalized (by blocks, or on its TP pieces: the gather flow's middle arrows),
where its update is applied (each block's own learning-rate adjustment: runs_of), and after the step
(clip_qk_):

    opt = OwnerMuon(groups, grid=grid, large_runs=LargeRuns(row_layouts={"qkv.weight": RowLayout(...)},
                                                            ns_blocks="heads", qk_clip_tau=100.0))

Launch recipes:
    python distributed_muon_cpu.py --ns-blocks heads --ns-coefficients polar_express --qk-clip 100
    python distributed_muon_cpu.py --tp-newton-schulz gram   # Gram all-reduces instead of TP gathers
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.profiler import record_function

from distmuon.checks import QK_CLIP_OFF, ns_coefficients_of
from distributed_muon_cpu import (NS_COEFFICIENTS, NS_EPS, NS_STEPS, all_reduce, newton_schulz, newton_schulz_flops,
                                  orthogonalize, orthogonalize_tp_local)

# =============================================================================
# 8. What large runs add: blocks, Polar Express, QK-clip, Newton-Schulz on TP pieces
# =============================================================================
# Five sections: the row layout that names a fused matrix's rows (8.1), orthogonalizing
# by its blocks (8.2), Newton-Schulz on TP pieces (8.3), QK-clip (8.4), and the
# object the optimizers call (8.5). Polar Express is section 1's: one (a, b, c)
# per iteration, and nothing new moves.


# -----------------------------------------------------------------------------
# 8.1 Row layouts: which rows of a fused matrix are which
# -----------------------------------------------------------------------------
# A fused QKV is one parameter to the optimizer, three (or 3 x heads) matrices to
# the model. A RowLayout names its rows, head by head as Megatron lays them out,
# so that the blocks (8.2) and QK-clip's heads (8.4) can be found in any piece of
# it that TP and ZeRO-1 leave on a rank.


QK_SEGMENTS = ("q", "k")  # the segments of a RowLayout that QK-clip scales (8.4)


@dataclass(frozen=True)
class RowLayout:
    """Which rows of a full (TP-gathered) matrix are which: `periods` repeats (one per key head) of
    segments of `sizes` rows named `names`. Segments of one name are one matrix to the model (a block,
    8.2); "q" and "k" are the rows QK-clip scales (8.4). Head by head, as Megatron lays them out:

      multi-head attention, fused QKV:  RowLayout((hd, hd, hd), heads, ("q", "k", "v"))
      its separate W_q (or W_k):        RowLayout((hd,), heads, ("q",))
      GQA, r query heads per key head:  RowLayout((hd,) * r + (hd, hd), kv_heads, ("q",) * r + ("k", "v"))
      its separate W_q:                 RowLayout((hd,) * r, kv_heads, ("q",) * r)

    Query head j of period p is head p * r + j (r "q" segments a period), as in the model's q.view(heads, hd).
    A W_k under GQA is left out of QK-clip (its keys are shared: 8.4)."""
    sizes: tuple
    periods: int = 1
    names: tuple = ()

    @property
    def rows(self):
        return self.periods * sum(self.sizes)

    @property
    def shares_keys(self):
        """Several query heads to a key head (GQA): more than one "q" segment a period."""
        return self.names.count("q") > 1

    @property
    def query_heads(self):
        """The heads QK-clip takes a max logit for: every query head, or a W_k's key heads."""
        return self.periods * max(1, self.names.count("q"))

    def qk_row_heads(self):
        """For each row of the full matrix, the query head whose multiplier scales it (8.4), else -1: the q
        rows of every head; the k rows of a head only where no other query head shares them."""
        heads, q_per_period = [-1] * self.rows, self.names.count("q")
        for p in range(self.periods):
            j = 0
            for segment, name in enumerate(self.names):
                head = p * max(1, q_per_period) + j if name == "q" else p if not self.shares_keys else -1
                if name in QK_SEGMENTS:
                    for r in self.segment_rows(p, segment):
                        heads[r] = head
                j += name == "q"
        return heads

    def segment_rows(self, period, segment):
        start = period * sum(self.sizes) + sum(self.sizes[:segment])
        return range(start, start + self.sizes[segment])

    def blocks(self, per_head=False):
        """Row indices of each matrix Newton-Schulz sees alone: the segments of one name in every period
        joined (Q, K, V; unnamed segments, each of its own), or per_head, each segment of each period alone
        (each query head's q, its key head's k and v)."""
        segments = range(len(self.sizes))
        if per_head:
            return [list(self.segment_rows(p, s)) for p in range(self.periods) for s in segments]
        keys = self.names or segments
        return [[r for p in range(self.periods) for s in segments if keys[s] == key for r in self.segment_rows(p, s)]
                for key in dict.fromkeys(keys)]

    def block_heights(self, per_head=False):
        """For every row, the number of rows of its block (what its learning-rate adjustment sees)."""
        heights = [0] * self.rows
        for rows in self.blocks(per_head):
            for r in rows:
                heights[r] = len(rows)
        return heights

    def tp_piece(self, tp):
        """The layout of one TP rank's rows when the matrix is split along dim 0 in equal parts."""
        if self.periods % tp:
            raise ValueError(f"TP {tp} does not divide the {self.periods} heads of a row layout")
        return replace(self, periods=self.periods // tp)


def not_a_row_layout(name, rows):
    """Why `rows`, given as row_layouts[name], is refused when it is not a RowLayout (one line)."""
    return f"row_layouts[{name!r}] must be a RowLayout (distmuon.RowLayout), got {type(rows).__name__}"


def row_layout_problem(name, rows, matrix_shape, expert_stack=False, qk_clip=False):
    """None if `rows` (a RowLayout) describes the rows of `name`'s full (out, in) matrix, else why not
    (one line); DTensorMuon asks the same of each expert's matrix."""
    if not isinstance(rows, RowLayout):
        return not_a_row_layout(name, rows)
    if not (isinstance(rows.periods, int) and rows.periods >= 1 and rows.sizes
            and all(isinstance(s, int) and s >= 1 for s in rows.sizes)):
        return f"row_layouts[{name!r}]: sizes must be positive integers and periods >= 1 (got {rows})"
    if rows.names and len(rows.names) != len(rows.sizes):
        return f"row_layouts[{name!r}]: {len(rows.names)} names for {len(rows.sizes)} sizes"
    if rows.rows != matrix_shape[0]:
        return (f"row_layouts[{name!r}] has {rows.periods} x {sum(rows.sizes)} = {rows.rows} rows; "
                f"the matrix{' of each expert' if expert_stack else ''} has {matrix_shape[0]}")
    if qk_clip and expert_stack and set(rows.names) & set(QK_SEGMENTS):
        return f"row_layouts[{name!r}]: QK-clip scales attention heads, not the experts of an expert stack"
    if qk_clip and rows.names.count("k") > 1:
        return f"row_layouts[{name!r}]: one \"k\" segment a period (a key head and its query heads), got {rows.names}"
    return None


def check_row_layouts(row_layouts, layout, muon_names, tp, qk_clip):
    """Every row layout names a Muon matrix and describes its full rows; with QK-clip, a matrix TP splits
    by rows gives each TP rank whole heads (the heads whose logits that rank computes)."""
    for name, rows in row_layouts.items():
        if name not in muon_names:
            raise ValueError(f"row_layouts names {name}, which is not a Muon matrix")
        problem = row_layout_problem(name, rows, layout.global_shapes[name])
        if problem:
            raise ValueError(problem)
        if qk_clip and layout.tp_split_dims[name] == 0:
            rows.tp_piece(tp)


# -----------------------------------------------------------------------------
# 8.2 Blocks: each block of rows orthogonalized alone
# -----------------------------------------------------------------------------
# A fused QKV (row_layouts + ns_blocks) is orthogonalized as the matrices it
# stands for: "blocks", Q, K and V, each with every head's rows (Moonlight);
# "heads", each head's q, k and v alone. The blocks are rows of the full matrix,
# which the TP gather (or the gather at the owner) brings anyway: nothing new
# moves. Each run of rows of a rank's part then takes its block's lr adjustment
# (block_runs). Laid out head by head, a split by rows gives every TP rank whole
# heads; a split by columns, every row:
#
#   rows of the full QKV:  q0 k0 v0 | q1 k1 v1 | q2 k2 v2 | q3 k3 v3
#   TP = 2 by rows:        <-------- TP 0 ------> <-------- TP 1 ------>
#   "blocks": Q = q0 q1 q2 q3, K = k0 .. k3, V = v0 .. v3    "heads": q0, k0, v0, q1, ...


def newton_schulz_blocks(full, blocks, steps=NS_STEPS, coefficients=NS_COEFFICIENTS, eps=NS_EPS):
    """Newton-Schulz of each block of rows alone, put back where its rows were (bf16, full's shape).
    A block is contiguous, as the separate parameter it stands for would be: a run of rows is a view of
    (contiguous) full, other rows are copied out."""
    out = torch.empty(full.shape, dtype=torch.bfloat16, device=full.device)
    full = full.contiguous()
    for rows in blocks:
        at = (slice(rows[0], rows[-1] + 1) if rows == list(range(rows[0], rows[-1] + 1))
              else torch.tensor(rows, device=full.device))
        out[at] = newton_schulz(full[at], steps, coefficients, eps)
    return out


def newton_schulz_flops_of(shape, steps, blocks=None):
    """newton_schulz_flops of the matrix, or the sum over its blocks."""
    if blocks is None:
        return newton_schulz_flops(shape, steps)
    return sum(newton_schulz_flops((len(rows), shape[1]), steps) for rows in blocks)


class Blocks:
    """{name: its blocks of rows} and what the step asks of them: orthogonalize, in the place of section 4's (the
    gather flow's, and section 7's newton_schulz_owned), hands a matrix named here to orthogonalize_by_blocks
    (LargeRuns is a Blocks; DTensorMuon makes one for the matrices its owners hold)."""

    def __init__(self, blocks=None):
        self.blocks = dict(blocks or {})

    def flops(self, name, shape, steps):
        return newton_schulz_flops_of(shape, steps, self.blocks.get(name))

    def orthogonalize(self, name, full, group, ledger):
        """The lesson's orthogonalize, or block by block for a matrix named here."""
        if name in self.blocks:
            return self.orthogonalize_by_blocks(name, full, group, ledger)
        return orthogonalize(name, full, group, ledger)

    def orthogonalize_by_blocks(self, name, full, group, ledger):
        """The full matrix `name`, orthogonalized block by block, its FLOPs counted."""
        with record_function("newton-schulz"):
            ortho = newton_schulz_blocks(full, self.blocks[name], group["ns_steps"], group["ns_coefficients"],
                                         group["eps"])
        ledger.record_compute(name, tuple(full.shape), self.flops(name, tuple(full.shape), group["ns_steps"]))
        return ortho


def block_runs(heights, shape, tp_split_dim, tp_rank, part):
    """[(start, stop, rows)]: the part (a slice of the flat TP piece of a TP-local (rows, cols) matrix)
    cut into runs of consecutive elements whose rows lie in blocks of the same height; heights: per
    row of the full matrix (RowLayout.block_heights; or any key per row: QK-clip's heads, 8.4). Under a
    split by rows the piece is a range of them."""
    rows, cols = shape
    first = tp_rank * rows if tp_split_dim == 0 else 0
    runs = []
    for r in range(part.start // cols, -(-part.stop // cols)):
        start, stop = max(r * cols, part.start) - part.start, min((r + 1) * cols, part.stop) - part.start
        height = heights[first + r]
        if runs and runs[-1][2] == height:
            runs[-1] = (runs[-1][0], stop, height)
        else:
            runs.append((start, stop, height))
    return runs


# -----------------------------------------------------------------------------
# 8.3 Newton-Schulz on TP pieces (tp_newton_schulz="gram")
# -----------------------------------------------------------------------------
# For a matrix TP splits along its long side (gather strategy only; Megatron-core's
# "distributed" TP mode), X = [X_1 .. X_TP] (X oriented wide, as Newton-Schulz
# orients it), X X^T = sum_t X_t X_t^T: the TP peers need only the small Gram
# matrix, not each other's pieces. A (m, n) matrix, m < n, split along n never
# meets; its TP ranks add up their Gram matrices instead, each iteration:
#
#   TP 0: X_0 --X_0 X_0^T--\                                      /-- X_0 <- a X_0 + (b A + c A A) X_0
#                           +-- SUM all-reduce: A (m x m) fp32 --+
#   TP 1: X_1 --X_1 X_1^T--/                                      \-- X_1 <- a X_1 + (b A + c A A) X_1
#
# Bytes a TP rank receives per matrix: the gather, (TP - 1)/TP x m n x 2 (bf16);
# the Gram, 2 (TP - 1)/TP x m m x 4 per iteration: fewer only when n > 4 x steps
# x m (20 m at 5 steps). What it always saves is the work: each TP rank does 1/TP
# of the long side instead of the whole matrix. It is not torch's bits (the sum is
# another order): muon_tools.py section 9 bounds it.


def gram_eligible(global_shape, tp_split_dim):
    """Whether a TP split cuts the long side (columns of a wide matrix, rows of a tall one): then
    X X^T of the (transposed-if-tall) matrix is a sum over the TP pieces."""
    rows, cols = global_shape
    return (tp_split_dim == 1 and rows <= cols) or (tp_split_dim == 0 and rows > cols)


def newton_schulz_tp(piece, global_shape, tp, ledger, steps=NS_STEPS, coefficients=NS_COEFFICIENTS, eps=NS_EPS):
    """Newton-Schulz of a matrix split along its long side over the TP ranks, without gathering it:
    this rank's piece of the result (bf16). Per iteration one all-reduce of the small (m, m) Gram
    matrix A = sum_t X_t X_t^T in float32 (m = the short side), then each rank updates its own
    columns, X_t <- a X_t + (b A + c A A) X_t; the Frobenius norm is one all-reduced float. Each
    piece's product is taken in float32 and rounded to bf16 once, after the sum, as torch's bf16
    matmul rounds its float32 accumulation once: what differs from torch's bits is the order of
    the float32 sum, hence a near-tie now and then rounded the other way (bounded, not bit-identical)."""
    tall = global_shape[0] > global_shape[1]
    x = piece.bfloat16()
    if tall:
        x = x.mT
    norm_sq = all_reduce(x.float().square().sum().reshape(1), tp, ledger, "TP Gram norm")
    x = x / norm_sq.sqrt().to(torch.bfloat16).clamp(min=eps)
    for a, b, c in ns_coefficients_of(coefficients, steps):
        xf = x.float()
        gram = all_reduce(xf @ xf.mT, tp, ledger, "TP Gram").bfloat16()
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.mT if tall else x


def newton_schulz_tp_flops(global_shape, tp, steps=NS_STEPS):
    """One TP rank's matmul FLOPs in newton_schulz_tp: its 1/TP of the long side in X X^T and poly X,
    the whole (m, m) A A."""
    m, n = sorted(global_shape)
    return steps * (4 * m * m * (n // tp) + 2 * m * m * m)


# -----------------------------------------------------------------------------
# 8.4 QK-clip, after the step
# -----------------------------------------------------------------------------
# QK-clip (MuonClip, Kimi K2, arXiv 2507.20534; qk_clip_tau, then clip_qk_ after
# the step): an attention head whose largest pre-softmax logit S exceeded tau has
# its logits scaled back to tau. S is known where the head's attention was
# computed: on each DP rank (its own batch), on the TP rank that holds the head.
# The contract, the lesson's optimizers' and DTensorMuon's alike: every rank
# passes {name: one float32 per query head of the FULL matrix}, the largest logit
# it computed for each, -inf for the heads it did not compute (or leaves the name
# out). One MAX all-reduce over the optimizer's ranks carries every head's maxima
# and, last, the refusing rank (rank + 1, 0 for none): H + 1 floats. Every rank then
# scales the q and k rows it holds (the weights are whole on every DP rank again
# after the step) and none is left out or counted twice:
#
#   every rank: [S_0 .. S_{H-1} of the heads it computed, -inf elsewhere | refused? rank + 1 : 0]
#        --> one MAX all-reduce over the optimizer's ranks -->  S_h for every head, or every rank raises
#   every rank: q rows of head h (and its own k rows) times gamma_h or sqrt(gamma_h), gamma_h = min(1, tau / S_h)
#
# Which rows take which multiplier is the report's per-head rule: with one query
# head per key head (MHA), q_h and k_h each times sqrt(gamma_h); with keys shared by
# a group of query heads (GQA), each query head's q_h times gamma_h and the shared
# k untouched, as Kimi K2 leaves MLA's shared rotary key alone and scales each
# head's rotary query by gamma_h. That keeps each head's own gamma: scaling the shared
# k by the group's smallest would shrink every other head of the group too.


def qk_clip_scales(max_logits, tau, shares_keys=False):
    """The multiplier of each head's scaled rows: gamma_h = min(1, tau / S_max_h) on its q rows where keys
    are shared (GQA), else sqrt(gamma_h) on its q rows and on its k rows (MHA), so its logits q.k shrink by
    gamma_h when q and k have no bias (Kimi's models have none); with a QKV bias, as the demo's and the GPT's,
    only the weights' part shrinks, so a clipped head's next logits are near tau, not capped at it.
    Python floats (computed in double), one per head: the same multiplier wherever the rows lie."""
    gammas = [min(1.0, tau / s) if s > tau else 1.0 for s in max_logits.tolist()]
    return gammas if shares_keys else [math.sqrt(g) for g in gammas]


def qk_heads(row_layouts, names):
    """{laid-out matrix with q or k rows: its query heads}, in the order of `names` (the same on every rank)."""
    return {n: row_layouts[n].query_heads for n in names
            if n in row_layouts and set(row_layouts[n].names) & set(QK_SEGMENTS)}


def exchange_max_logits(max_logits, heads, problem, me, axis, ledger, device):
    """The one collective of QK-clip, for every optimizer: {name: S_h of each head, the max over the ranks of
    `axis`}, or a ValueError on every rank if any rank's `problem` (its input, one line) is not None: this
    rank's own problem, named "rank R: ...", or the (highest) rank that refused; nothing changed."""
    maxima = torch.full((sum(heads.values()) + 1,), -math.inf, dtype=torch.float32, device=device)
    where, start = {}, 0
    for name, count in heads.items():
        where[name] = slice(start, start + count)
        if problem is None and name in max_logits:
            maxima[where[name]] = max_logits[name].to(device)
        start += count
    maxima[-1] = me + 1 if problem else 0  # exact in float32 for any rank below 2**24
    all_reduce(maxima, axis, ledger, "QK-clip maxima", dist.ReduceOp.MAX)
    if problem:
        raise ValueError(f"rank {me}: {problem}")
    if maxima[-1] > 0:
        raise ValueError(f"rank {int(maxima[-1]) - 1} refused clip_qk_ (it raised why); nothing changed")
    return {name: maxima[w].cpu() for name, w in where.items()}


def max_logits_problem(max_logits, heads):
    """Why clip_qk_ cannot take max_logits (one line), or None; heads: qk_heads, empty when QK-clip is off."""
    if not heads:
        return QK_CLIP_OFF
    if not isinstance(max_logits, dict):
        return f"max_logits must be a dict {{param name: (heads,) float32 tensor}} (got {type(max_logits).__name__})"
    for name, s in max_logits.items():
        if name not in heads:
            return (f"max_logits names {name!r}, which QK-clip does not scale (it scales {', '.join(heads)}: "
                    f"parameters laid out with q or k segments)")
        if not torch.is_tensor(s) or s.dtype != torch.float32 or tuple(s.shape) != (heads[name],):
            what = f"{s.dtype} of shape {tuple(s.shape)}" if torch.is_tensor(s) else type(s).__name__
            return f"max_logits[{name!r}] must be a float32 tensor of shape ({heads[name]},) (got {what})"
        if torch.isnan(s).any() or (s == math.inf).any():
            return f"max_logits[{name!r}] holds NaN or +inf (a head no rank computed is -inf)"
    return None


# -----------------------------------------------------------------------------
# 8.5 The options, and what the optimizers call
# -----------------------------------------------------------------------------
# The lesson's optimizers build a LargeRuns when any option is on: it checks the
# options at once (before the parameters), wraps the optimizer's strategy
# (WithLargeRuns), plans once the optimizer knows its layout (which matrices go by
# blocks, which on their TP pieces, the runs of rows of each rank's part), and serves the
# step's three calls through the strategy it wraps.


NS_BLOCKS = ("whole", "blocks", "heads")  # torch's whole matrix; each segment with all heads joined; each head's alone
TP_NEWTON_SCHULZ = ("gather", "gram")  # TP gather -> NS -> TP shard; or newton_schulz_tp where eligible


def check_large_run_options(name=str, *, ns_blocks, tp_newton_schulz, qk_clip_tau):
    """The options of what large runs add (DistributedMuon's docstring), spelled as check_hyperparameters spells them."""
    if ns_blocks not in NS_BLOCKS:
        raise ValueError(f"{name('ns_blocks')} must be one of {', '.join(NS_BLOCKS)} (got {ns_blocks!r})")
    if tp_newton_schulz not in TP_NEWTON_SCHULZ:
        raise ValueError(f"{name('tp_newton_schulz')} must be one of {', '.join(TP_NEWTON_SCHULZ)} "
                         f"(got {tp_newton_schulz!r})")
    if qk_clip_tau is not None and (isinstance(qk_clip_tau, bool) or not isinstance(qk_clip_tau, (int, float))
                                    or not (qk_clip_tau > 0 and math.isfinite(qk_clip_tau))):
        raise ValueError(f"{name('qk_clip_tau')} must be a number > 0 and finite (got {qk_clip_tau!r})")


def check_row_layouts_kind(row_layouts):
    """row_layouts of the wrong kind refused in one line: None or a dict {parameter name: RowLayout}; what each layout
    describes is checked once the parameters are known (check_row_layouts, row_layout_problem)."""
    if row_layouts is not None and not isinstance(row_layouts, dict):  # dict() would take a list of pairs
        raise ValueError(f"row_layouts must be a dict {{parameter name: RowLayout}} (got {type(row_layouts).__name__})")
    for name, rows in (row_layouts or {}).items():
        if not isinstance(name, str):
            raise ValueError(f"row_layouts must be a dict {{parameter name: RowLayout}} (got a key {name!r})")
        if not isinstance(rows, RowLayout):
            raise ValueError(not_a_row_layout(name, rows))


def check_owner_tp_newton_schulz(strategy, tp_newton_schulz):
    """The owner strategies refuse tp_newton_schulz="gram": it has every TP peer orthogonalize its own
    piece, which is the gather strategy (an owner receives the whole matrix anyway)."""
    if tp_newton_schulz != "gather":
        raise ValueError(f"tp_newton_schulz={tp_newton_schulz!r} applies to the gather strategy only: strategy "
                         f"{strategy} orthogonalizes each matrix whole on one owner, which receives it anyway")


def check_normuon_options(normuon, blocked):
    """NorMuon's matrices (normuon) are orthogonalized whole: their rows are normalized over the whole matrix, which
    blocks (blocked: {name: layout}) would cut in pieces; refused in one line."""
    both = sorted(set(normuon) & set(blocked))
    if both:
        raise ValueError(f"ns_blocks applies to Muon's matrices; {', '.join(both)} belong to a NorMuon group, whose "
                         f"rows are normalized over the whole matrix")


class WithLargeRuns:
    """A strategy with what large runs add, wrapped around it: LargeRuns plans first (blocks, the Gram form), the
    strategy then (its owners weigh blocks by their FLOPs), LargeRuns last (the runs of rows of each rank's part); a
    blocked matrix's update takes its runs' lr adjustments; clip_qk_ is LargeRuns'. Every other call is the
    strategy's."""

    def __init__(self, strategy, large_runs):
        self.strategy, self.large_runs = strategy, large_runs

    def __getattr__(self, name):  # the wrapped strategy's name, owners, routes, units, ...
        if name.startswith("__") or "strategy" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["strategy"], name)

    def plan(self, opt):
        self.large_runs.plan(opt)
        self.strategy.plan(opt)
        self.large_runs.plan_parts(opt)

    def runs_of(self, name):
        return self.large_runs.runs.get(name)

    def clip_qk_(self, opt, max_logits):
        return self.large_runs.clip_qk_(opt, max_logits)


class LargeRuns(Blocks):
    """What large runs add, given to an optimizer of the lesson as large_runs=LargeRuns(...): the options
    are this module's docstring's keywords, each off by default (torch's behaviour), checked here at once.
    One per optimizer: it plans for the optimizer it is given to (an owner strategy refuses the Gram form)."""

    def __init__(self, *, row_layouts=None, ns_blocks="whole", tp_newton_schulz="gather", qk_clip_tau=None):
        check_large_run_options(ns_blocks=ns_blocks, tp_newton_schulz=tp_newton_schulz, qk_clip_tau=qk_clip_tau)
        check_row_layouts_kind(row_layouts)
        self.row_layouts, self.ns_blocks = dict(row_layouts or {}), ns_blocks
        self.tp_newton_schulz, self.qk_clip_tau = tp_newton_schulz, qk_clip_tau
        super().__init__()
        self.gram, self.runs, self.optimizer = set(), {}, None

    def plan(self, optimizer):
        """Once the layout is known: {name: its blocks of rows}, and the matrices newton_schulz_tp takes."""
        if self.optimizer not in (None, optimizer):
            raise ValueError("this LargeRuns serves another optimizer already: give each optimizer its own")
        if optimizer.strategy.orthogonalizes_once:
            check_owner_tp_newton_schulz(optimizer.strategy.name, self.tp_newton_schulz)
        self.optimizer = optimizer
        layout, grid = optimizer.layout, optimizer.grid
        check_row_layouts(self.row_layouts, layout, optimizer.muon_names, grid.tp.size, self.qk_clip_tau is not None)
        normuon = [n for n in optimizer.muon_names if optimizer.group_of[n]["algorithm"] == "normuon"]
        check_normuon_options(normuon, self.row_layouts if self.ns_blocks != "whole" else {})
        if self.ns_blocks != "whole":
            self.blocks = {n: rows.blocks(self.ns_blocks == "heads") for n, rows in self.row_layouts.items()}
        if self.ns_blocks != "whole" and not self.row_layouts:
            raise ValueError(f"ns_blocks={self.ns_blocks!r} needs row_layouts (which rows make which block)")
        self.gram = {n for n in optimizer.muon_names if self.tp_newton_schulz == "gram" and grid.tp.size > 1
                     and n not in self.blocks and gram_eligible(layout.global_shapes[n], layout.tp_split_dims[n])}

    def plan_parts(self, optimizer):
        """Once each rank's parts are known: the runs of rows of each blocked matrix's part (block_runs)."""
        per_head = self.ns_blocks == "heads"

        def runs(n, part):
            return block_runs(self.row_layouts[n].block_heights(per_head), tuple(optimizer.param_by_name[n].shape),
                              optimizer.layout.tp_split_dims[n], optimizer.grid.tp.rank, part)
        self.runs = {n: runs(n, optimizer.strategy.part_of(optimizer, n, optimizer.grid.dp.rank)) for n in self.blocks}
        # the whole TP piece's, for a comm-free rank that applies another DP row's update to its copy
        self.whole_runs = {n: runs(n, slice(0, optimizer.param_by_name[n].numel())) for n in self.blocks}

    def around(self, strategy):
        """The optimizer's strategy with what large runs add (WithLargeRuns); a strategy that runs the gather flow
        (one that does not orthogonalize each matrix once) as a copy of it with this middle. One with a middle of its
        own is refused (ValueError): this middle would replace it."""
        if not strategy.orthogonalizes_once:
            if getattr(strategy, "middle", orthogonalize_tp_local) is not orthogonalize_tp_local:
                raise ValueError(f"strategy {strategy.name!r} has a middle of its own, which large runs (row_layouts, "
                                 f"ns_blocks, tp_newton_schulz, qk_clip_tau) would replace with the gather flow's: "
                                 f"leave them off, or declare orthogonalizes_once and handle them in the strategy")
            strategy = copy.copy(strategy)
            strategy.middle = self.middle
        return WithLargeRuns(strategy, self)

    def middle(self, tp_local, meta, group, grid, ledger):
        """The gather flow's three middle arrows for one matrix: on its TP piece where it lies (gram), else TP
        gather -> Newton-Schulz (by blocks where named) -> TP shard."""
        if meta.name in self.gram:
            return self.orthogonalize_tp_piece(tp_local, meta, group, grid, ledger)
        return orthogonalize_tp_local(tp_local, meta, group, grid, ledger, self.orthogonalize)

    def orthogonalize_tp_piece(self, tp_local, meta, group, grid, ledger):
        """This TP rank's piece of the orthogonalized matrix, from its piece alone (every TP peer takes
        part: they share this DP shard, so they touch it too)."""
        steps = group["ns_steps"]
        with record_function("newton-schulz"):
            tp_piece = newton_schulz_tp(tp_local, meta.global_shape, grid.tp, ledger, steps,
                                        group["ns_coefficients"], group["eps"])
        ledger.record_compute(meta.name, meta.global_shape, newton_schulz_tp_flops(meta.global_shape,
                                                                                    grid.tp.size, steps))
        return tp_piece

    @torch.no_grad()
    def clip_qk_(self, optimizer, max_logits):
        """QK-clip: scale the q (and unshared k) rows of every head whose largest logit S exceeded
        qk_clip_tau (qk_clip_scales). Collective: every rank calls it after step(), when every rank holds
        its whole TP piece again, and scales the rows of that piece. The contract, DTensorMuon's too:

        max_logits: {name: float32 tensor (query heads,) over the FULL matrix's heads (RowLayout.query_heads;
        a W_k's: its key heads)}, the largest logit this rank computed for each head, -inf for heads it did
        not compute; names: any of the laid-out matrices with "q" or "k" rows (qk_heads), a name left out
        counting as -inf for every head (ranks may leave out different ones). Refused on every rank before
        anything changes, naming the rank, if any rank's is bad: QK-clip off, an unknown name, not float32
        of (heads,), NaN or +inf (max_logits_problem).
        Returns {every laid-out name with q or k rows: [multiplier of each head's q rows (qk_clip_scales);
        None for a head of whose scaled rows this rank holds none]}.
        What moves: exchange_max_logits, one MAX all-reduce over the world of H + 1 float32 (H: the heads of
        every such matrix), whatever TP and DP cut.
        """
        heads = qk_heads(self.row_layouts, optimizer.param_by_name) if self.qk_clip_tau is not None else {}
        problem = max_logits_problem(max_logits, heads)
        grid = optimizer.grid
        maxima = exchange_max_logits(max_logits, heads, problem, grid.rank, grid.world, optimizer.ledger,
                                     optimizer.device)
        multipliers = {}
        for name, s in maxima.items():
            layout, weight = self.row_layouts[name], optimizer.param_by_name[name]
            scales = qk_clip_scales(s, self.qk_clip_tau, layout.shares_keys)
            # runs of this TP piece's elements whose rows take one head's multiplier (-1: none), as 8.2 cuts blocks
            runs = block_runs(layout.qk_row_heads(), tuple(weight.shape), optimizer.layout.tp_split_dims[name],
                              grid.tp.rank, slice(0, weight.numel()))
            for start, stop, head in runs:
                if head >= 0 and scales[head] != 1.0:
                    weight.view(-1)[start:stop].mul_(scales[head])
            held = {head for _, _, head in runs}
            multipliers[name] = [m if h in held else None for h, m in enumerate(scales)]
        return multipliers

