"""Section 12, training checks: how a real training is checked against one process (bound_ratio, loss_drift,
one_ulp_up), for examples/ and dtensor_demo.py alike."""

from __future__ import annotations

import math

import torch
from muon_tools.reference import bound


# =============================================================================
# 12. Training checks: a real training against one process
# =============================================================================
# A training with real forward and backward passes splits some fp32 sums over
# ranks that the same model in one process computes whole: TP's partial products,
# FSDP2's partial sums over its ranks' tokens. Where the ranks' association is
# known, the one-process reference performs the same sums and every comparison is
# torch.equal: examples/train_gpt.py on Gloo for any TP (its TP all-reduces add
# every element's TP terms left to right in rank order, gpt.tp_all_reduce, and its
# reference computes TP's pieces apart and adds them in that order, gpt.GPT's
# as_tp), and under NCCL for TP <= 2 (two terms: a + b == b + a whatever order
# NCCL takes). Where it is not (NCCL's all-reduce of TP > 2 terms adds in its own
# order; dtensor_demo.py --train and examples/train_gpt_dtensor.py --verify, FSDP2
# x TP), the gradients cannot have the one process's bits, and these commands
# check three things (each names the sums it reorders: examples/train_gpt.py
# section 3, dtensor_demo.py section 7):
#
#   replay     torch's optimizers fed the ranks' own total gradients give every
#              rank's weights: bit for bit (but for train_gpt.py's stated opt-ins,
#              NCCL's DP order and --tp-newton-schulz gram, held to their bounds).
#   gradients  at the ranks' own weights, the ranks' gradients and losses against
#              the same computation in float64: within the bound below.
#   trained    both runs free-running from the same start: the gap of their losses
#              (loss_drift), reported beside the chaos floor, the gap of the same
#              one-process run started one ulp away (one_ulp_up), as a ratio; never
#              a verdict. A training amplifies any difference chaotically, so a
#              bound on the gap would fail correct runs, not bugs.
#
# The bound (bound_ratio <= 1 passes):
#   1. A sum of k fp32 terms, in any order, is within gamma(k - 1) * sum |terms| of
#      the exact sum, gamma(m) = m u / (1 - m u) (Higham, "Accuracy and Stability of
#      Numerical Algorithms", 2002, section 4.2). Split into p partial sums that are
#      then added, it is gamma(k / p + p - 2) <= gamma(k - 1): a reordered sum has a
#      worst case no larger than the one process's.
#   2. How a step's data amplify each rounding (norms, softmax, the residual sums)
#      has no closed form, so that worst case is measured on the step: the one
#      process's fp32 error against float64 (u = 2**-53: its own error is 2**-29 of
#      fp32's), e_one = max |G_fp32 - G_fp64| per tensor.
#   3. The ranks' e_ranks = max |G_ranks - G_fp64| is another draw of the same worst
#      case, in another order: held to REALIZED_FACTOR x e_one, plus one reordered
#      reduction of the step's n terms adding up to the largest entry, n u max |G_fp64|
#      (which keeps the bound above zero where the one process happens to round
#      well). A loss: the same, with the n tokens it is the mean of.
# A lost all-reduce or a wrong split moves a gradient by a fraction of itself, far
# beyond the bound: the commands' tests break one and see FAIL.
UNIT_ROUNDOFF = 2.0**-24  # fp32's u (a 24-bit significand): a rounding moves a result by at most this fraction of it
REALIZED_FACTOR = 4  # step 3's factor, the one part not derived: two orders' errors are two draws of the same rounding,
#                      their largest entries 2x apart at most in the runs measured (notes/measured/
#                      from_code_comments.md); 4 leaves room for that and stays far below what a bug does. Used
#                      only where the association is unknown (above): FSDP2 x TP and NCCL's TP > 2.


def bound_ratio(ranks_err, one_err, n, scale):
    """The ranks' error against float64 over its bound (step 3 above; <= 1 passes): one_err is the one
    process's error on the same step, n the terms of one reordered reduction, scale its largest float64 entry
    (or the loss). A zero bound holds only a zero error."""
    bound = REALIZED_FACTOR * one_err + n * UNIT_ROUNDOFF * scale
    return ranks_err / bound if bound > 0 else (0.0 if ranks_err == 0 else math.inf)


def loss_drift(losses, reference_losses):
    """The largest relative difference of two runs' losses ([[loss of each micro-batch] per step])."""
    return max(abs(a - b) / b for step, ref in zip(losses, reference_losses) for a, b in zip(step, ref))


def one_ulp_up(tensor):
    """Entry 0 of `tensor` one ulp up (toward +inf), in place: where the chaos floor's run starts."""
    with torch.no_grad():
        first = tensor.view(-1)[:1]
        first.copy_(torch.nextafter(first, torch.full_like(first, math.inf)))
