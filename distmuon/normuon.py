"""NorMuon: Muon's orthogonalized update with each row (neuron) normalized by its own second moment.

Part of the library (distmuon), below the lesson: it imports no other file of the project. NorMuon (Li, Liu, Liang,
Chen, Zhao, "NorMuon: Making Muon more efficient and scalable", arXiv 2510.05491) observes that Muon's update, though
well conditioned, leaves some rows (the weights into one output neuron) much larger than others, and keeps one Adam-
like second moment per row to even them out. For one 2-D parameter, after Muon's momentum and Newton-Schulz:

    O  = NewtonSchulz(U)                                   Muon's update, bf16 (the lesson's section 1)
    v <- beta2 v + (1 - beta2) mean over columns of O * O  one float32 per row: the state NorMuon adds to Muon's
    d  = sqrt(v) + eps                                     each row's divisor
    O^ = (O / d) * g,  g = ||O||_F / (||O / d||_F + eps)   the rows evened out, the whole update's norm kept
    P <- P (1 - lr wd) - adjusted_lr(lr, shape) O^         the rest as Muon: decay, the shape's learning rate

as the authors' reference implementation does it (github.com/zichongli5/NorMuon, normuon.py, normuon_update: v is
an exponential moving average with no bias correction; the update rescaled to the Frobenius norm it had before the
rows were divided, then Muon's lr adjustment sqrt(max(1, rows / cols)); beta2 = 0.95 and eps = 1e-10 are its
defaults). Two choices differ from that code, both for a bf16 update: the normalization is computed in float32 (the
reference code multiplies the bf16 update in place, rounding it), and O / d divides, as the paper's equation writes
it, where the code multiplies by 1 / d. The paper also states its step as an RMS-matched learning rate,
0.2 lr sqrt(rows cols) / ||O^||_F; adjust_lr_fn="match_rms_adamw" gives 0.2 lr sqrt(max(rows, cols)) ||O||_F / ||O^||
instead, equal where O's singular values are all 1.

Distributed, the divisor and g need whole rows and the whole matrix: the rank that holds the full O (an owner)
computes them, and every rank holding a part of the matrix gets v's new rows and g (rows + 1 float32 a matrix), from
which normalized() gives its part of O^, bit for bit the owner's: division and multiplication are elementwise.
"""

import torch

# beta2 and eps: the defaults of the authors' reference implementation (zichongli5/NorMuon, normuon.py).
NORMUON_OPTIONS = {"beta2": 0.95, "normuon_eps": 1e-10}


def second_moment_(ortho, v, beta2):
    """v (rows x 1, float32, the state) <- beta2 v + (1 - beta2) mean_cols(O * O), in place; O the full bf16 update
    (rows x cols). Returns v."""
    o = ortho.float()
    return v.lerp_((o * o).mean(dim=-1, keepdim=True), 1 - beta2)


def divisor(v, eps):
    """Each row's divisor, sqrt(v) + eps."""
    return v.sqrt() + eps


def divided(ortho_part, row_divisor):
    """O / d on any part of the matrix, float32: each element (a bf16 one converted to float32 as it is read, never
    copied whole) by its row's divisor, broadcast or gathered to the part's shape."""
    return ortho_part / row_divisor


def rescale(ortho, v, eps, quotient=None):
    """g = ||O||_F / (||O / d||_F + eps), d = sqrt(v) + eps: the factor that keeps the update's Frobenius norm (a
    0-d float32 tensor), from the full O and its rows' second moments v; quotient: O / d if the caller has it
    (divided(O, divisor(v, eps)), kept for the normalization), else made here."""
    o = ortho.float()
    quotient = divided(o, divisor(v, eps)) if quotient is None else quotient
    return o.norm() / (quotient.norm() + eps)


def normalized(ortho_part, row_divisor, g):
    """O^ on any part of the matrix: (O / d) * g elementwise, d the divisor of each element's row (broadcast or
    gathered to the part's shape), float32."""
    return divided(ortho_part, row_divisor) * g


# At an owner (the lesson's section 7.4b, distmuon/owners.py): the owner of a NorMuon matrix keeps v (its state, one
# float32 per row of the full matrix), updates it and finds g, and sends each holder of a part the new v and g (rows
# + 1 float32 a matrix and holder, phase "NorMuon rows"); each holder divides its part's elements by their rows'
# divisors and multiplies by g: the owner's arithmetic, elementwise, its bits.

def normuon_rows(opt, orthos):
    """{NorMuon matrix among an owner's orthos: its new v (its state, updated here) and g, one float32 vector}."""
    rows = {}
    for name, ortho in orthos.items():
        group = opt.group_of[name]
        if group["algorithm"] == "normuon":
            state = opt.state[opt.param_by_name[name]]
            if "normuon_v" not in state:  # as torch creates state: zeros, at the first step
                state["normuon_v"] = torch.zeros(ortho.shape[0], 1, device=ortho.device)
            o = ortho.float()  # once: both take it in float32
            v = second_moment_(o, state["normuon_v"], group["beta2"])
            rows[name] = torch.cat([v.view(-1), rescale(o, v, group["normuon_eps"]).view(1)])
    return rows


def full_rows(route):
    """The rows of a routed matrix's full (TP-gathered) matrix."""
    return route.shape[0] * (route.tp_size if route.tp_split_dim == 0 else 1)


def part_rows(shape, tp_split_dim, tp_rank, start, stop):
    """The row of the full matrix of every element of a part: elements [start, stop) of the flat TP piece (of
    TP-local `shape`) that TP rank tp_rank holds."""
    rows, cols = shape
    local = torch.arange(start, stop) // cols
    return local + tp_rank * rows if tp_split_dim == 0 else local


def normalized_part(ortho_part, rows, stats, eps):
    """NorMuon's update on a part, from the owner's v and g (stats) and the row of each of its elements."""
    return normalized(ortho_part, divisor(stats[:-1], eps)[rows.to(stats.device)], stats[-1])


def batched_problem(names):
    """Why batched Newton-Schulz (batched_ns) is refused for NorMuon's matrices `names` (one line), or None if none:
    its bound (BATCHED_NS_BOUND) is derived for Muon's update, and NorMuon divides each row by its own RMS, which
    magnifies the batched call's rounding on a row that is small beside the others."""
    if not names:
        return None
    return (f"batched_ns applies to Muon's matrices: NorMuon's ({', '.join(sorted(names)[:3])}) divide each row by "
            f"its own RMS, which can magnify the batched call's rounding beyond the bound derived for Muon's update")


def check_rows_held(param_groups, strategy):
    """A strategy whose TP peers each orthogonalize their own piece of a matrix (the gather strategy) cannot step
    NorMuon's groups: each row is normalized over the whole matrix, which only an owner holds. Refused in one line."""
    if any(g["algorithm"] == "normuon" for g in param_groups):
        raise ValueError(f"NorMuon's param groups need strategy Owner() or CommFree(), whose owner holds the rows "
                         f"(not {strategy})")
