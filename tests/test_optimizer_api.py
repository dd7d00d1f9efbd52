"""DistributedMuon as a library: a real torch.optim.Optimizer, on one Gloo rank in this process."""

import copy

import pytest
import torch

import distributed_muon_cpu
from distmuon import owners
import muon_tools


class TinyNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.hidden = torch.nn.Linear(16, 48)
        self.out = torch.nn.Linear(48, 16)
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, tokens):
        return self.norm(self.out(torch.relu(self.hidden(self.embed(tokens))))).pow(2).mean()


def split_groups(model, **muon_hyper):
    matrices = [(n, p) for n, p in model.named_parameters() if p.ndim == 2 and not n.startswith("embed")]
    others = [(n, p) for n, p in model.named_parameters() if not (p.ndim == 2 and not n.startswith("embed"))]
    return [dict(params=matrices, algorithm="muon", **muon_hyper), dict(params=others, algorithm="adamw")]


# Every strategy, and the owner strategies with their step overlapped (section 7), in lock-step and not.
VARIANTS = [(s, {}) for s in owners.STRATEGIES] + [(s, dict(overlap=k)) for s in ("owner", "comm-free") for k in (1, 3)]


@pytest.mark.parametrize("strategy,options", VARIANTS)
def test_trains_a_real_model_exactly_like_torch(single_process_group, strategy, options):
    """Real backward passes (no DP reduction on one rank), so the match must be exact."""
    torch.manual_seed(0)
    ours, theirs = TinyNet(), TinyNet()
    theirs.load_state_dict(ours.state_dict())
    opt = owners.OPTIMIZERS[strategy](split_groups(ours), grid=single_process_group, bucket_size=300, lr=0.02,
                                  weight_decay=0.1, adjust_lr_fn="match_rms_adamw", **options)
    assert isinstance(opt, torch.optim.Optimizer)
    muon_params = [p for n, p in theirs.named_parameters() if p.ndim == 2 and not n.startswith("embed")]
    other_params = [p for n, p in theirs.named_parameters() if not (p.ndim == 2 and not n.startswith("embed"))]
    ref = [torch.optim.Muon(muon_params, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
           torch.optim.AdamW(other_params, lr=0.02, weight_decay=0.1)]
    for step in range(3):
        tokens = torch.randint(0, 50, (4, 7), generator=torch.Generator().manual_seed(step))
        for model, optimizers in ((ours, [opt]), (theirs, ref)):
            for o in optimizers:
                o.zero_grad()
            model(tokens).backward()
            for o in optimizers:
                o.step()
        for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
            assert torch.equal(a, b), (step, name)
        assert not torch.equal(ours.hidden.weight, TinyNet().hidden.weight)


@pytest.mark.parametrize("strategy,options", VARIANTS)
def test_a_deep_copy_has_torchs_defaults_and_steps_as_torchs_copy(single_process_group, strategy, options):
    """optimizer.defaults are torch.optim.Muon's (schedulers read them), and copy.deepcopy of the model and the
    optimizer together, after a step, trains on bit for bit as a copy of torch's Muon and AdamW does."""
    torch.manual_seed(0)
    ours, theirs = TinyNet(), TinyNet()
    theirs.load_state_dict(ours.state_dict())
    opt = owners.OPTIMIZERS[strategy](split_groups(ours), grid=single_process_group, bucket_size=300, lr=0.02,
                                  weight_decay=0.1, **options)
    muon_params = [p for n, p in theirs.named_parameters() if p.ndim == 2 and not n.startswith("embed")]
    other_params = [p for n, p in theirs.named_parameters() if not (p.ndim == 2 and not n.startswith("embed"))]
    ref = [torch.optim.Muon(muon_params, lr=0.02, weight_decay=0.1), torch.optim.AdamW(other_params, lr=0.02,
                                                                                         weight_decay=0.1)]
    assert opt.defaults == ref[0].defaults

    def train(model, optimizers, steps):
        for step in steps:
            for o in optimizers:
                o.zero_grad()
            model(torch.randint(0, 50, (4, 7), generator=torch.Generator().manual_seed(step))).backward()
            for o in optimizers:
                o.step()
    train(ours, [opt], [0])
    train(theirs, ref, [0])
    ours_copy, opt_copy = copy.deepcopy((ours, opt))
    theirs_copy, ref_copy = copy.deepcopy((theirs, ref))
    before = [p.clone() for p in ours_copy.parameters()]
    train(ours_copy, [opt_copy], [1, 2])
    train(theirs_copy, ref_copy, [1, 2])
    for (name, a), b, was, original in zip(ours_copy.named_parameters(), theirs_copy.parameters(), before,
                                          ours.parameters()):
        assert torch.equal(a, b), name
        assert not torch.equal(a, was) and torch.equal(original, was), name  # the copy moved, the original did not


@pytest.mark.parametrize("strategy,options", VARIANTS)
def test_one_rank_steps_matrix_by_matrix_as_torch_does(single_process_group, strategy, options):
    """On one rank nothing travels, so whatever the strategy or lookahead, each matrix is orthogonalized
    and applied before the next one is orthogonalized: one bucket's temporaries alive at a time, as
    torch.optim.Muon keeps one matrix's (section 5; notes/08-strategies.md measures why)."""
    model = TinyNet()
    opt = owners.OPTIMIZERS[strategy](split_groups(model), grid=single_process_group, bucket_size=300, **options)
    apply_update, applied = opt.apply_update, []

    def record(name, ortho_part):  # each update applied, after how many orthogonalizations
        applied.append((name, len(opt.ledger.compute)))
        apply_update(name, ortho_part)

    opt.apply_update = record
    model(torch.randint(0, 50, (2, 3))).backward()
    opt.step()
    assert [c["name"] for c in opt.ledger.compute] == ["hidden.weight", "out.weight"]
    assert applied == [("hidden.weight", 1), ("out.weight", 2)]


@pytest.mark.parametrize("model", ["thin", "lopsided"])
@pytest.mark.parametrize("strategy", owners.STRATEGIES)  # on one rank --overlap runs the same loop, with K = 0
def test_one_rank_is_bit_identical_on_odd_shapes(single_process_group, strategy, model):
    """The one-rank step (bucket by bucket) on small-side (k x 1, 1 x k, ...) and lopsided matrices, with
    buckets that hold many matrices: the demo's own run and verification, in this process."""
    cfg = muon_tools.RunConfig(dp=1, tp=1, steps=4, model=model, strategy=strategy, bucket_size=16_384)
    checks, _ = muon_tools.verify(cfg, [muon_tools.run_demo_steps(cfg, single_process_group)])
    assert len(checks) == len(muon_tools.demo_specs(cfg)) and all(c["identical"] for c in checks)
    assert all(c["max_abs_update"] > 0 for c in checks if c["optimizer"] == "Muon")  # something moved


def test_state_dict_round_trip_and_layout_check(single_process_group):
    torch.manual_seed(1)
    model = TinyNet()
    opt = distributed_muon_cpu.DistributedMuon(split_groups(model), grid=single_process_group)
    model(torch.randint(0, 50, (2, 3))).backward()
    opt.step()
    sd = opt.state_dict()
    assert sd["layout"] == dict(dp=1, tp=1, dp_rank=0, tp_rank=0, bucket_size=1 << 16, strategy="gather",
                                owners=None)
    fresh = distributed_muon_cpu.DistributedMuon(split_groups(model), grid=single_process_group)
    fresh.load_state_dict(sd)
    hidden = model.hidden.weight
    assert torch.equal(fresh.state[hidden]["momentum_buffer"], opt.state[hidden]["momentum_buffer"])

    other = distributed_muon_cpu.DistributedMuon(split_groups(model), grid=single_process_group, bucket_size=100)
    with pytest.raises(ValueError, match="bucket_size 65536 != 100"):
        other.load_state_dict(sd)
    owner = owners.OwnerMuon(split_groups(model), grid=single_process_group)
    with pytest.raises(ValueError, match="strategy gather != owner"):
        owner.load_state_dict(sd)


def test_custom_owners_are_checked_and_used(single_process_group):
    model = TinyNet()
    matrices = ["hidden.weight", "out.weight"]
    opt = owners.OwnerMuon(split_groups(model), grid=single_process_group, owners={0: matrices})
    assert opt.owners == {"hidden.weight": 0, "out.weight": 0}
    for given, message in [({0: ["hidden.weight"]}, "out.weight has no owner"),
                           ({0: matrices + ["hidden.weight"]}, r"hidden.weight is owned twice \(ranks 0 and 0\)"),
                           ({0: matrices + ["norm.weight"]}, "norm.weight is not a Muon matrix"),
                           ({0: matrices, 3: []}, r"rank 3 is not in \[0, 1\)")]:
        with pytest.raises(ValueError, match=message):
            owners.OwnerMuon(split_groups(model), grid=single_process_group, owners=given)
    with pytest.raises(TypeError, match="owners"):  # the gather strategy has no owners to take
        distributed_muon_cpu.DistributedMuon(split_groups(model), grid=single_process_group, owners={0: matrices})


@pytest.mark.parametrize("strategy,options", VARIANTS)
def test_parameters_without_gradients_are_skipped_like_torch(single_process_group, strategy, options):
    """A frozen embedding, a matrix and a bias whose gradient is None at some steps."""
    torch.manual_seed(2)
    ours, theirs = TinyNet(), TinyNet()
    theirs.load_state_dict(ours.state_dict())
    opt = owners.OPTIMIZERS[strategy](split_groups(ours), grid=single_process_group, bucket_size=300, lr=0.02,
                                  weight_decay=0.1, **options)
    named = dict(theirs.named_parameters())
    ref = [torch.optim.Muon([named["hidden.weight"], named["out.weight"]], lr=0.02, weight_decay=0.1),
           torch.optim.AdamW([p for n, p in named.items() if n not in ("hidden.weight", "out.weight")], lr=0.02,
                             weight_decay=0.1)]
    gradless = {0: {"embed.weight", "hidden.weight"}, 1: {"embed.weight", "out.bias"}, 2: {"embed.weight"}}
    frozen = ours.embed.weight.detach().clone()
    for step in range(3):
        tokens = torch.randint(0, 50, (4, 7), generator=torch.Generator().manual_seed(step))
        for model, optimizers in ((ours, [opt]), (theirs, ref)):
            model.zero_grad()
            model(tokens).backward()
            for name, p in model.named_parameters():
                if name in gradless[step]:
                    p.grad = None
            for o in optimizers:
                o.step()
        for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
            assert torch.equal(a, b), (step, name)
    assert torch.equal(ours.embed.weight, frozen) and not opt.state[ours.embed.weight]  # untouched, no state
    assert opt.state[ours.out.bias]["step"] == ref[1].state[named["out.bias"]]["step"] == 2  # one step skipped


@pytest.mark.parametrize("make_groups,kwargs,message", [
    (lambda m: [dict(params=list(m.parameters()))], {}, r"Muon needs 2-D parameters; 2 has shape \(48,\)"),
    (lambda m: [dict(params=list(m.named_parameters()), algorithm="muon")], {}, "Muon needs 2-D parameters"),
    (lambda m: [dict(params=list(m.named_parameters()), algorithm="sgd")], {},
     r"algorithm must be 'muon', 'normuon' or 'adamw' \(got 'sgd'\)"),
    (lambda m: split_groups(m), dict(tp_split_dims={"nope.weight": 0}), "unknown parameters"),
    (lambda m: split_groups(m), dict(tp_split_dims={"hidden.weight": 2}), "out of range"),
    (lambda m: split_groups(m), dict(bucket_size=0), "bucket_size must be >= 1"),
    (lambda m: split_groups(m), dict(momentum=1.0), "momentum must be in"),
    (lambda m: split_groups(m), dict(lr=-1.0), "lr must be >= 0 and finite"),
    (lambda m: split_groups(m), dict(adjust_lr_fn="spectral"), "adjust_lr_fn must be None or one of"),
    (lambda m: split_groups(m), dict(weight_decay=float("nan")), "weight_decay must be >= 0 and finite"),
])
def test_bad_construction_is_a_clear_error(single_process_group, make_groups, kwargs, message):
    for optimizer in owners.OPTIMIZERS.values():  # one set of rules, whatever the strategy
        with pytest.raises(ValueError, match=message):
            optimizer(make_groups(TinyNet()), grid=single_process_group, **kwargs)


def test_owner_options_are_checked_and_refused_by_the_gather_strategy(single_process_group):
    for overlap in (-1, 1.5, True):
        with pytest.raises(ValueError, match=r"overlap must be an integer >= 0 \(got "):
            owners.OwnerMuon(split_groups(TinyNet()), grid=single_process_group, overlap=overlap)
    for option in (dict(overlap=2), dict(batched_ns=True)):  # an error, not an option silently ignored
        with pytest.raises(TypeError, match=next(iter(option))):
            distributed_muon_cpu.DistributedMuon(split_groups(TinyNet()), grid=single_process_group, **option)


def test_topology_errors_name_every_factor():
    with pytest.raises(ValueError, match=r"world size 8 != DP 4 x TP 3 = 12"):
        muon_tools.check_topology(4, 3, 8)
    with pytest.raises(ValueError, match=r"DP=0, TP=2"):
        muon_tools.check_topology(0, 2)
