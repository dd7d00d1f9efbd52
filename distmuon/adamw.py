"""torch.optim.AdamW's math, for the parameters Muon does not take (embeddings, norms, biases, the output head).

Part of the library (distmuon), below the lesson: it imports no other file of the project. AdamW is elementwise,
so a rank can step any slice of a parameter (its ZeRO-1 part, its FSDP2 shard) and get the whole tensor's bits:
every optimizer here runs these lines on whatever part of a parameter it holds, and the tests compare them with
torch.optim.AdamW's own single-tensor step (foreach=False, torch's default on the CPU).
"""

import torch


def adamw_(param, grad, exp_avg, exp_avg_sq, step, *, lr, betas, eps, weight_decay, maximize=False,
           max_exp_avg_sq=None):
    """torch.optim.AdamW's single-tensor math, line for line, on any slice. `step` is the already-incremented step
    count; maximize: the gradient's ascent; max_exp_avg_sq: amsgrad's running maximum of exp_avg_sq, or None."""
    beta1, beta2 = betas
    if maximize:
        grad = -grad
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    if max_exp_avg_sq is not None:  # amsgrad: normalize by the largest second moment so far
        torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
        exp_avg_sq = max_exp_avg_sq
    denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def adamw_state(numel, group, device=None):
    """What torch.optim.AdamW keeps for a parameter of `numel` elements, before its first step."""
    state = dict(step=torch.tensor(0.0), exp_avg=torch.zeros(numel, device=device),
                 exp_avg_sq=torch.zeros(numel, device=device))
    if group.get("amsgrad"):
        state["max_exp_avg_sq"] = torch.zeros(numel, device=device)
    return state


def scalar_lr(lr):
    """The lr a step computes with, as torch's optimizers read it (torch.optim.optimizer._to_scalar): a float as it
    is, a 1-element Tensor lr as a 0-d tensor (its arithmetic stays a tensor's, as in torch's step)."""
    return lr.squeeze() if torch.is_tensor(lr) else lr


def adamw_step_(param, grad, state, group):
    """One AdamW step of a part, with its param group's options: the step count, then adamw_ on the state's moments."""
    state["step"] += 1
    adamw_(param, grad, state["exp_avg"], state["exp_avg_sq"], state["step"].item(), lr=scalar_lr(group["lr"]),
           betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"],
           maximize=group.get("maximize", False), max_exp_avg_sq=state.get("max_exp_avg_sq"))
