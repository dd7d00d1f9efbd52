"""The GPT training's hyperparameters (examples/train_gpt.py): its three param groups' settings and its learning
rate at each step (constant, or warm-up then cosine decay as nanoGPT's train.py has it, karpathy/nanoGPT)."""

import math

import distributed_muon_cpu

MIN_LR_FRACTION = 0.1  # where warmup-cosine ends, as a fraction of --lr (nanoGPT's min_lr = learning_rate / 10)


def hyperparameters(cfg):
    """The three groups' hyperparameters: Muon (or AdamW) for matrices, AdamW for embeddings,
    AdamW without weight decay for norms and biases."""
    adamw = dict(algorithm="adamw", lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95), eps=1e-8)
    muon = dict(algorithm="normuon" if cfg.optimizer == "normuon" else "muon", lr=cfg.lr, weight_decay=cfg.weight_decay,
                momentum=cfg.momentum, nesterov=True, ns_steps=distributed_muon_cpu.NS_STEPS, adjust_lr_fn="match_rms_adamw")
    if cfg.ns_coefficients != "jordan":  # the group keeps the name; torch's default stays unnamed
        muon["ns_coefficients"] = cfg.ns_coefficients
    return (adamw if cfg.optimizer == "adamw" else muon), adamw, dict(adamw, weight_decay=0.0)


def lr_at(cfg, step):
    """The learning rate of step 1, 2, ..., cfg.steps: cfg.lr, or warmup-cosine's share of it."""
    if cfg.schedule == "constant":
        return cfg.lr
    if step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    decayed = 0.5 * (1 + math.cos(math.pi * (step - cfg.warmup_steps) / (cfg.steps - cfg.warmup_steps)))
    return cfg.lr * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * decayed)


def set_lr(optimizers, cfg, step):
    """Every group of every optimizer takes step's learning rate (one rate for all, as in hyperparameters)."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step)

