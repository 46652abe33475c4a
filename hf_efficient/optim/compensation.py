"""How an fp32 update reaches a bf16 / fp16 weight without being lost: one place for every family.

A bf16 weight near 1.0 moves in steps of 2**-7; an update far below half of that is rounded away, every step (the
"stale weights" of Gopher, appendix C2). Every optimizer of this package computes the new weight in fp32 and then
writes it with one of three modes (the ``compensation`` option):

* ``"kahan"``: a buffer ``kahan_comp`` (bf16, the parameter's shape: 2 bytes per parameter) carries the part of
  each update that the rounded weight could not absorb into the next step (Kahan summation);
* ``"stochastic"``: the weight is rounded up or down at random, with the probabilities that make the rounding
  unbiased; no buffer;
* ``"none"``: round to nearest (the stale-weights behaviour), for comparison.

Stochastic rounding needs no random state: its noise is a hash of (parameter position, step, element), so a
resumed run rounds exactly as the uninterrupted one would, and data-parallel replicas agree. The C kernels do the
same operations (``native.h``: ``hash32``, ``round_stochastic``, ``write_bf16``), in the same order.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

__all__ = ["COMPENSATIONS", "C_MODES", "drop_unused_buffers", "LOW_PRECISION", "check_compensation", "applies", "noise_key", "weight_key", "hash_noise",
           "round_stochastic", "write", "write_all", "step_in_fp32", "fp32_copies",
           "flat_views", "element_index", "CHUNK"]

COMPENSATIONS = ("kahan", "stochastic", "none")
C_MODES = {"kahan": 0, "stochastic": 1, "none": 2}  # the C kernels' mode numbers (native.h's write_bf16)
LOW_PRECISION = (torch.bfloat16, torch.float16)
WEIGHT_STREAM = 0x2545F491  # xor-ed into a key: a weight's noise differs from a moment's (AdamWBF16's exp_avg_sq)

# To bf16 (an fp32 number's top 16 bits): add 16 random bits below the kept ones and truncate, which carries into
# the kept bits with probability |x - truncated| / spacing: unbiased, and a few integer operations. To fp16 (not a
# bit prefix of fp32): pick the far neighbour by comparing noise with |x - nearest| / spacing. Its spacing is found
# without bit tricks: multiplying the nearest value by 1 +- 0.625 ulp lands strictly between half and one and a
# half neighbour spacings away, so rounding that product to nearest gives the neighbour, across a power of two too.
_NEIGHBOUR_STEP = {torch.float16: 0.625 * 2.0**-10}
_GOLDEN, _MIX1, _MIX2 = -1640531535, -2048144789, -1028477387  # 0x9E3779B1, murmur3 fmix32 constants, as int32


def check_compensation(compensation) -> None:
    if compensation not in COMPENSATIONS:
        allowed = ", ".join(map(repr, COMPENSATIONS))
        raise ValueError(f"Invalid compensation={compensation!r}: expected one of {allowed}")


def applies(p: Tensor, compensation: str) -> bool:
    """Whether ``p``'s updates go through a compensated write (a low-precision weight, a mode other than none)."""
    return compensation != "none" and p.dtype in LOW_PRECISION


def _mix32(x: int) -> int:
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def noise_key(noise_id: int, step: int) -> int:
    """int32 key of one tensor's rounding noise at one step (``noise_id``: its position among the parameters)."""
    k = _mix32(_mix32(noise_id + 0x9E3779B9) ^ step)
    return k - (1 << 32) if k >= 1 << 31 else k


def weight_key(noise_id: int, step: int) -> int:
    """The key of a weight's stochastic rounding (:func:`noise_key`'s stream for weights)."""
    return noise_key(noise_id, step) ^ WEIGHT_STREAM


def hash_noise(key: Tensor, idx: Tensor) -> Tensor:
    """int32 noise from a counter-based hash (murmur3 fmix32) of element index and ``key``."""
    h = idx * _GOLDEN + key  # int32 arithmetic wraps; the shifts are masked to make them logical
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * _MIX1
    h = h ^ ((h >> 13) & 0x7FFFF)
    h = h * _MIX2
    return h ^ ((h >> 16) & 0xFFFF)


def round_stochastic(x: Tensor, dtype: torch.dtype, noise: Tensor) -> Tensor:
    """``x`` (fp32) rounded to one of its two ``dtype`` neighbours, the far one with probability
    |x - near one| / spacing; ``noise`` from :func:`hash_noise` (bf16 uses its top 16 bits, fp16 its top 24)."""
    if dtype == torch.bfloat16:
        kept = (x.view(torch.int32) + ((noise >> 16) & 0xFFFF)) & -65536  # carries into the kept bits, or not
        return torch.where(x.isnan(), x, kept.view(torch.float32))
    uniform = ((noise >> 8) & 0xFFFFFF).float() * 2.0**-24
    near = x.to(dtype).float()
    err = x - near
    step = _NEIGHBOUR_STEP[dtype]
    far = (near * torch.where(err * near >= 0, 1.0 + step, 1.0 - step)).to(dtype).float()
    return torch.where(uniform * (far - near).abs() < err.abs(), far, near)


def element_index(p: Tensor, start: int = 0) -> Tensor:
    """Element numbers of ``p`` (row-major, from ``start``): what numbers each element's noise."""
    return torch.arange(start, start + p.numel(), dtype=torch.int32, device=p.device).view(p.shape)


def write(p: Tensor, p32: Tensor, delta: Tensor, comp: Tensor | None, mode: str, key: Tensor | None,
          idx: Tensor | None) -> None:
    """Write the weight ``p32 + delta`` (fp32: ``p32`` the weight before the step, ``delta`` this step's update)
    into ``p`` under ``mode``: ``comp`` is the Kahan buffer (``"kahan"``), ``key`` / ``idx`` number the noise of
    ``"stochastic"`` (``idx``: :func:`element_index` unless given). fp32 weights take ``p32 + delta`` as is."""
    if mode == "kahan" and p.dtype in LOW_PRECISION:
        y = delta + comp.float()  # this step's update plus what earlier steps could not apply
        fresh = (p32 + y).to(p.dtype)
        comp.copy_(y - (fresh.float() - p32))  # the part the rounded weight did not absorb
        p.copy_(fresh)
    elif mode == "stochastic" and p.dtype in LOW_PRECISION:
        p.copy_(round_stochastic(p32 + delta, p.dtype, hash_noise(key, element_index(p) if idx is None else idx)))
    else:
        p.copy_(p32 + delta)


def drop_unused_buffers(optimizer, owner: str, states=None) -> None:
    """After a load, give each tensor the ``kahan_comp`` its group now runs with, saying so in one log line each way.

    A buffer no longer used is dropped (a parameter that is fp32 now: PEFT reloads a bf16 adapter in fp32; a group
    resumed under another compensation, which wins: the user asked for it now): kept, it would only cost memory. A
    buffer now needed (resumed under kahan from a stochastic or none run) starts at zero: nothing is owed yet, as in
    a fresh run. ``states``: parameter -> its state, instead of ``optimizer.state`` (a state about to be loaded).
    Values that are not a dict (a load hook may store a flag in ``optimizer.state``) are left alone.
    """
    states = optimizer.state if states is None else states
    dropped, started = [], []
    for group in optimizer.param_groups:
        mode = group.get("compensation", "none")  # a backend without the option writes rounded to nearest
        for p in group["params"]:
            state = states.get(p)
            if not isinstance(state, dict) or not state:
                continue
            uses = mode == "kahan" and p.dtype in LOW_PRECISION
            if "kahan_comp" in state and not uses:
                del state["kahan_comp"]
                dropped.append(f"{str(p.dtype).removeprefix('torch.')} weights under compensation={mode!r}")
            elif uses and "kahan_comp" not in state and "step" in state:
                # row-major, as every family allocates it (the kernels step a flat view)
                state["kahan_comp"] = torch.zeros(p.shape, dtype=torch.bfloat16, device=p.device)
                started.append(p)
    if dropped:
        logger.warning("%s.load_state_dict: dropped the saved kahan_comp of %d parameter(s) that no longer use one: "
                       "Kahan compensation applies to bf16/fp16 weights under compensation='kahan', and these are %s",
                       owner, len(dropped), "; ".join(sorted(set(dropped))))
    if started:
        logger.info("%s.load_state_dict: %d parameter(s) now run under compensation='kahan' without a saved "
                    "kahan_comp: their buffer starts at zero, as in a fresh run", owner, len(started))


CHUNK = 1 << 22  # elements per fp32 copy of step_in_fp32: bounds its temporaries whatever the model's size


def step_in_fp32(params, step, mode: str, comps=None, keys=None, offsets=None) -> None:
    """``step(idx, work)`` updates ``work``, fp32 tensors of ``params[i]``'s shapes for i in ``idx``, in place: fp32
    weights themselves; other dtypes as views of a flat fp32 copy per device and dtype, then written back by
    :func:`write_all` under ``mode`` (``comps``: each tensor's Kahan buffer or None; ``keys``: its noise key;
    ``offsets``: the global index of its first element where it is a shard, see :func:`write_all`). The
    copies hold at most :data:`CHUNK` elements (a larger tensor alone), so ``step`` is called once per chunk: the
    temporaries are bounded by the chunk or the largest tensor, not by the model."""
    kinds = {}
    for i, p in enumerate(params):
        kinds.setdefault(None if p.dtype == torch.float32 else (p.device, p.dtype), []).append(i)
    for kind, idx in kinds.items():
        if kind is None:
            step(idx, [params[i].detach() for i in idx])
            continue
        for chunk in _chunks(idx, [params[i].numel() for i in idx]):
            ps = [params[i].detach() for i in chunk]
            old = fp32_copies(ps)[0]
            new = old.clone()
            step(chunk, flat_views(new, ps))
            write_all(ps, old, new, None if comps is None else [comps[i] for i in chunk], mode,
                      None if keys is None else [keys[i] for i in chunk],
                      None if offsets is None else [offsets[i] for i in chunk])


def _chunks(idx: list[int], sizes: list[int]) -> list[list[int]]:
    """``idx`` cut into consecutive runs of at most :data:`CHUNK` elements in all (``sizes``: each one's), a tensor
    larger than that in a run of its own."""
    chunks, total = [[]], 0
    for i, n in zip(idx, sizes):
        if chunks[-1] and total + n > CHUNK:
            chunks.append([])
            total = 0
        chunks[-1].append(i)
        total += n
    return chunks


def fp32_copies(params) -> tuple[Tensor, list[Tensor]]:
    """One flat fp32 buffer with the values of ``params`` (one device), and its views in their shapes: what
    :func:`write_all` writes back from, in one set of operations for all of them."""
    flat = torch.empty(sum(p.numel() for p in params), dtype=torch.float32, device=params[0].device)
    views = flat_views(flat, params)
    torch._foreach_copy_(views, [p.detach() for p in params])
    return flat, views


def flat_views(flat: Tensor, params) -> list[Tensor]:
    """Views of ``flat`` in the shapes of ``params``, one after another (:func:`fp32_copies`' layout)."""
    return [x.view(p.shape) for x, p in zip(flat.split([p.numel() for p in params]), params)]


def write_all(params, old: Tensor, new: Tensor, comps, mode: str, keys, offsets=None) -> None:
    """Each of ``params`` (one device and dtype) from its fp32 values before (``old``) and after (``new``) a step,
    flat buffers laid out as :func:`fp32_copies`: :func:`write`'s operations for every element at once (``comps``:
    Kahan buffers or None, ``keys``: the int noise keys; ``offsets``: each tensor's first element number, 0 where
    None: a shard of FSDP2 numbers its elements as in the whole tensor, so that every mesh rounds alike), else the
    new values rounded to nearest as torch's ``copy_``. One call for all the tensors: per tensor, a write's ~20 small
    operations would each be launched once per bias and norm, a cost that grows with the number of small tensors."""
    params = [p.detach() for p in params]
    if not applies(params[0], mode):
        torch._foreach_copy_(params, flat_views(new, params))
        return
    if mode == "kahan":
        y = new - old + fp32_copies(comps)[0]  # this step's update plus what earlier steps could not apply
        fresh = (old + y).to(params[0].dtype)
        torch._foreach_copy_(comps, flat_views(y - (fresh.float() - old), params))  # what the rounded weight missed
    else:
        # each element's key and element_index, in int32: 12 bytes per element of the (chunked) buffer
        sizes = torch.tensor([p.numel() for p in params], dtype=torch.int32, device=old.device)
        starts = torch.repeat_interleave(torch.cumsum(sizes, 0, dtype=torch.int32) - sizes, sizes)
        key = torch.repeat_interleave(torch.tensor(keys, dtype=torch.int32, device=old.device), sizes)
        idx = torch.arange(old.numel(), dtype=torch.int32, device=old.device) - starts
        if offsets is not None:
            idx += torch.repeat_interleave(torch.tensor(offsets, dtype=torch.int32, device=old.device), sizes)
        fresh = round_stochastic(old + (new - old), params[0].dtype, hash_noise(key, idx)).to(params[0].dtype)
    torch._foreach_copy_(params, flat_views(fresh, params))
