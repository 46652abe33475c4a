"""The guard's inf/NaN scan moved into backward (hf_efficient.nonfinite, "the backward scan"): a gradient a hook found
clean is not read again at step(), and no change to a gradient after its hook (through torch's ops, a GradScaler, DDP)
lets a bad value through."""

import copy
import gc
import pickle
import weakref

import pytest
import torch
from torch import nn

import hf_efficient as hfe
from cases import bare, names
from hf_efficient import nonfinite
from hf_efficient.registry import get_spec

NAN, INF = float("nan"), float("inf")
BIG = 256  # nn.Linear(BIG, BIG).weight has 65,536 elements: scanned in backward; its bias (256) is left to step()

pytestmark = pytest.mark.skipif(nonfinite._scan_kernel() is None, reason="no C compiler: no scan in backward")


@pytest.fixture
def scans(monkeypatch):
    """The number of elements of every C scan call (a hook's or the step's), in order."""
    calls = []
    real = nonfinite._scan

    def spy(fn, grads, threads=None):
        calls.append(sum(g.numel() for g in grads))
        return real(fn, grads, threads)

    monkeypatch.setattr(nonfinite, "_scan", spy)
    return calls


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Linear(BIG, BIG)


def _backward(model, scaler=None, poison=None):
    """One backward (of the loss scaled by ``scaler``); ``poison``: the weight's gradient becomes 1e-3 with row 3
    set to this value, before it accumulates."""
    if poison is not None:
        handle = model.weight.register_hook(lambda g: torch.full_like(g, 1e-3).index_fill_(0, torch.tensor([3]),
                                                                                          poison))
    loss = model(torch.randn(8, BIG, dtype=model.weight.dtype)).float().square().mean()
    (loss if scaler is None else scaler.scale(loss)).backward()
    if poison is not None:
        handle.remove()


def _raises_and_untouched(opt, model, match="'weight'"):
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(FloatingPointError, match=match):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def _named(model, name="adamw", **kw):
    return hfe.create_optimizer(bare(name, model.named_parameters()), name, lr=1e-3, **kw)


# --- the fast path --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", names())
def test_a_gradient_scanned_in_backward_is_not_scanned_again(name, scans):
    model = _model().to(get_spec(name).facts.param_dtype)
    opt = _named(model, name)
    _backward(model)
    assert scans == [BIG * BIG]  # the weight, in its hook; the bias is small: left to step()
    scans.clear()
    opt.step()
    assert scans == [BIG]  # only the bias
    scans.clear()
    opt.step()  # a step does not change gradients: still vouched for
    assert scans == [BIG]


def test_nonfinite_ignore_adds_no_hooks():
    model = _model()
    opt = _named(model, nonfinite="ignore")
    assert opt not in nonfinite._HOOKS and not model.weight._post_accumulate_grad_hooks


# --- a bad gradient never slips through -----------------------------------------------------------------------------

@pytest.mark.parametrize("value, policy", [(NAN, "raise"), (INF, "raise"), (2.0**64, "raise"), (NAN, "skip")])
def test_a_bad_gradient_found_in_backward_stops_the_step(value, policy):
    model = _model()
    opt = _named(model, nonfinite=policy)
    _backward(model, poison=value)
    if policy == "raise":
        _raises_and_untouched(opt, model)
    else:
        before = model.weight.detach().clone()
        opt.step()
        assert opt.hf_efficient.skipped_steps == 1 and torch.equal(before, model.weight)


@pytest.mark.parametrize("edit", [
    lambda g: g.__setitem__((0, 0), INF),  # indexing assignment
    lambda g: g.mul_(1e30),  # |g| from 1e-3 to 1e27 >= 2**64
    lambda g: torch._foreach_mul_([g], 1e30),  # clip_grad_norm_'s op
    lambda g: g.view(-1)[-1:].fill_(NAN),  # through a view
    lambda g: g.detach().fill_(NAN),  # through detach (shares the version counter)
])
def test_a_gradient_changed_in_place_after_its_hook_is_scanned_again(edit):
    model = _model()
    opt = _named(model)
    _backward(model)
    edit(model.weight.grad)
    _raises_and_untouched(opt, model)


def test_a_replaced_or_hand_set_gradient_is_scanned():
    model = _model()
    opt = _named(model)
    _backward(model)
    model.weight.grad = model.weight.grad.clone().fill_(NAN)  # replaced: another tensor
    _raises_and_untouched(opt, model)
    fresh = _model()
    opt = _named(fresh)
    fresh.weight.grad = torch.full_like(fresh.weight, INF)  # set by hand, no backward at all
    fresh.bias.grad = torch.zeros_like(fresh.bias)
    _raises_and_untouched(opt, fresh)


def test_zero_grad_without_none_reuses_the_tensor_and_is_scanned_again():
    model = _model()
    opt = _named(model)
    _backward(model)
    grad = model.weight.grad
    opt.step()
    opt.zero_grad(set_to_none=False)
    assert model.weight.grad is grad
    grad.fill_(NAN)  # the same tensor, vouched for at an older version
    _raises_and_untouched(opt, model)
    opt.zero_grad(set_to_none=False)
    _backward(model, poison=NAN)  # accumulated into the same tensor: its hook sees the NaN
    assert model.weight.grad is grad
    _raises_and_untouched(opt, model)


@pytest.mark.parametrize("early", [NAN, INF, -INF])
def test_accumulation_over_micro_batches_keeps_an_early_bad_value(early, scans):
    """An inf or NaN of an earlier micro-batch stays in the sum (inf + finite = inf, inf - inf = NaN), and the last
    hook scans the accumulated gradient: the step refuses it."""
    model = _model()
    opt = _named(model)
    _backward(model, poison=early)
    _backward(model, poison=-early if early == early else 0.0)  # NaN: any value
    assert not torch.isfinite(model.weight.grad).all()
    assert scans[:2] == [BIG * BIG, BIG * BIG]  # each backward scanned the accumulated gradient
    _raises_and_untouched(opt, model)


def test_accumulation_decides_on_the_summed_gradient_like_a_scan_at_step():
    """A finite value >= 2**64 in one micro-batch that the next cancels is not in the gradient the step gets: the
    step goes on, as the scan at step() decided before the hooks."""
    model = _model()
    opt = _named(model)
    _backward(model, poison=2.0**65)
    _backward(model, poison=-(2.0**65))
    assert nonfinite._first_bad_torch([model.weight.grad]) == -1
    opt.step()
    assert opt.hf_efficient.steps == 1


def test_a_grad_scaler_unscale_is_not_trusted(scans):
    """GradScaler unscales in place with an op that does not advance the gradient's version: a hook's scan of the
    scaled gradient says nothing of the unscaled one. Scale 1/2: the scaled weight gradient (2**63.5, clean) becomes
    2**64.5 (overflows squared), which the scaler does not look for (it looks for inf and NaN only)."""
    model = _model()
    opt = _named(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=0.5)
    _backward(model, scaler, poison=1.5 * 2.0**63)  # the poison sets the scaled gradient: clean
    assert model.weight.grad[3].abs().max() == 1.5 * 2.0**63 and nonfinite._scanned_clean(model.weight.grad)
    version = model.weight.grad._version
    before = model.weight.detach().clone()
    with pytest.raises(FloatingPointError, match="'weight'"):
        scaler.step(opt)
    assert model.weight.grad._version == version  # unscaled, version unchanged: why the scaler is detected
    assert model.weight.grad[3].abs().max() == 1.5 * 2.0**64 and torch.equal(before, model.weight)


def test_a_grad_scaler_step_still_skips_overflow_and_steps_otherwise():
    model = _model()
    opt = _named(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    _backward(model, scaler, poison=INF)
    before = model.weight.detach().clone()
    scaler.step(opt)  # found inf: the scaler skips, our step is not called
    scaler.update()
    assert torch.equal(before, model.weight) and scaler.get_scale() == 2.0**9
    opt.zero_grad()
    _backward(model, scaler)
    scaler.step(opt)
    assert not torch.equal(before, model.weight) and opt.hf_efficient.steps == 1


def test_the_optimizer_made_after_a_backward_scans_those_gradients():
    model = _model()
    _backward(model, poison=NAN)  # no hooks yet
    opt = _named(model)
    _raises_and_untouched(opt, model)
    opt.zero_grad()
    _backward(model)  # now hooked
    assert nonfinite._scanned_clean(model.weight.grad)
    opt.step()


def test_added_and_unfrozen_parameters_get_hooks(scans):
    model, extra = _model(), _model(1)
    model.weight.requires_grad_(False)
    opt = _named(model)
    assert not model.weight._post_accumulate_grad_hooks
    opt.add_param_group({"params": list(extra.parameters())})
    _backward(extra, poison=NAN)
    _raises_and_untouched(opt, extra, match="group1.param0")
    model.weight.requires_grad_(True)
    opt.zero_grad()
    _backward(model)
    _backward(extra)
    opt.step()  # the unfrozen weight's gradient had no hook: scanned here, and the hook added
    assert model.weight._post_accumulate_grad_hooks
    opt.zero_grad()
    scans.clear()
    _backward(model)
    assert scans == [BIG * BIG]


def test_two_optimizers_on_one_parameter_scan_it_once(scans):
    model = _model()
    first, second = _named(model), _named(model)
    _backward(model)
    assert scans == [BIG * BIG]
    scans.clear()
    first.step()
    second.step()
    assert scans == [BIG, BIG]


def test_gradient_release_checks_each_tensor_itself(scans):
    from hf_efficient import release

    model = _model()
    opt = _named(model, gradient_release=True)
    assert release.is_attached(opt)
    _backward(model)
    # release checked each tensor once, by the guard's C scan (bias, weight); the guard's own hooks stayed quiet
    assert sorted(scans) == [BIG, BIG * BIG] and model.weight.grad is None
    opt.step()  # release refuses a second backward before step()
    with pytest.raises(FloatingPointError, match="under gradient release"):
        _backward(model, poison=NAN)
    _raises_and_untouched(opt, model)  # the bad gradient left in .grad: the step refuses it too


# --- hooks that do not pay off go quiet -----------------------------------------------------------------------------

@pytest.mark.parametrize("loop", ["clipping", "accumulation"])
def test_hooks_go_quiet_where_the_step_scans_again_and_come_back(loop, scans, monkeypatch):
    """Clipping changes every gradient after backward (torch._foreach_mul_ advances the versions); micro-batches
    accumulate into the gradients after their hooks ran: the step scans them again, so the hooks stop scanning (for
    _RETRY_STEPS steps), and the step still finds a bad gradient meanwhile."""
    monkeypatch.setattr(nonfinite, "_RETRY_STEPS", 3)
    model = _model()
    opt = _named(model)

    def one_step(poison=None):
        opt.zero_grad()
        _backward(model, poison=poison)
        if loop == "accumulation":
            _backward(model)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    one_step()  # each scan in backward is wasted: the second backward's, or the step's after clipping
    assert scans == ([BIG * BIG, BIG * BIG, BIG] if loop == "accumulation" else [BIG * BIG, BIG * BIG + BIG])
    scans.clear()
    one_step()
    assert scans == [BIG * BIG + BIG]  # quiet: one scan of everything, at step()
    with pytest.raises(FloatingPointError):
        one_step(poison=NAN)
    one_step()  # the third step off: the hooks scan again from the next backward
    scans.clear()
    one_step()
    assert scans[0] == BIG * BIG


def test_a_loop_that_uses_the_scans_keeps_the_hooks(scans):
    model = _model()
    opt = _named(model)
    for _ in range(3):
        opt.zero_grad()
        _backward(model)
        opt.step()
    assert scans == [BIG * BIG, BIG] * 3


def test_a_stalled_scan_moves_the_hooks_to_one_thread(monkeypatch, scans):
    """A hook's scan slower than _STALLED (its thread team waited for a thread the OS gave away) makes that optimizer's
    hooks scan on one thread from then on; what they find is the same."""
    model = _model()
    opt = _named(model)
    hooks = nonfinite._HOOKS[opt]
    assert hooks.threads is None
    monkeypatch.setattr(nonfinite, "_STALLED", float("inf"))  # every scan counts as stalled
    _backward(model)
    assert hooks.threads == 1 and nonfinite._scanned_clean(model.weight.grad)
    opt.zero_grad()
    _backward(model, poison=NAN)
    _raises_and_untouched(opt, model)


# --- distributed ----------------------------------------------------------------------------------------------------

def test_in_a_process_group_of_several_processes_hooks_are_not_trusted(monkeypatch, scans):
    import torch.distributed as dist

    model = _model()
    opt = _named(model)
    _backward(model)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    scans.clear()
    opt.step()
    assert scans == [BIG * BIG + BIG]  # everything, at step()
    opt.zero_grad()
    scans.clear()
    _backward(model)
    assert scans == []  # the hook does not scan what DDP will still reduce


def _ddp_steps(rank: int, bucket_view: bool, set_to_none: bool) -> tuple:
    """3 DDP steps, the third with a NaN in rank 1's batch: (is the weight's gradient finite, each step's outcome)."""
    from torch.nn.parallel import DistributedDataParallel

    model = _model()
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=bucket_view)
    opt = _named(model)
    outcomes = []
    for step in range(3):
        torch.manual_seed(10 * step + rank)
        x = torch.randn(8, BIG)
        if rank == 1 and step == 2:
            x[0, 0] = NAN  # this rank's local gradient is NaN; rank 0's is finite until the all-reduce
        opt.zero_grad(set_to_none=set_to_none)
        ddp(x).square().mean().backward()
        try:
            opt.step()
            outcomes.append("stepped")
        except FloatingPointError:
            outcomes.append("raised")
    return bool(torch.isfinite(model.weight.grad).all()), outcomes


def _ddp_worker(rank: int, path: str, bucket_view: bool, set_to_none: bool, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    try:
        results.put((rank, *_ddp_steps(rank, bucket_view, set_to_none)))  # DDP's reducer gone before the group
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("bucket_view, set_to_none", [(False, False), (True, True)])
def test_ddp_reduces_after_the_hook_and_the_step_still_refuses(bucket_view, set_to_none, tmp_path):
    """Real DDP, 2 gloo processes, 3 steps, the third with a NaN in rank 1's batch: rank 0's local gradient is finite
    until the all-reduce writes rank 1's NaN into it (after the hooks, into the same tensor as the steps before),
    and both ranks refuse the step."""
    import torch.multiprocessing as mp

    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_ddp_worker, args=(str(tmp_path / "pg"), bucket_view, set_to_none, results), nprocs=2,
                       start_method="spawn")
    got = dict((r[0], r[1:]) for r in (results.get() for _ in range(2)))
    assert got[0] == got[1] == (False, ["stepped", "stepped", "raised"])


# --- copies and lifetime ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_has_its_own_hooks(how):
    model = _model()
    opt = _named(model)
    _backward(model)
    opt.step()
    twin = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    weight = twin.param_groups[0]["params"][0]
    assert weight is not model.weight and twin in nonfinite._HOOKS
    assert len(weight._post_accumulate_grad_hooks) == 1 and len(model.weight._post_accumulate_grad_hooks) == 1
    weight.grad = None
    (weight.sum() * NAN).backward()
    with pytest.raises(FloatingPointError, match="'weight'"):
        twin.step()


def test_hooks_do_not_keep_the_optimizer_alive_and_go_with_it():
    model = _model()
    opt = _named(model)
    ref = weakref.ref(opt)
    assert model.weight._post_accumulate_grad_hooks
    del opt
    gc.collect()
    assert ref() is None and not model.weight._post_accumulate_grad_hooks
    _backward(model)  # no hook left to call


def test_a_dead_gradient_leaves_no_record():
    model = _model()
    opt = _named(model)  # noqa: F841  alive: its hooks run
    _backward(model)
    key = id(model.weight.grad)
    assert key in nonfinite._CLEAN
    model.weight.grad = None
    gc.collect()
    assert key not in nonfinite._CLEAN
