"""The cost model's tables and figures (benchmarks/cost_model.py --chapter): notes/12-cost-model.md's scenarios,
Newton-Schulz's scaling, one node's MFU against marin's, and their plots."""

from __future__ import annotations

import time
from dataclasses import replace

import distributed_muon_cpu
import muon_tools
from cost_model_inputs import H100, MODELS
from cost_model_predict import (FLAT, NORMUON, Scenario, baseline_of, forward_backward_seconds, predict_costs,
                                summarize)


# =============================================================================
# 6. Tables and figures
# =============================================================================

def ms(seconds):
    return f"{seconds * 1e3:,.1f}"


HEADER = ["optimizer", "sent/rank max", "received/rank max", "inter-node", "NS GFLOP max", "max/mean",
          "state/rank max", "comm ms", "compute ms", "step ms", "overlapped ms", "vs AdamW", "share of step"]


def format_rows(rows, fwd_bwd):
    """The table of one scenario. "vs AdamW": the step over the AdamW step of the same layout (ZeRO-1's for the
    lesson's strategies: both include its reduce-scatter and all-gather) and how many ms more; DTensorMuon's
    against AdamW on the same FSDP2 shards (whose step moves nothing: FSDP2's own traffic is in the forward and
    backward of both), in ms only. "share of step": step / (forward + backward + step), no overlap."""
    by = {r.label: r for r in rows}
    out = []
    for row in rows:
        adamw = by.get(baseline_of(row.label))
        fsdp2 = adamw is not None and adamw.label == "AdamW, FSDP2"
        versus = "-" if adamw is None or adamw is row else (
            f"+{ms(row.step_s - adamw.step_s)} ms" if fsdp2 else
            f"{row.step_s / adamw.step_s:.2f}x, {(row.step_s - adamw.step_s) * 1e3:+,.1f} ms")
        out.append([row.label, muon_tools.human_bytes(row.sent_max), muon_tools.human_bytes(row.received_max),
                    f"{row.inter_share:.0%}",
                    f"{row.ns_max / 1e9:,.0f}" if row.ns_max else "-",
                    f"{row.ns_max / row.ns_mean:.2f}" if row.ns_mean else "-", muon_tools.human_bytes(row.state_max),
                    ms(row.comm_s), ms(row.compute_s), ms(row.step_s), ms(row.overlap_s), versus,
                    f"{row.step_s / (fwd_bwd + row.step_s):.1%}"])
    return muon_tools.format_table(HEADER, out, ["<"] + [">"] * (len(HEADER) - 1))


def predict(s, cluster, strategies=None):
    """(rows, fwd_bwd seconds, costs) of one scenario."""
    costs = predict_costs(s, cluster, strategies)
    return [summarize(c, cluster) for c in costs.values()], forward_backward_seconds(s, cluster), costs


def scenario_title(s, cluster):
    m = s.model
    layout = f"EP {s.ep}, FSDP2 over the rest" if s.ep else f"DP {s.dp} x TP {s.tp}"
    return (f"{m.name}: {m.total_params() / 1e9:,.2f} B parameters ({m.active_params() / 1e9:,.2f} B active), "
            f"{s.gpus} GPUs ({s.gpus // cluster.gpus_per_node} node{'s' * (s.gpus > cluster.gpus_per_node)}), "
            f"{layout}, {m.tokens / 1e6:,.1f}M tokens a step")


CHAPTER = [Scenario(MODELS["gpt2-small"], 8)] + \
    [Scenario(MODELS[m], g, tp=8, normuon=m == "llama3-70b") for m in ("llama3-8b", "llama3-70b") for g in (64, 512)] + \
    [Scenario(MODELS["deepseek-v3"], g, ep=64, normuon=g == 1024) for g in (256, 512, 1024, 2048)] + \
    [Scenario(MODELS["kimi-k2"], 2048, ep=64)]
# Newton-Schulz scaling (figure 2): the same models over more GPUs.
SCALING = {"llama3-70b": [64, 128, 256, 512, 1024], "deepseek-v3": [256, 512, 1024, 2048]}


def chapter(json_path=None, figure_path=None, cluster=H100, print_fn=print):
    """Every table of notes/12-cost-model.md, printed; their figures in a JSON and a PNG (figure())."""
    results = []
    print_fn(f"Cluster: {cluster.name}")
    for line in cluster.sources:
        print_fn(f"  * {line}")
    for s in CHAPTER:
        t0 = time.perf_counter()
        rows, fwd_bwd, _ = predict(s, cluster)
        print_fn(f"\n{scenario_title(s, cluster)}; forward + backward {ms(fwd_bwd)} ms "
                 f"(planned in {time.perf_counter() - t0:.0f} s)")
        print_fn(format_rows(rows, fwd_bwd))
        results.append(dict(model=s.model.name, gpus=s.gpus, tp=s.tp, ep=s.ep, fwd_bwd_s=fwd_bwd,
                            rows=[vars(r) for r in rows]))
    scaling = ns_scaling(cluster, print_fn)
    one_node = small_batch(cluster, print_fn)
    muon_tools.write_json(json_path, dict(cluster=vars(cluster), scenarios=results, ns_scaling=scaling,
                                          one_node=one_node))
    if figure_path:
        figure(results, scaling, figure_path)
    return results


def ns_scaling(cluster, print_fn):
    """Newton-Schulz per rank over more GPUs: the busiest rank (max) against the mean, for the owner-based
    optimizers; the floor is the largest matrix one rank must do alone."""
    out = {}
    print_fn("\nNewton-Schulz per GPU as GPUs grow (one owner per matrix): busiest rank vs mean, GFLOP")
    rows = []
    for name, gpus in SCALING.items():
        model = MODELS[name]
        for g in gpus:
            s = Scenario(model, g, ep=64) if model.experts else Scenario(model, g, tp=8)
            labels = ("DTensorMuon",) if model.experts else ("owner", "DTensorMuon")
            for label, cost in predict_costs(s, cluster, labels).items():
                largest = max(distributed_muon_cpu.newton_schulz_flops(p.shape[-2:]) for p in model.params() if p.group == "muon")
                row = dict(model=model.name, gpus=g, optimizer=label, max=max(cost.ns_flops),
                           mean=sum(cost.ns_flops) / g, largest=largest)
                out.setdefault(f"{model.name}, {label}", []).append(row)
                rows.append([model.name, g, label, f"{row['max'] / 1e9:,.0f}", f"{row['mean'] / 1e9:,.0f}",
                             f"{row['max'] / row['mean']:.2f}", f"{largest / 1e9:,.0f}",
                             ms(row["max"] / (cluster.ns_tflops * 1e12))])
    print_fn(muon_tools.format_table(["model", "GPUs", "optimizer", "max", "mean", "max/mean", "largest matrix",
                              "max ms"], rows, ["<", ">", "<", ">", ">", ">", ">", ">"]))
    return out


# One node, a small batch: marin's MoE on 8 H100s (marin-community/marin issue 6979, its MFU table, rows 6 and 7: the
# same run with Muon's momentum only, then with Newton-Schulz). Their MFU counts attention as Model.train_flops does.
MARIN_MFU = (0.344, 0.307)  # without, with Newton-Schulz
MARIN_SEQS = (2048, 4096)  # the sequence length assumed (MARIN), and the May recipe's (issue 6044), batch 168 alike


def mfu_with(mfu_without, fwd_bwd, extra):
    """The MFU of a step that takes `extra` seconds more than a forward + backward of fwd_bwd seconds run at
    mfu_without: the same FLOPs over a longer time."""
    return mfu_without * fwd_bwd / (fwd_bwd + extra)


def small_batch(cluster, print_fn):
    """marin's one-node, small-batch MoE (MARIN): their MFU without Newton-Schulz gives the forward + backward's time,
    DTensorMuon's plan on their layout (EP1: FSDP over the 8 GPUs, experts too) the time Newton-Schulz adds (its
    exchange and the busiest rank's Newton-Schulz; the momentum is in both runs), and the MFU that leaves, beside
    theirs; and, for scale, the same if every GPU orthogonalized every matrix (no owner)."""
    without, measured = MARIN_MFU
    rate = replace(cluster, train_tflops=without * cluster.peak_tflops)
    print_fn("\nOne node, a small batch: marin's d2560 MoE on 8 H100s, its MFU with Muon's momentum only and with "
             "Newton-Schulz (marin-community/marin issue 6979, rows 6 and 7 of its MFU table)")
    print_fn(f"  * shapes and batch: {MODELS['marin-moe-d2560'].source}")
    print_fn(f"  * the forward + backward at their {without:.1%} MFU without Newton-Schulz, its FLOPs (6 x active "
             f"parameters + attention) x tokens as their MFU counts them; Newton-Schulz adds DTensorMuon's exchange and "
             f"the busiest rank's Newton-Schulz at {rate.ns_tflops:,.0f} TFLOP/s, no overlap; they measured "
             f"{measured:.1%} with it; \"replicated\": every GPU orthogonalizing every matrix, no owner, for scale")
    table, out = [], []
    for seq in MARIN_SEQS:
        model = replace(MODELS["marin-moe-d2560"], seq=seq, tokens=168 * seq)
        s = Scenario(model, 8, ep=1)
        fwd_bwd = forward_backward_seconds(s, rate)
        cost = predict_costs(s, rate, ("DTensorMuon",))["DTensorMuon"]
        row = summarize(cost, rate)
        ns = row.ns_max / (rate.ns_tflops * 1e12)
        every = cost.single_device_flops / (rate.ns_tflops * 1e12)
        predicted, replicated = mfu_with(without, fwd_bwd, row.comm_s + ns), mfu_with(without, fwd_bwd, every)
        out.append(dict(seq=seq, tokens=model.tokens, train_flops=model.train_flops(), fwd_bwd_s=fwd_bwd,
                        comm_s=row.comm_s, ns_s=ns, every_rank_ns_s=every, mfu_predicted=predicted,
                        mfu_every_rank=replicated, mfu_measured=measured, mfu_without=without))
        table.append([f"{seq:,}" + (" (assumed)" if seq == MODELS["marin-moe-d2560"].seq else ""), f"{model.tokens:,}",
                      f"{model.train_flops() / 1e15:,.2f}", ms(fwd_bwd), muon_tools.human_bytes(row.sent_max), ms(row.comm_s),
                      ms(ns), f"{predicted:.1%}", ms(every), f"{replicated:.1%}", f"{measured:.1%}"])
    print_fn(muon_tools.format_table(["sequence", "tokens", "fwd+bwd PFLOP", "fwd+bwd ms", "sent/rank", "comm ms",
                                      "NS ms",
                              "MFU predicted", "replicated NS ms", "MFU replicated", "MFU measured"], table,
                             ["<"] + [">"] * 10))
    return out


def figure(results, scaling, path):
    """Three panels: the predicted step of every optimizer for Llama-3-70B-like and the MoE at each size, and
    Newton-Schulz per rank (busiest and mean) as GPUs grow, the largest matrix dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(19, 6.2))
    for ax, name in zip(axes, ("Llama-3-70B-like", "DeepSeek-V3-like MoE")):
        runs = [r for r in results if r["model"] == name]
        # NorMuon's rows are Muon's within a few percent, AdamW's flat buffer its bucketed one's: left to the tables
        labels = [r["label"] for r in runs[0]["rows"] if not r["label"].endswith(NORMUON)
                  and r["label"] != "AdamW ZeRO-1" + FLAT]
        width = 0.8 / len(labels)
        for i, label in enumerate(labels):
            steps = [next(x for x in r["rows"] if x["label"] == label)["step_s"] * 1e3 for r in runs]
            ax.bar([j + i * width for j in range(len(runs))], steps, width, label=label, color=plt.cm.tab10(i))
        ax.plot([j + 0.4 - width / 2 for j in range(len(runs))], [r["fwd_bwd_s"] * 1e3 for r in runs], "k_",
                markersize=30, label="forward + backward")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(runs))], [f"{r['gpus']} GPUs" for r in runs])
        ax.set_yscale("log")
        ax.set_ylabel("predicted ms per step (no overlap)")
        ax.set_title(name)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=4)
    ax = axes[2]
    for key, rows in scaling.items():
        gpus = [r["gpus"] for r in rows]
        line, = ax.plot(gpus, [r["max"] / 1e9 for r in rows], marker="o", label=f"{key}: busiest rank")
        ax.plot(gpus, [r["mean"] / 1e9 for r in rows], linestyle="--", color=line.get_color(), label=f"{key}: mean")
        ax.axhline(rows[0]["largest"] / 1e9, color=line.get_color(), linestyle=":", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("Newton-Schulz GFLOP per rank per step")
    ax.set_title("Where Newton-Schulz stops scaling (dotted: the largest matrix)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    fig.tight_layout()
    muon_tools.save_figure(fig, path, dpi=90)
    plt.close(fig)
