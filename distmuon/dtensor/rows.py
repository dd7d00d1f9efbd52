"""Rows of a laid-out matrix on any local piece: fused blocks and QK-clip for DTensorMuon.

Part of DTensorMuon (distmuon/dtensor/), section 3b of its reading order: the lesson's RowLayout (distmuon/
large_runs.py) names the rows of a FULL matrix; here, which of them a rank's local piece holds.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.profiler import record_function

from distmuon import large_runs
import distributed_muon_cpu
from distmuon.checks import ORTHOGONALIZED
from distmuon.dtensor.placements import local_box, local_of

# -----------------------------------------------------------------------------
# 3b. Rows of a laid-out matrix: fused blocks and QK-clip, on any local piece
# -----------------------------------------------------------------------------
# distmuon/large_runs.py's RowLayout (the lesson's section 8) names the rows of a FULL matrix: a
# fused QKV laid out head by head is periods = heads of segments (q, k, v). Two
# additions need to know which rows a rank's LOCAL piece holds, whatever cut it
# (FSDP2's Shard(0) or _StridedShard on dp, TP's Shard(0) or Shard(1)):
#
#   blocks   the owner orthogonalizes each block alone (large_runs.newton_schulz_blocks:
#            "blocks" joins a segment across heads, Q K V; "heads" takes each
#            segment of each head), so each block's update takes the adjusted lr
#            of its OWN (rows, cols), as torch.optim.Muon on the blocks as
#            separate parameters would;
#   QK-clip  after the step, the rows of query head h (its "q" rows, and its
#            "k" rows where no other head shares them: RowLayout.qk_row_heads)
#            are multiplied by its multiplier (section 5, clip_qk_).
#
# local_box (section 2) gives the rows (and experts) of the local piece, hence
# the row of each local element. Consecutive local elements with the same key (its
# block's height, or its head) make one run (found on the rows, never element by
# element), and each run is ONE elementwise call on a slice of the flat
# local tensor (the lesson's apply_muon_update_ with the block's shape, or
# mul_): the op torch runs on each separate block, hence torch's bits; never a
# per-row multiply by a tensor of factors.
#
#   fused QKV, 2 heads of (q 3, k 2, v 2) = 14 rows; TP Shard(1) keeps every row:
#     local flat order:  q0 q0 q0 k0 k0 v0 v0 q1 q1 q1 k1 k1 v1 v1   (one row each)
#     block heights:     6  6  6  4  4  4  4  6  6  6  4  4  4  4    4 runs, 4 add_
#     QK-clip heads:     0  0  0  0  0  -  -  1  1  1  1  1  -  -    2 runs, 2 mul_
# An expert stack (E, out, in) takes the layout of ONE expert's (out, in): every
# expert is its own matrix (section 3), so its blocks are too (e.g. a fused
# SwiGLU gate | up, orthogonalized as gate and up); QK-clip, which scales
# attention heads, does not apply to an expert stack (refused).
QK_SEGMENTS = large_runs.QK_SEGMENTS  # the segments of a RowLayout that QK-clip scales


def runs(keys):
    """[(start, stop, key)] of each run of equal consecutive values of a 1-D integer tensor; keys < 0 left out."""
    if keys.numel() == 0:
        return []
    change = (torch.nonzero(keys[1:] != keys[:-1]).view(-1) + 1).tolist()
    starts, stops = [0] + change, change + [keys.numel()]
    return [(a, b, k) for a, b, k in zip(starts, stops, keys[starts].tolist()) if k >= 0]


def row_runs(copy, coordinate, row_keys):
    """[(start, stop, key)] of each run of equal keys in the local flat order of the rank at `coordinate` (a plain
    tensor's coordinate is ()): row_keys gives each row of a matrix (of one expert's, for a stack) its key; keys < 0
    left out. Found on the local rows (every expert's in turn), each run then whole rows of the local piece."""
    box = local_box(copy.shape, copy.mesh_shape, copy.placements, coordinate)
    (r0, r1), (c0, c1) = box[-2:]
    experts = box[0][1] - box[0][0] if copy.expert_stack else 1
    width = c1 - c0
    if width == 0:
        return []
    return [(a * width, b * width, k) for a, b, k in runs(row_keys[r0:r1].repeat(experts))]


def tp_axis(opt, m):
    """The TP group of this rank's row of matrix m's mesh, as the lesson's Axis (what newton_schulz_tp sums over)."""
    group = opt.param_by_name[m.copy.name].device_mesh.get_group(m.tp_dim)
    ranks = tuple(dist.get_process_group_ranks(group))
    return distributed_muon_cpu.Axis("TP", len(ranks), ranks.index(opt.me), ranks, group)


# The options of what large runs add, as DTensorMuon takes them (its constructor's keywords: the lesson's LargeRuns
# describes each), checked, agreed on by every rank, and applied to this rank's local pieces.
class DTensorLargeRuns:
    """row_layouts, ns_blocks, tp_newton_schulz and qk_clip_tau of one DTensorMuon, which it holds as the
    lesson's optimizers hold a LargeRuns. problem() checks them against the parameters; plan_rows() finds, on this rank's
    local pieces, the runs of rows that take one block's lr (block_runs) or one head's QK-clip (clip_runs)."""

    def __init__(self, row_layouts=None, ns_blocks="whole", tp_newton_schulz="gather", qk_clip_tau=None):
        self.row_layouts, self.ns_blocks = dict(row_layouts or {}), ns_blocks
        self.tp_newton_schulz, self.qk_clip_tau = tp_newton_schulz, qk_clip_tau
        self.block_runs, self.clip_runs, self.clip_names = {}, {}, []

    def options_problem(self):
        """The lesson's check of ns_blocks, tp_newton_schulz and qk_clip_tau (one line), or None."""
        try:
            large_runs.check_large_run_options(ns_blocks=self.ns_blocks, tp_newton_schulz=self.tp_newton_schulz,
                                        qk_clip_tau=self.qk_clip_tau)
        except ValueError as e:
            return str(e)
        return None

    def problem(self, opt, explicit):
        """The options checked against opt's parameters (explicit: a distributed_config of your own callables);
        the first problem as one line, or None."""
        why = self.options_problem()
        if why:
            return why
        if explicit and (self.row_layouts or self.qk_clip_tau is not None or self.tp_newton_schulz != "gather"):
            return ("row_layouts, qk_clip_tau and tp_newton_schulz='gram' need the automatic distributed_config: "
                    "your gather puts each matrix together whole, and the rows of your local pieces are not known here")
        normuon = [n for n, g in opt.group_of.items() if g["algorithm"] == "normuon"]
        if normuon and self.tp_newton_schulz != "gather":
            return (f"tp_newton_schulz={self.tp_newton_schulz!r} applies to Muon's matrices: NorMuon's ({normuon[0]}, "
                    f"...) normalize the rows of the whole matrix, at its owner")
        for name, layout in self.row_layouts.items():
            p = opt.param_by_name.get(name)
            if p is None or opt.group_of[name]["algorithm"] not in ORTHOGONALIZED:
                return f"row_layouts names no Muon parameter: {name}"
            if self.ns_blocks != "whole" and opt.group_of[name]["algorithm"] == "normuon":
                return (f"ns_blocks={self.ns_blocks!r} applies to Muon's matrices; {name} belongs to a NorMuon group, "
                        f"whose rows are normalized over the whole matrix")
            why = large_runs.row_layout_problem(name, layout, tuple(p.shape)[-2:], name in opt.expert_stacks,
                                         self.qk_clip_tau is not None)
            if why:
                return why
        if self.ns_blocks != "whole" and not self.row_layouts:
            return f"ns_blocks={self.ns_blocks!r} needs row_layouts (which rows make which block)"
        if self.qk_clip_tau is not None and not self.qk_names():
            return f"qk_clip_tau needs row_layouts with segments named {' or '.join(QK_SEGMENTS)} (the rows it scales)"
        return None

    def qk_names(self):
        """The parameters QK-clip scales: those laid out with a "q" or "k" segment, sorted (the same on every rank)."""
        return sorted(n for n, layout in self.row_layouts.items() if set(layout.names) & set(QK_SEGMENTS))

    def agreed(self):
        """What every rank must agree on (compared across ranks at construction)."""
        return (sorted(self.row_layouts.items(), key=lambda item: item[0]), self.ns_blocks, self.tp_newton_schulz,
                self.qk_clip_tau)

    def blocks_of(self, matrices, param_of_matrix):
        """{matrix: its blocks of rows} of the matrices ns_blocks orthogonalizes block by block (the lesson's Blocks)."""
        per_head = self.ns_blocks == "heads"
        return large_runs.Blocks({m: self.row_layouts[param_of_matrix[m]].blocks(per_head) for m in matrices
                           if self.ns_blocks != "whole" and param_of_matrix[m] in self.row_layouts})

    def flops_of(self, copy, steps):
        """Newton-Schulz FLOPs of one matrix of `copy`: whole, or block by block (3b)."""
        layout = self.row_layouts.get(copy.name) if self.ns_blocks != "whole" else None
        return large_runs.newton_schulz_flops_of(copy.matrix_shape, steps,
                                                 layout and layout.blocks(self.ns_blocks == "heads"))

    def tp_dim_of(self, copy):
        """Section 3c: the mesh dim named "tp" if tp_newton_schulz="gram" and it cuts this 2-D matrix's long side
        (Shard, more than one rank), else -1 (gathered whole; so are expert stacks and blocked matrices)."""
        names = copy.mesh_dim_names
        if (self.tp_newton_schulz != "gram" or copy.expert_stack or "tp" not in names
                or (self.ns_blocks != "whole" and copy.name in self.row_layouts)):
            return -1
        d = names.index("tp")
        p = copy.placements[d]
        return d if type(p) is Shard and copy.mesh_shape[d] > 1 and large_runs.gram_eligible(copy.shape, p.dim) else -1

    def newton_schulz_pieces(self, opt, full, pieces, group_of, ns_flops):
        """Section 3c: each TP piece this rank owns (pieces: the plan's matrices, in plan order, the same on every
        rank of a TP group; full: {matrix: its piece, put together here}) orthogonalized with every rank of its TP
        row, one Gram all-reduce per iteration (the lesson's newton_schulz_tp): {matrix: this piece's O}."""
        orthogonal = {}
        for m in pieces:
            g = group_of[m.name]
            with record_function("newton-schulz"):
                orthogonal[m.name] = large_runs.newton_schulz_tp(full[m.name], m.copy.shape, tp_axis(opt, m),
                                                                 opt.ledger, g["ns_steps"], g["ns_coefficients"],
                                                                 g["eps"])
            opt.ledger.record_compute(m.name, m.shape, ns_flops[m.name])
        return orthogonal

    def plan_rows(self, opt, describe):
        """3b on this rank's local pieces: the runs of equal block height (blocks) and of equal head (QK-clip) of
        every laid-out parameter, in its local flat order (describe: the plan's Copy of a parameter)."""
        self.block_runs, self.clip_runs = {}, {}
        self.clip_names = self.qk_names() if self.qk_clip_tau is not None else []
        for name, layout in self.row_layouts.items():
            p = opt.param_by_name[name]
            coordinate = tuple(p.device_mesh.get_coordinate()) if isinstance(p, DTensor) else ()
            copy = describe(name, 0, p, name in opt.expert_stacks)
            if self.ns_blocks != "whole":
                heights = torch.tensor(layout.block_heights(self.ns_blocks == "heads"))
                self.block_runs[name] = row_runs(copy, coordinate, heights)
            if name in self.clip_names:
                self.clip_runs[name] = row_runs(copy, coordinate, torch.tensor(layout.qk_row_heads()))

    @torch.no_grad()
    def clip_qk_(self, opt, max_logits, problem):
        """DTensorMuon.clip_qk_'s work (its docstring says what it takes): `problem`, a refusal of the optimizer's
        own (one line, or None), is voted on with the maxima."""
        heads_of = large_runs.qk_heads(self.row_layouts, self.clip_names)
        problem = problem or large_runs.max_logits_problem(max_logits, heads_of)
        maxima = large_runs.exchange_max_logits(max_logits, heads_of, problem, opt.me, opt.axis, opt.ledger, opt.device)
        out = {}
        for name, s in maxima.items():
            scales = large_runs.qk_clip_scales(s, self.qk_clip_tau, self.row_layouts[name].shares_keys)
            flat = local_of(opt.param_by_name[name]).view(-1)
            for start, stop, head in self.clip_runs[name]:
                if scales[head] != 1.0:
                    flat[start:stop].mul_(scales[head])
            held = {head for _, _, head in self.clip_runs[name]}
            out[name] = [m if h in held else None for h, m in enumerate(scales)]
        return out
