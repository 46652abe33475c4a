"""Blockwise 8-bit AdamW in plain PyTorch, with a C kernel for fp32 and bf16 weights on CPU.

Math: ``torch.optim.AdamW`` (decoupled weight decay, bias correction), fp32 arithmetic inside the step, and
bitsandbytes' 8-bit state (``bnb.optim.AdamW8bit``): after each step the moments are stored through the
8-bit codec of :mod:`.quant8`, ``exp_avg`` signed and ``exp_avg_sq`` unsigned.

State per 8-bit parameter: ``step``, ``exp_avg`` / ``exp_avg_sq`` (uint8, one byte per element) and
``exp_avg_absmax`` / ``exp_avg_sq_absmax`` (fp32, one per block): 2 bytes per element + 8 per 256 = 2.03.
The two maps are module constants (:func:`dynamic_map`), not state: they never change, so storing them
per tensor would only cost bytes. Tensors under ``min_8bit_size`` elements and ``fp32_state_params`` (the
registry passes the embeddings) keep fp32 moments and get ``torch.optim.AdamW``'s own kernel.

Layout. ``state_dict()`` writes :mod:`.quant8`'s canonical layout (codes of the parameter's shape, in element
order, as bitsandbytes), so a checkpoint moves to and from bnb and torchao; in memory the codes are in the
kernels' interleaved layout (see :mod:`.quant8` for why).

Kernels, chosen per tensor by :func:`_choose`. On CPU, contiguous fp32 or bf16 weights and gradients go through a C
kernel (``adamw8bit_cpu.c``, built once per machine with the system C compiler, see :mod:`._native`): the
same operations per block, all 8-bit tensors of a group in one call on torch's threads. It gives the compiled
kernel's codes and absmaxes exactly and weights within an ulp of the update (sqrt: see the tests' docstring),
and must give the eager kernel's codes on a probe before it is used. It decodes by table lookup (AVX-512 VBMI
byte tables where the CPU has them) and finds the decade from the float's exponent, which inductor cannot
express. ``scripts/bench_step.py`` on a 2-core AVX-512 CPU, 28M parameters: 1.45x torch's fused fp32 AdamW
step, against 5.6x for the compiled kernel and 19x for bitsandbytes' CPU kernel.
Everything else (fp16 weights, other layouts, ``compile=True``, CUDA) gets one ``torch.compile``'d kernel
per tensor and step. What bounds that one: decoding and encoding make the generated loop ~200 vector
operations per 8 elements, against ~25 for fp32 AdamW. Large tensors go through it 4096 blocks at a time,
which bounds its temporaries. Without a C++ compiler (or Triton on CUDA) the same kernel runs eagerly, in
bounded chunks: same numbers, ~30x slower (~200 ms for 1M elements, several times bitsandbytes' CPU kernel).
"""

from __future__ import annotations

import ctypes
import logging
import math
import threading

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.adamw import adamw as _torch_adamw

from ..options import check_hyperparams
from . import _native, quant8
from .quant8 import BLOCK, WORDS as _WORDS, _describe, dynamic_map, quantize_moments

__all__ = ["AdamW8bit", "dynamic_map", "quantize_moments", "BLOCK"]

logger = logging.getLogger(__name__)

_EAGER_BLOCKS = 1024  # blocks per eager chunk: bounds the fp32 temporaries (~1 MiB each)
_F32_MAX = torch.finfo(torch.float32).max
_CALL_BLOCKS = 4096  # blocks per compiled call: its code buffers (4 MiB) stay out of mmap and page faults


# ----------------------------------------------------------------------------------------------------
# The kernel: one call updates whole blocks. Compiled (inductor) or run as is; same operations either way.
# coef = [beta1, 1 - beta1, beta2, 1 - beta2, 1 / sqrt(1 - beta2**t), eps, 1 - lr * wd, lr / (1 - beta1**t)]
# ----------------------------------------------------------------------------------------------------


def _kernel(p: Tensor, g: Tensor, wm: Tensor, wv: Tensor, m_absmax: Tensor, v_absmax: Tensor, coef: Tensor):
    """AdamW on ``nb`` blocks: ``p``, ``g`` are ``(nb, 256)``, the codes ``(nb, 64)`` int32 words viewed as
    float32 (interleaved, see the module docstring). Updates ``p`` in place; returns the new codes (same
    form) and absmaxes. Returned rather than written in place: inductor then keeps the moments of a block
    in a local buffer instead of a tensor of the parameter's size.
    """
    g32 = g.float()
    # v clamped to fp32's range: a finite gradient whose square overflows would make the block's absmax inf, and
    # every code of the block NaN at the next step. m, a convex combination of m and g, stays in range (a clamp of
    # it costs the C kernel 10%).
    m = quant8.unpack(wm, m_absmax, True) * coef[0] + g32 * coef[1]
    v = (quant8.unpack(wv, v_absmax, False) * coef[2] + (g32 * g32) * coef[3]).clamp(max=_F32_MAX)
    denom = v.sqrt() * coef[4] + coef[5]
    p.copy_(p.float() * coef[6] - (m / denom) * coef[7])
    (wm, m_max), (wv, v_max) = quant8.pack(m, True), quant8.pack(v, False)
    return wm, wv, m_max, v_max


def _eager_kernel(p, g, wm, wv, m_absmax, v_absmax, coef):
    """The kernel run as is, in chunks of blocks (its fp32 temporaries are ~30 times the chunk)."""
    outs = [_kernel(*(t[i:i + _EAGER_BLOCKS] for t in (p, g, wm, wv, m_absmax, v_absmax)), coef)
            for i in range(0, p.shape[0], _EAGER_BLOCKS)]
    return tuple(torch.cat(parts) for parts in zip(*outs))


_COMPILED: dict = {}  # device type -> compiled kernel, or None where compiling failed; "native" -> the C kernel
_LOCK = threading.RLock()  # a kernel is published in _COMPILED once, after its probe passed


def compile_errors() -> tuple:
    """What ``torch.compile``'d code raises when compiling fails (before anything ran: no C++ compiler, no Triton,
    an unsupported Python). Only those may fall back to the eager kernel: an error from a running kernel may come
    after its in-place weight update, and re-running the step would apply it twice."""
    from torch._dynamo.exc import TorchDynamoException  # BackendCompilerFailed, InductorError, Unsupported
    from torch._inductor.exc import CppCompileError

    return TorchDynamoException, CppCompileError


def _compiled_kernel(device: torch.device):
    with _LOCK:
        if device.type not in _COMPILED:
            try:
                _COMPILED[device.type] = torch.compile(_kernel, fullgraph=True)
            except Exception as e:  # torch.compile itself (unsupported Python): nothing ran, nothing to undo
                _drop_compiled(device, e)
        return _COMPILED[device.type]


def _drop_compiled(device, e: Exception) -> None:
    logger.warning("AdamW8bit: the compiled kernel failed on %s (%s: %s); continuing with the eager kernel "
                   "(same results, slower). Pass compile=False to skip compiling.", device.type, type(e).__name__, e)
    with _LOCK:
        _COMPILED[device.type] = None


def _run_kernel(kernel, device, *args):
    """One kernel call. A compiled kernel that fails to compile is dropped for the rest of the process, with a
    warning, and the eager kernel does this call; any other error propagates (see :func:`compile_errors`)."""
    if kernel is _eager_kernel:
        return kernel(*args)
    try:
        return kernel(*args)
    except compile_errors() as e:
        _drop_compiled(device, e)
        return _eager_kernel(*args)


def _choose(p: Tensor, g: Tensor, compile: bool | None):
    """The one dispatch point: the C kernel for plain contiguous fp32/bf16 tensors on CPU (automatic mode only), else
    the compiled kernel unless ``compile=False`` or compiling failed earlier, else the eager one."""
    if compile is None and _native_fits(p, g):
        native = _native_kernel()
        if native is not None:
            return native
    if compile is False:
        return _eager_kernel
    return _compiled_kernel(p.device) or _eager_kernel


# ----------------------------------------------------------------------------------------------------
# The C kernel (adamw8bit_cpu.c): the same operations per block, all tensors of a step in one call
# ----------------------------------------------------------------------------------------------------


def _zero_8bit_state(numel: int, device) -> dict:
    """Fresh 8-bit moments of a tensor of ``numel`` elements: zero codes in whole blocks, zero absmaxes."""
    state = {}
    for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
        state[key], state[f"{key}_absmax"] = quant8.zero_codes(numel, signed, device)
    return state


def _native_fits(p: Tensor, g: Tensor) -> bool:
    return (_native.plain(p, g) and p.device.type == "cpu" and p.dtype == g.dtype and p.dtype in (torch.float32, torch.bfloat16)
            and p.is_contiguous() and g.is_contiguous())


def _native_kernel():
    """The C kernel, after a probe showing it gives the eager kernel's codes and absmaxes exactly; else None."""
    with _LOCK:
        if "native" not in _COMPILED:
            fn = None
            lib = _native.load("adamw8bit_cpu.c")
            if lib is not None:
                fn = _native.bind(lib, "adamw8bit_step", [ctypes.c_int64] + [ctypes.c_void_p] * 10
                                  + [ctypes.c_int64, ctypes.c_int64, ctypes.c_int])
                if not _native_agrees_with_eager(fn):
                    logger.warning("AdamW8bit: the C kernel disagrees with the eager kernel on the probe; not using it")
                    fn = None
            _COMPILED["native"] = fn
        return _COMPILED["native"]


def _native_agrees_with_eager(fn) -> bool:
    """Three steps of a tensor of 515 blocks and a partial one, split over 3 threads (whatever team OpenMP gives,
    every block must be done), with a gradient whose square overflows: codes and absmaxes equal, weights within
    4 ulp of themselves or of the update (torch's fp32 sqrt on CPU is not correctly rounded, C's is: the update
    may differ in its last bits)."""
    gen = torch.Generator().manual_seed(0)
    n = 2 * _native._MIN_PER_THREAD + 3 * BLOCK + 37
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) * 10.0 ** -k for k in range(3)]
    grads[1][5] = 2e19
    lr = 1e-2
    runs = []
    for native in (True, False):
        p = p0.clone()
        state = _zero_8bit_state(n, p.device)
        for t, g in enumerate(grads, 1):
            coef = _coefficients(lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=t)
            if native:
                _native_step(fn, [(p, g, state, coef)], threads=3)
            else:
                _step_8bit(p, g, state, torch.tensor(coef, dtype=torch.float32), _eager_kernel)
        runs.append((p, state))
    (pn, sn), (pe, se) = runs
    ulps = 4 * 2.0**-23
    return all(torch.equal(sn[k], se[k]) for k in sn) and torch.allclose(pn, pe, rtol=ulps, atol=ulps * lr)


def _native_step(fn, items, threads: int | None = None) -> None:
    """``items``: (weight, gradient, state, coefficients) of each tensor; one call, blocks split over threads
    (``threads``: see :func:`._native.run_split`)."""
    pointers = _native.pointers
    numel = [p.numel() for p, _, _, _ in items]
    column = lambda key: [st[key] for _, _, st, _ in items]  # noqa: E731
    coef = [c for _, _, _, cs in items for c in cs]
    bf16 = [p.dtype == torch.bfloat16 for p, _, _, _ in items]
    args = (len(items), pointers([p for p, _, _, _ in items]), pointers([g for _, g, _, _ in items]),
            *map(pointers, map(column, ("exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax"))),
            (ctypes.c_int64 * len(numel))(*numel), (ctypes.c_int32 * len(items))(*bf16), quant8.c_tables().data_ptr(),
            (ctypes.c_float * len(coef))(*coef))
    _native.run_split(fn, args, sum(-(-n // BLOCK) for n in numel), unit=BLOCK, threads=threads)


def _coefficients(*, lr, beta1, beta2, eps, weight_decay, step) -> list[float]:
    return [beta1, 1.0 - beta1, beta2, 1.0 - beta2, 1.0 / math.sqrt(1.0 - beta2**step), eps,
            1.0 - lr * weight_decay, lr / (1.0 - beta1**step)]


# ----------------------------------------------------------------------------------------------------
# Per-tensor steps
# ----------------------------------------------------------------------------------------------------


def _step_8bit(p: Tensor, g: Tensor, state: dict, coef: Tensor, kernel) -> None:
    """Update ``p`` and its 8-bit state: full blocks in one kernel call, a partial last block in another."""
    flat = p.detach().view(-1) if p.is_contiguous() else p.detach().contiguous().view(-1)
    gflat = g.reshape(-1)
    n = flat.numel()
    full = n // BLOCK
    words = [state["exp_avg"].view(torch.float32), state["exp_avg_sq"].view(torch.float32)]
    absmax = [state["exp_avg_absmax"], state["exp_avg_sq_absmax"]]
    for a in range(0, full, _CALL_BLOCKS):  # bounded calls: a 30522x768 embedding in one would allocate 190 MB
        b = min(a + _CALL_BLOCKS, full)
        args = [flat[a * BLOCK:b * BLOCK].view(-1, BLOCK), gflat[a * BLOCK:b * BLOCK].view(-1, BLOCK),
                words[0][a * _WORDS:b * _WORDS].view(-1, _WORDS), words[1][a * _WORDS:b * _WORDS].view(-1, _WORDS),
                absmax[0][a:b], absmax[1][a:b]]
        if kernel is not _eager_kernel:
            for t in args:  # one graph for all block counts
                torch._dynamo.maybe_mark_dynamic(t, 0)
        _store(kernel, p.device, args, coef)
    if n > full * BLOCK:  # zero-padded last block: zero gradient and weight keep zero moments there
        tail = slice(full * BLOCK, n)
        pt = torch.zeros(1, BLOCK, dtype=p.dtype, device=p.device)
        gt = torch.zeros(1, BLOCK, dtype=g.dtype, device=p.device)
        pt[0, : n - full * BLOCK] = flat[tail]
        gt[0, : n - full * BLOCK] = gflat[tail]
        args = [pt, gt, words[0][full * _WORDS:].view(1, _WORDS), words[1][full * _WORDS:].view(1, _WORDS),
                absmax[0][full:], absmax[1][full:]]
        _store(kernel, p.device, args, coef)
        flat[tail] = pt[0, : n - full * BLOCK]
    if not p.is_contiguous():
        p.detach().copy_(flat.view(p.shape))


def _store(kernel, device, args, coef) -> None:
    wm, wv, am, av = _run_kernel(kernel, device, *args, coef)
    for dst, src in zip(args[2:], (wm, wv, am, av)):
        dst.copy_(src)


def _step_32bit(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, beta1, beta2, eps, weight_decay) -> None:
    """torch's own AdamW (fused on CPU and CUDA) for fp32 state; other weight dtypes go through fp32 copies."""
    fp32 = [i for i, p in enumerate(params) if p.dtype == torch.float32]
    other = [i for i, p in enumerate(params) if p.dtype != torch.float32]
    for idx in (fp32, other):
        if not idx:
            continue
        ps = [params[i].detach() if i in fp32 else params[i].detach().float() for i in idx]
        gs = [grads[i] if grads[i].dtype == torch.float32 else grads[i].float() for i in idx]
        fused = all(p.device.type == "cpu" for p in ps)  # CUDA's fused kernel wants its steps on the GPU
        _torch_adamw(ps, gs, [exp_avgs[i] for i in idx], [exp_avg_sqs[i] for i in idx], [], [steps[i] for i in idx],
                     foreach=None if fused else False, fused=fused, amsgrad=False, beta1=beta1, beta2=beta2, lr=lr,
                     weight_decay=weight_decay, eps=eps, maximize=False)
        if idx is other:
            torch._foreach_copy_([params[i].detach() for i in idx], ps)


def checked_group(optimizer: Optimizer, param_group: dict, family: str, check=None) -> dict:
    """``param_group`` ready for ``Optimizer.add_param_group``, or a ValueError before anything changed: every
    hyperparameter through :func:`..options.check_hyperparams` (so construction, later groups and loaded groups
    refuse the same values), ``maximize`` refused (these optimizers only minimize), and no parameter twice (the C
    kernels would update both copies at once: a race). ``check(group)`` adds a family's own checks."""
    if not isinstance(param_group, dict):
        return param_group  # torch's own TypeError
    params = param_group.get("params")
    if params is not None and not isinstance(params, set):  # a set: torch's own TypeError (unordered)
        params = [params] if isinstance(params, Tensor) else list(params)  # a generator is read once, here
        param_group = {**param_group, "params": params}
        seen = {id(p): f"already in param group {gi}" for gi, g in enumerate(optimizer.param_groups)
                for p in g["params"]}
        for i, p in enumerate(params):
            if id(p) in seen:
                raise ValueError(f"{family}: parameter {i} of the new param group (shape {tuple(p.shape)}) is "
                                 f"{seen[id(p)]}: it would be updated twice per step, by kernels racing on it. List "
                                 "each parameter once (model.parameters() lists a tied weight once)")
            seen[id(p)] = f"the same tensor as its parameter {i}"
    group = {**optimizer.defaults, **param_group}
    if group.get("maximize"):
        raise ValueError(f"{family} got maximize={group['maximize']!r} in a param group: it does not implement "
                         "maximize. Negate the loss instead (loss = -objective) and drop the 'maximize' key")
    check_hyperparams(lr=group["lr"], betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"])
    if check is not None:
        check(group)
    return param_group


def _check_step(step, where: str) -> None:
    """A saved ``step``: a number or a one-element tensor, finite and >= 0 (torch accepts a Python number)."""
    if isinstance(step, Tensor) and step.numel() == 1 and step.dtype != torch.bool and not step.is_complex():
        value = step.item()
    elif isinstance(step, (int, float)) and not isinstance(step, bool):
        value = step
    else:
        value = None
    if value is None or not 0 <= value < math.inf:
        raise ValueError(f"{where}: step={step!r} is not a step count (a finite number >= 0, or a one-element tensor "
                         "holding one); the state dict is corrupt or not this optimizer's. Nothing was loaded")


def refuse_sparse(optimizer: Optimizer, family: str) -> None:
    """Refuse sparse gradients before any tensor is updated: a step is done whole or not at all."""
    for gi, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if p.grad is not None and p.grad.is_sparse:
                raise RuntimeError(f"{family} does not support sparse gradients (parameter {i} of param group {gi}, "
                                   f"shape {tuple(p.shape)}); nothing was updated. Use dense gradients (e.g. "
                                   "nn.Embedding(..., sparse=False)) or torch.optim.SparseAdam for that parameter")


def _check_family_keys(group: dict) -> None:
    size = group["min_8bit_size"]
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"Invalid min_8bit_size={size!r}: it must be an int >= 0 (elements)")
    if group["compile"] not in (None, True, False):
        raise ValueError(f"Invalid compile={group['compile']!r}: expected None (automatic), True or False")


class AdamW8bit(Optimizer):
    """AdamW with blockwise 8-bit moments (bitsandbytes' format), in plain PyTorch.

    A standard ``torch.optim.Optimizer``: param groups carry every hyperparameter (any LR scheduler works),
    state keys follow torch plus ``exp_avg_absmax`` / ``exp_avg_sq_absmax``, and ``state_dict()`` (canonical
    layout, see :mod:`hf_efficient.checkpoint`) loads with ``torch.load(weights_only=True)``.

    Args:
        params: parameters or param groups.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (decoupled weight decay).
        min_8bit_size: tensors with fewer elements keep fp32 moments (bitsandbytes' default: 4096).
        fp32_state_params: parameters (or their ``id()``) that keep fp32 moments, e.g. embeddings.
        compile: None/True: the torch.compile'd kernel (inductor: C++ on CPU, Triton on CUDA), falling back
            to the eager kernel with a warning when compiling fails; False: always eager.

    Example::

        opt = AdamW8bit(model.parameters(), lr=2e-5, weight_decay=0.01,
                        fp32_state_params=[model.get_input_embeddings().weight])

    After a reload the dtype of the saved state decides which parameters are 8-bit, so
    ``fp32_state_params`` need not be passed again for the state to resume as it was.
    """

    def __init__(self, params, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, min_8bit_size: int = 4096, fp32_state_params=None,
                 compile: bool | None = None):
        _check_family_keys(dict(min_8bit_size=min_8bit_size, compile=compile))
        self._fp32_ids = {x if isinstance(x, int) else id(x) for x in (fp32_state_params or ())}
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, min_8bit_size=min_8bit_size,
                        compile=compile)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        """As torch's, after :func:`checked_group` (hyperparameters, maximize, parameters listed twice)."""
        super().add_param_group(checked_group(self, param_group, "AdamW8bit", _check_family_keys))

    def _init_state(self, p: Tensor, group: dict) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            if p.numel() < group["min_8bit_size"] or id(p) in self._fp32_ids:
                state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            else:
                state.update(_zero_8bit_state(p.numel(), p.device))
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        refuse_sparse(self, "AdamW8bit")
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            hyper = dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                         weight_decay=group["weight_decay"])
            lists = [[] for _ in range(5)]  # fp32-state tensors: params, grads, exp_avgs, exp_avg_sqs, steps
            coefs = {}  # (step, device) -> coefficients, as a list (C kernel) and a tensor (the others)
            native = []  # (p, grad, state, coefficients) of the tensors that go to the C kernel, in one call
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._init_state(p, group)
                if state["exp_avg"].dtype != torch.uint8:
                    for lst, item in zip(lists, (p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"])):
                        lst.append(item)
                    continue
                state["step"] += 1
                key = (int(state["step"].item()), p.device)
                if key not in coefs:
                    coef = _coefficients(step=key[0], **hyper)
                    coefs[key] = coef, torch.tensor(coef, dtype=torch.float32, device=p.device)
                kernel = _choose(p, p.grad, group["compile"])
                if kernel is _COMPILED.get("native"):
                    native.append((p.detach(), p.grad, state, coefs[key][0]))
                else:
                    _step_8bit(p, p.grad, state, coefs[key][1], kernel)
            if native:
                _native_step(_COMPILED["native"], native)
            if lists[0]:
                _step_32bit(*lists, **hyper)
        return loss

    def state_dict(self) -> dict:
        """torch's state dict, with 8-bit codes in the canonical layout (the parameter's shape, element order)."""
        sd = super().state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        ids = [i for g in sd["param_groups"] for i in g["params"]]
        for i, p in zip(ids, params):
            st = sd["state"].get(i)
            if st is not None and st["exp_avg"].dtype == torch.uint8:
                sd["state"][i] = {**st, "exp_avg": quant8.to_canonical(st["exp_avg"], p),
                                  "exp_avg_sq": quant8.to_canonical(st["exp_avg_sq"], p)}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a canonical state dict, all or nothing: everything is checked first (groups and their
        hyperparameters, each state's keys, dtypes, shapes, absmax lengths, step), and a ValueError names what is
        wrong before anything changed. Saved dtypes are kept (torch would cast the uint8 codes and the fp32
        moments of low-precision weights to the weight's dtype): uint8 codes resume as 8-bit state."""
        groups = self._checked_groups(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        unknown = set(state_dict["state"]) - set(ids)
        if unknown:
            raise ValueError(f"AdamW8bit.load_state_dict: state for parameter ids {sorted(unknown, key=str)} that no "
                             f"saved param group lists (they list {ids}); nothing was loaded")
        loaded = {}
        for i, p in zip(ids, params):
            if state_dict["state"].get(i) is not None:
                loaded[p] = _checked_state(state_dict["state"][i], p, f"AdamW8bit.load_state_dict: parameter {i}")
        super().load_state_dict({**state_dict, "param_groups": groups, "state": {}})
        for p, st in loaded.items():
            self.state[p] = st

    def _checked_groups(self, state_dict: dict) -> list[dict]:
        """The saved groups, each completed with this optimizer's defaults and checked as add_param_group checks."""
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict) or not isinstance(
                state_dict.get("param_groups"), list):
            raise ValueError("AdamW8bit.load_state_dict: expected a dict with 'state' (a dict) and 'param_groups' "
                             f"(a list), as state_dict() returns; got {type(state_dict).__name__} with keys "
                             f"{sorted(state_dict) if isinstance(state_dict, dict) else None}; nothing was loaded")
        saved = state_dict["param_groups"]
        sizes = [len(g.get("params", ())) if isinstance(g, dict) else None for g in saved]
        if sizes != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(f"AdamW8bit.load_state_dict: the saved param groups hold {sizes} parameters, this "
                             f"optimizer's {[len(g['params']) for g in self.param_groups]}: the state belongs to "
                             "another "
                             "model or grouping; nothing was loaded")
        out = []
        for gi, g in enumerate(saved):
            group = {**self.defaults, **g}
            try:
                checked_group(_NoGroups(self.defaults), {**group, "params": ()}, "AdamW8bit", _check_family_keys)
            except ValueError as e:
                raise ValueError(f"AdamW8bit.load_state_dict: saved param group {gi}: {e}; nothing was loaded") from e
            out.append(group)
        return out


class _NoGroups:
    """An optimizer with no groups yet, for checking a saved group alone (its parameters are ids, not tensors)."""

    def __init__(self, defaults: dict):
        self.defaults, self.param_groups = defaults, []


def _checked_state(saved, p: Tensor, where: str) -> dict:
    """The in-memory state of ``p`` from its saved (canonical) state, or a ValueError saying what is wrong."""
    if not isinstance(saved, dict):
        raise ValueError(f"{where}: its state is a {type(saved).__name__}, not a dict; nothing was loaded")
    eight_bit = isinstance(saved.get("exp_avg"), Tensor) and saved["exp_avg"].dtype == torch.uint8
    keys = {"step", "exp_avg", "exp_avg_sq"} | ({"exp_avg_absmax", "exp_avg_sq_absmax"} if eight_bit else set())
    if set(saved) != keys:
        raise ValueError(f"{where}: state keys {sorted(saved)}, expected {sorted(keys)} ("
                         f"{'8-bit' if eight_bit else 'fp32'} moments); nothing was loaded")
    _check_step(saved["step"], where)
    for key in ("exp_avg", "exp_avg_sq"):
        t = saved[key]
        good = isinstance(t, Tensor) and (t.dtype == torch.uint8 if eight_bit else t.is_floating_point())
        if not good or tuple(t.shape) != tuple(p.shape):
            want = "uint8 codes" if eight_bit else "a float tensor"
            raise ValueError(f"{where}: {key} is {_describe(t)}; expected {want} of the parameter's shape "
                             f"{tuple(p.shape)}; nothing was loaded")
    st = {"step": torch.as_tensor(saved["step"], dtype=torch.float32).detach().clone().reshape(())}
    if not eight_bit:
        for key in ("exp_avg", "exp_avg_sq"):
            st[key] = saved[key].to(device=p.device, dtype=torch.float32).clone()
        return st
    blocks = -(-p.numel() // BLOCK)
    for key in ("exp_avg_absmax", "exp_avg_sq_absmax"):
        t = saved[key]
        if not isinstance(t, Tensor) or not t.is_floating_point() or tuple(t.shape) != (blocks,):
            raise ValueError(f"{where}: {key} is {_describe(t)}; expected a float tensor of shape ({blocks},), one "
                             f"absmax per block of {BLOCK} elements; nothing was loaded")
        st[key] = t.to(device=p.device, dtype=torch.float32).clone()
        if not (st[key].isfinite().all() and (st[key] >= 0).all()):
            raise ValueError(f"{where}: {key} holds negative or non-finite values; nothing was loaded")
    st["exp_avg"] = quant8.from_canonical(saved["exp_avg"], p, True)
    st["exp_avg_sq"] = quant8.from_canonical(saved["exp_avg_sq"], p, False)
    return st
