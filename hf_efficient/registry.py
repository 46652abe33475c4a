"""The one table of optimizer names, and :func:`resolve`, which picks a backend for a device.

Every fact about a family lives here: in its :class:`~hf_efficient.optim.facts.Family` (state keys, formats and
codecs, its quantized moments, which families convert into each other, its options, distributed support and why
not, its compensation default; declared in the family's module in ``optim/``, which its class reads) and in its
names' backends (build, checkpoint layout, memory rule, quantized-state rule, FSDP2 support). checkpoint, memory,
cli, the distributed checks, the scripts and the cross-cutting tests (tests/cases.py) iterate this table: a new
family is one optimizer module (its math, its Family, its class), its entry here (:func:`family_spec`) and its test.

Rule: a name lists its backends; each backend says which device types it serves from which package
version. For a device, the first backend in the name's preference order for that device type that is
installed and serves it wins; ``backend=...`` forces one and fails loudly if it cannot serve.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import backends
from .backends import takes
from .optim.adafactor import Adafactor
from .optim.adamw import ADAMW
from .optim.adamw4bit import AdamW4bit
from .optim.adamw8bit import ADAMW8BIT, AdamW8bit
from .optim.adamw_bf16 import AdamWBF16
from .optim import quant8
from .optim.facts import PREFIX, Family, StateKey, codes_bytes
from .optim.lion8bit import LION8BIT, Lion8bit
from .optim.muon import Muon
from .optim.muon8bit import Muon8bit
from .options import OPTIONS, Option
from .optional import install_hint, version_of

__all__ = ["Backend", "StateKey", "Family", "EstimateRow", "OptimizerSpec", "Resolution", "SPECS", "PREFIX", "PLAIN",
           "AUTO_CANDIDATES",
           "families", "torch_backend", "bnb_backend", "family_spec", "get_spec", "resolve",
           "available_optimizers", "compensation_of", "all_options"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Backend:
    """An implementation of a name: which package provides it, which devices it serves, how to build it, how it
    lays out state, what its state costs, and where it cannot run."""

    name: str  # "bnb" | "torchao" | "torch"
    package: str | None  # pip package providing it; None: torch / this package
    min_version: dict[str, str]  # device type ("cuda", "cpu", "*": any) -> oldest package version serving it
    build: Callable  # backends.build_*(groups, *, hyper..., options, fp32_state_params, device)
    memory: Callable  # backends.*_memory: (tensors, parsed options) -> predicted state bytes
    needs: Callable[[str], str | None] | None = None  # device type -> why it cannot run here, or None
    layout: backends.Layout | None = None  # its per-parameter state, when not already the canonical layout
    keeps_8bit: Callable | None = None  # 8-bit families: optimizer -> rule(group i, index in group, param) -> bool
    fsdp2: str | None = None  # why it cannot step FSDP2's DTensor shards (None: it can)
    flaw: str | None = None  # why it is never chosen automatically: warned when forced
    compensates: bool = False  # writes bf16/fp16 weights under the compensation option (optim/compensation.py)

    def serves(self, device_type: str) -> bool:
        return device_type in self.min_version or "*" in self.min_version

    def why_not(self, device_type: str) -> str | None:
        """None if usable on ``device_type`` here, else the reason (not installed, too old, wrong device)."""
        if not self.serves(device_type):
            return f"{self.name} does not serve {device_type} (serves {', '.join(self.min_version)})"
        if self.needs is not None and (missing := self.needs(device_type)):
            return f"{self.name} {missing}"
        if self.package is None:
            return None
        have = version_of(self.package)
        if have is None:
            return f"{self.name} needs {self.package}, which is not installed ({install_hint(self.package)})"
        need = self.min_version.get(device_type, self.min_version.get("*"))
        if need and have < type(have)(need):
            return f"{self.name} serves {device_type} from {self.package} {need}, installed is {have}"
        return None


@dataclass(frozen=True)
class EstimateRow:
    """A line of ``hf-efficient estimate`` for a name: label after the Trainer name, options, parameter dtype."""

    suffix: str = ""
    options: dict = field(default_factory=dict)
    param_dtype: torch.dtype | None = None  # None: the model's own


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer name: its family's facts, nominal state bytes per parameter, options and backends."""

    name: str
    facts: Family
    state_bytes: float
    bytes_label: str  # state bytes / param as README's names table shows them
    notes: str
    backends: dict[str, Backend]
    prefer: dict[str, tuple[str, ...]]  # device type or "default" -> backend names, best first
    options: tuple[str, ...]
    uses_betas: bool = True
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
    fallback: tuple[str, str] | None = None  # (device type it needs, name to run elsewhere)
    estimate_rows: tuple[EstimateRow, ...] = (EstimateRow(),)

    def __reduce__(self):  # a registry singleton: pickled by name (a copy of an optimizer holds its Resolution)
        return get_spec, (self.name,)

    @property
    def family(self) -> str:
        return self.facts.name

    @property
    def accepted(self) -> dict[str, Option]:
        """The options it takes, by key: the shared ones (:data:`..options.OPTIONS`) and families' own (its family's;
        ``hf_eff_auto``'s: those of the names it picks from)."""
        known = all_options()
        out = {k: self.facts.option(k) or known[k] for k in self.options}
        if "embedding_state" in out and self.facts.codec is not None:  # 32-bit, or its own codec's bits
            out["embedding_state"] = dataclasses.replace(out["embedding_state"], choices=(
                "32bit", f"{self.facts.codec.BITS}bit"))
        return out

    @property
    def trainer_name(self) -> str:
        return PREFIX + self.name

    def order(self, device_type: str) -> tuple[str, ...]:
        return self.prefer.get(device_type, self.prefer["default"])


@dataclass(frozen=True)
class Resolution:
    """What :func:`resolve` decided: the name that runs, its backend, the class built, and why."""

    name: str
    backend: str
    optimizer_cls: type
    reason: str
    spec: OptimizerSpec = field(repr=False)
    device: str = "cpu"

    @property
    def implementation(self) -> Backend:
        return self.spec.backends[self.backend]




# --- backends ------------------------------------------------------------------------------------------------

_ANY = {"*": None}
# Why torchao is a backend only when forced: its AdamW8bit rounds a small second moment to exactly 0 while the
# first moment stays non-zero, and a later zero gradient then moves the weight by lr * m / eps, far beyond what fp32
# AdamW moves it (tests/test_adamw8bit.py shows the case). bitsandbytes and our kernel keep a non-zero floor.
TORCHAO_FLAW = ("torchao's AdamW8bit stores small second moments as exactly 0, so a later zero gradient (dead "
                "units, masked tokens, unused embedding rows) moves those weights by lr * exp_avg / eps, thousands of "
                "times too far")
_BNB_NO_DTENSOR = "bitsandbytes' 8-bit kernels have no DTensor sharding rule"


def torch_backend(cls: type, memory: Callable | None = None) -> Backend:
    """This package's optimizer class ``cls`` (it declares ``FACTS``, its Family) as a name's ``torch`` backend:
    built by passing what its signature takes (:func:`.backends.class_builder`); ``memory``: its memory rule, by
    default derived from its Family where it keeps quantized state (which then also needs a compiler for its kernels,
    else the registry prefers another backend)."""
    facts = cls.FACTS
    if facts.quantized:
        return Backend("torch", None, _ANY, backends.class_builder(cls), memory or backends.torch_8bit_memory(facts),
                       needs=backends.compiler_missing, keeps_8bit=backends.torch_keeps_8bit, compensates=True)
    return Backend("torch", None, _ANY, backends.class_builder(cls), memory, compensates=True)


def bnb_backend(facts: Family, bnb_class: str, what: str, cuda_only: bool = False) -> Backend:
    """bitsandbytes' ``bnb.optim.<bnb_class>`` as a backend of the 8-bit ``facts`` (its moments are bnb's
    ``state1``, ``state2``... in order; ``what`` names bnb's layout in messages: ``"AdamW"``)."""
    return Backend("bnb", "bitsandbytes", {"cuda": "0.50"} if cuda_only else {"cuda": "0.50", "cpu": "0.50"},
                   backends.bnb_builder(bnb_class, uses_eps=facts.uses_eps), backends.bnb_memory(len(facts.moments)),
                   layout=backends.bnb_layout(what, *facts.moments), keeps_8bit=backends.bnb_keeps_8bit,
                   fsdp2=_BNB_NO_DTENSOR)


_COMMON = ("backend", "decay_embeddings", "nonfinite", "gradient_release", "compensation")
_QUANTIZED = ("embedding_state", "min_8bit_size")  # the options every quantized family takes
# hf-efficient estimate: each name on bf16 weights too (its default compensation: Kahan's buffer counted there)
_BF16_ROWS = (EstimateRow(" (bf16 params)", param_dtype=torch.bfloat16),)


def _quantized_rows(bits: int) -> tuple[EstimateRow, ...]:
    """A quantized name's estimate rows: every tensor in its codec, its default (32-bit embeddings), bf16 weights."""
    return (EstimateRow(f", every tensor {bits}-bit", {"embedding_state": f"{bits}bit", "min_8bit_size": 1}),
            EstimateRow(" (default: 32-bit embeddings)"), *_BF16_ROWS)


def family_spec(cls: type, notes: str, *, name: str | None = None, backends: dict[str, Backend] | None = None,
                prefer: dict[str, tuple[str, ...]] | None = None, **kw) -> OptimizerSpec:
    """A name for the family of ``cls`` (this package's class; it declares ``FACTS``): ``name`` (default: the
    family's), its backends (default: ``cls`` as the torch backend), options (the shared ones, the quantized families'
    and the family's own), its state bytes per parameter where they are a constant (quantized families: the codec's),
    whether it takes betas (its class's signature says), and ``hf-efficient estimate``'s rows. ``kw``: any other
    :class:`OptimizerSpec` field, given rather than derived."""
    facts = cls.FACTS
    clash = sorted({o.name for o in facts.options} & set(OPTIONS))
    if clash:
        raise ValueError(f"family {facts.name} declares options {clash}, which every name already takes "
                         "(options.OPTIONS): name its own otherwise")
    backends = backends or {"torch": torch_backend(cls)}
    derived = dict(options=_COMMON + (_QUANTIZED if facts.quantized else ()) + tuple(o.name for o in facts.options),
                   uses_betas="betas" in takes(cls),
                   estimate_rows=_quantized_rows(facts.codec.BITS) if facts.quantized else (EstimateRow(), *_BF16_ROWS))
    if facts.quantized:
        derived.update(state_bytes=round(facts.quantized_bytes, 2), bytes_label=f"~{facts.quantized_bytes:.2f}")
    return OptimizerSpec(name or facts.name, facts, **{**derived, **kw, "notes": notes, "backends": backends,
                                                       "prefer": prefer or {"default": tuple(backends)}})


_TORCH_ADAMW = Backend("torch", None, _ANY, backends.build_torch_adamw, backends.torch_adamw_memory, compensates=True)
_TORCH_8BIT = torch_backend(AdamW8bit)
_BNB_8BIT = bnb_backend(ADAMW8BIT, "AdamW8bit", "AdamW")
_TORCHAO_8BIT = Backend("torchao", "torchao", {"cuda": "0.10", "cpu": "0.10"}, backends.build_torchao_adamw8bit,
                        backends.torchao_memory(len(ADAMW8BIT.moments)),
                        layout=backends.torchao_layout(*ADAMW8BIT.moments), keeps_8bit=backends.torchao_keeps_8bit,
                        flaw=TORCHAO_FLAW)

SPECS: dict[str, OptimizerSpec] = {
    s.name: s
    for s in [
        OptimizerSpec("adamw", ADAMW, 8.0, "8", "AdamW, fp32 moments; torch's fused kernel where the device has one, "
                      "else foreach; bf16/fp16 weights are stepped as fp32 copies and written compensated (+2 B/param "
                      "for Kahan's buffer; bf16 on CPU: one C kernel pass, no copy)",
                      {"torch": _TORCH_ADAMW}, {"default": ("torch",)}, _COMMON,
                      dtypes=(torch.float32, torch.float16, torch.bfloat16, torch.float64),
                      estimate_rows=(EstimateRow(), *_BF16_ROWS)),
        family_spec(AdamW8bit, "AdamW math, blockwise 8-bit state; embeddings and tensors < min_8bit_size keep 32-bit "
                    "state", name="adam8bit", backends={"torch": _TORCH_8BIT, "bnb": _BNB_8BIT, "torchao": _TORCHAO_8BIT},
                    # on CPU our C kernel, which outpaces bitsandbytes' CPU kernel (docs/results/bench_step.md).
                    # On CUDA our Triton kernel (one pass per tensor, no host sync; bnb's
                    # synchronises per tensor) where Triton imports; without it the torch backend's `needs` skips
                    # it, and the reason names Triton. torchao is never chosen automatically: see TORCHAO_FLAW
                    prefer={"default": ("torch", "bnb")},
                    estimate_rows=(*_quantized_rows(8), EstimateRow(
                        " (bf16 params, stochastic rounding, every tensor 8-bit)",
                        {"compensation": "stochastic", "embedding_state": "8bit", "min_8bit_size": 1},
                        torch.bfloat16))),
        family_spec(AdamW8bit, "as adam8bit, state paged to host memory (CUDA)", name="paged_adam8bit",
                    backends={"bnb": bnb_backend(ADAMW8BIT, "PagedAdamW8bit", "AdamW", cuda_only=True)},
                    fallback=("cuda", "adam8bit"), estimate_rows=(EstimateRow(),)),
        # our C kernel on CPU, our Triton kernel on CUDA, as adam8bit; no other library's 4-bit state is this codec's
        family_spec(AdamW4bit, "AdamW math, blockwise 4-bit state (blocks of 128; the second moment as its root, never "
                    "0): the lowest-memory AdamW; embeddings and tensors < min_8bit_size keep 32-bit state",
                    name="adam4bit"),
        family_spec(Lion8bit, "Lion (sign of an interpolated momentum, decoupled weight decay), blockwise 8-bit "
                    "momentum; the paper advises lr 3-10x below AdamW's (in our fine-tuning run AdamW's own lr did "
                    "best: see the convergence results); embeddings and tensors < min_8bit_size keep 32-bit state",
                    # as adam8bit: our C kernel on CPU, our Triton kernel on CUDA (else bitsandbytes')
                    backends={"torch": torch_backend(Lion8bit), "bnb": bnb_backend(LION8BIT, "Lion8bit", "Lion")}),
        family_spec(Adafactor, "factored second moment (row + column statistics); lr is the step size",
                    backends={"torch": torch_backend(Adafactor, backends.adafactor_memory)},
                    state_bytes=0.0, bytes_label="<< 1"),
        family_spec(AdamWBF16, "AdamW on bf16 params: bf16 m, v and Kahan compensation; no fp32 master copy",
                    backends={"torch": torch_backend(AdamWBF16, backends.adamw_bf16_memory)},
                    state_bytes=6.0, bytes_label="6",
                    estimate_rows=(EstimateRow(" (bf16 params)", param_dtype=torch.bfloat16),)),
        family_spec(Muon, "Muon (momentum 0.95, Nesterov, 5 bf16 Newton-Schulz steps) on the 2-D weights of the linear "
                    "layers inside the model's blocks, AdamW (fp32 moments) on the rest (embeddings, head, norms, "
                    "biases; muon_include / muon_exclude move tensors); adjust_lr=match_rms_adamw: AdamW's lr and "
                    "weight decay carry over",
                    backends={"torch": torch_backend(Muon, backends.muon_memory(backends.fp32_momentum_memory,
                                                                                backends.torch_adamw_memory))},
                    state_bytes=4.0, bytes_label="4 (AdamW's: 8)"),
        family_spec(Muon8bit, "as muon, Muon's momentum in blockwise 8-bit state and the AdamW part as adam8bit "
                    "(embeddings and tensors < min_8bit_size keep 32-bit state)",
                    backends={"torch": torch_backend(Muon8bit, backends.muon_memory(
                        backends.torch_8bit_memory(Muon8bit.FACTS, ["momentum_buffer"]),
                        backends.torch_8bit_memory(ADAMW8BIT)))},
                    state_bytes=round(codes_bytes(quant8, 1.0), 2),
                    bytes_label=f"~{codes_bytes(quant8, 1.0):.2f} (AdamW's: ~{ADAMW8BIT.quantized_bytes:.2f})"),
    ]
}
# hf_eff_auto is no optimizer of its own: create_optimizer picks one of the above from the model's predicted
# footprint (auto.choose_auto) and passes on the options that name takes.
AUTO = Family("auto", {}, "auto", lambda p, group: set())
# Its candidates, most accurate first on bf16 models (auto.AUTO_ORDER_BF16); they decide the options it takes. Not
# Muon: it changes the algorithm and what works as its learning rate, not the memory alone (docs/muon.md).
AUTO_CANDIDATES = ("adamw", "adamw_bf16", "adam8bit", "adam4bit", "adafactor")
SPECS["auto"] = OptimizerSpec(
    "auto", AUTO, float("nan"), "that of the name picked", "the most accurate of adamw > adamw_bf16 (bf16 models) > "
    "adam8bit > adam4bit > adafactor whose predicted params + grads + state fit free memory (or budget_gb)", {}, {"default": ()},
    tuple(sorted({o for n in AUTO_CANDIDATES for o in SPECS[n].options} - {"backend"})) + ("budget_gb",),
    estimate_rows=())
PLAIN = ADAMW  # the state torch's own optimizers write: what an untagged state without marks is read as


def families() -> dict[str, Family]:
    """Every registered name's family, by family name (read at each call: a name registered later counts)."""
    return {s.facts.name: s.facts for s in SPECS.values() if s.backends}


def all_options() -> dict[str, Option]:
    """Every option any registered name takes: the shared ones and each family's own."""
    return {**OPTIONS, **{o.name: o for s in SPECS.values() for o in s.facts.options}}


def available_optimizers() -> list[str]:
    """Every Trainer name this package registers, sorted."""
    return sorted(s.trainer_name for s in SPECS.values())


def get_spec(name: str) -> OptimizerSpec:
    """The spec of a short (``"adam8bit"``) or Trainer (``"hf_eff_adam8bit"``) name, or a ValueError listing all."""
    key = name.value if hasattr(name, "value") else str(name)
    short = key[len(PREFIX):] if key.startswith(PREFIX) else key
    if short in SPECS:
        return SPECS[short]
    names = available_optimizers()
    close = difflib.get_close_matches(key if key.startswith(PREFIX) else PREFIX + key, names, n=1, cutoff=0.6)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"Unknown hf_efficient optimizer {key!r}.{hint} Registered names: {', '.join(names)}. "
                     "Short names without the 'hf_eff_' prefix ('adam8bit') work in create_optimizer, resolve, "
                     "estimate_memory and the accelerate plugin; TrainingArguments(optim=...) needs the full "
                     "hf_eff_ name.")


_logged: set[tuple] = set()


def _log_once(res: Resolution) -> None:
    key = (res.name, res.backend, res.device)
    if key not in _logged:
        _logged.add(key)
        logger.info("hf_efficient: %s%s on %s -> backend %s (%s)", PREFIX, res.name, res.device, res.backend,
                    res.reason)


def compensation_of(spec: OptimizerSpec, asked: str) -> str:
    """The compensation a name runs with: its family's measured default for ``compensation=auto``."""
    return spec.facts.compensation if asked == "auto" else asked


_NO_COMPENSATION = "writes bf16/fp16 weights rounded to nearest (no compensated update)"


def resolve(name: str, device: str | torch.device = "cpu", backend: str | None = None, *,
            log: bool = True, compensated: bool = False) -> Resolution:
    """Pick the backend that runs ``name`` on ``device``: the first of its backends, in the registry's preference
    order for the device (the guide's names table), that is installed and serves it; log the choice once.

    ``compensated``: the parameters include bf16/fp16 weights and the compensation is not ``none``: only backends
    that compensate qualify (a forced one that does not is refused, saying what to do instead).

    ``log=False`` is for questions rather than choices (memory estimates, ``hf-efficient list``): a user
    should see which backend trains their model, not one for every name an estimate looked at.

    Raises:
        ValueError: unknown name, or a forced ``backend`` the name does not have or that cannot serve the device.
        ImportError: a forced backend whose package is missing (names the pip extra).
        RuntimeError: no backend of the name serves the device here (says what would).
    """
    spec = get_spec(name)
    dev = torch.device(device).type
    if not spec.backends:
        raise ValueError(f"{spec.trainer_name} has no backend of its own: create_optimizer / Trainer choose a name "
                         "for it from the model (hf_efficient.auto.choose_auto); resolve that name instead")
    if spec.fallback and dev != spec.fallback[0]:
        msg = (f"{spec.trainer_name} pages optimizer state through {spec.fallback[0]} unified memory; "
               f"on {dev} it runs as {PREFIX}{spec.fallback[1]} instead")
        if log and (spec.name, dev) not in _logged:  # an estimate (log=False) says "runs as" in its own result
            _logged.add((spec.name, dev))
            logger.warning("hf_efficient: %s", msg)
        res = resolve(spec.fallback[1], dev, backend, log=log, compensated=compensated)
        return Resolution(res.name, res.backend, res.optimizer_cls, f"{msg}; {res.reason}", res.spec, dev)
    if backend is not None:
        if backend not in spec.backends:
            raise ValueError(f"backend={backend!r} is not a backend of {spec.trainer_name}; it has: "
                             f"{', '.join(spec.backends)}")
        chosen, why_not = spec.backends[backend], spec.backends[backend].why_not(dev)
        if compensated and not chosen.compensates:
            raise ValueError(f"backend={backend!r} {_NO_COMPENSATION}: on these bf16/fp16 weights, updates below half "
                             f"a ulp of a weight would be lost (stale weights). Use backend=torch (it compensates), "
                             f"or pass compensation=none to accept rounding to nearest")
        if why_not is not None:
            if chosen.package and version_of(chosen.package) is None:
                raise ImportError(f"{spec.trainer_name} with backend={backend!r} needs {chosen.package}, which is "
                                  f"not installed: {install_hint(chosen.package)}")
            raise ValueError(f"backend={backend!r} cannot run {spec.trainer_name} on {dev}: {why_not}. "
                             f"{_what_would_work(spec, dev)}")
        reason = f"forced by backend={backend!r}"
        if chosen.flaw and (spec.name, dev, backend) not in _logged:
            _logged.add((spec.name, dev, backend))
            others = " or ".join(repr(b) for b, impl in spec.backends.items() if not impl.flaw)
            logger.warning("hf_efficient: %s with backend=%r (forced): %s. backend=%s do%s not have this flaw.",
                           spec.trainer_name, backend, chosen.flaw, others, "es" if " or " not in others else "")
    else:
        reasons = []
        for b in spec.order(dev):
            why_not = spec.backends[b].why_not(dev)
            if why_not is None and compensated and not spec.backends[b].compensates:
                why_not = f"{b} {_NO_COMPENSATION}"
            if why_not is None:
                chosen = spec.backends[b]
                break
            reasons.append(why_not)
        else:
            raise RuntimeError(f"No backend of {spec.trainer_name} can run on {dev} here: {'; '.join(reasons)}. "
                               f"{_what_would_work(spec, dev)}")
        pkg = f"{chosen.package} {version_of(chosen.package)}" if chosen.package else "torch " + torch.__version__
        skipped = f"; skipped: {'; '.join(reasons)}" if reasons else ""
        reason = f"first of {' > '.join(spec.order(dev))} usable on {dev} ({pkg}){skipped}"
    res = Resolution(spec.name, chosen.name, chosen.build.optimizer_cls(), reason, spec, dev)
    if log:
        _log_once(res)
    return res


def _what_would_work(spec: OptimizerSpec, dev: str) -> str:
    options = []
    for b in spec.backends.values():
        if b.serves(dev):
            need = b.min_version.get(dev, b.min_version.get("*"))
            options.append(f"backend={b.name} with {b.package}>={need}" if b.package else f"backend={b.name}")
    if options:
        return "What would work: " + ", or ".join(options) + "."
    served = sorted({d for b in spec.backends.values() for d in b.min_version})
    return f"{spec.trainer_name} runs on: {', '.join(served)}; move the model there or choose another name."
