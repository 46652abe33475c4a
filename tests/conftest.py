"""Shared fixtures: tiny models built from configs (no hub), and a small learnable classification set."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

# Under pytest-xdist (the README's `-n 2`), each worker gets one OpenMP/torch thread unless the environment says
# otherwise: two workers of two threads each on a 2-core machine spin against each other (slower than one worker).
# Set before torch is imported; subprocesses that tests start inherit it, so runs compared across processes agree.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")
# CI has no GPU: the Triton kernels run under Triton's interpreter (read when a kernel is defined, so set first)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import hf_efficient  # noqa: E402,F401  (registers the hf_eff_* names)


def pytest_configure(config):
    config.addinivalue_line("markers", "example_family: the test runs docs/contributing.md's example family "
                            "(tests/example_family.py), registered for it by the example_family fixture")


@pytest.fixture(autouse=True)
def triton_off_on_cpu_after_the_test(monkeypatch):
    """The Triton kernels take CPU tensors only in the tests that ask for it: a test that leaves
    ``_triton.interpret_on_cpu`` on would send every later test of its worker through the interpreted kernels (a
    run compared with one in a subprocess then differs in the last bits). Such a test fails here, and is undone
    (checked once the test's monkeypatches are undone: one of them may be what turned it on)."""
    from hf_efficient.optim import _triton

    yield
    monkeypatch.undo()
    if _triton._ON_CPU:
        _triton.interpret_on_cpu(False)
        pytest.fail("the test left _triton.interpret_on_cpu(True): use the on_cpu fixture, or turn it off after")


@pytest.fixture
def one_thread():
    """torch on one thread for the test: two on a shared 2-core machine are several times slower (OpenMP barriers),
    and a run compared bit for bit with one made in a one-thread process (a rank, a subprocess) must sum in its
    order."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def example_family(request, monkeypatch):
    """docs/contributing.md's example family in the registry while a test marked ``example_family`` (tests/cases.py
    marks its cases) runs, and out of it after: the package's names stay the package's."""
    if request.node.get_closest_marker("example_family") is None:
        yield None
        return
    from example_family import SPEC

    from hf_efficient import registry

    monkeypatch.setitem(registry.SPECS, SPEC.name, SPEC)
    yield SPEC


def tiny_bert(num_labels: int = 2, vocab: int = 256, hidden: int = 64, layers: int = 2):
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
                     intermediate_size=2 * hidden, max_position_embeddings=64, num_labels=num_labels)
    torch.manual_seed(0)
    return BertForSequenceClassification(cfg)


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=2, n_positions=64))


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))


def tiny_t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                               num_heads=2, decoder_start_token_id=0))


class ClassificationSet(torch.utils.data.Dataset):
    """Label = whether token 1 appears more often than token 2: learnable by a tiny BERT in a few steps."""

    def __init__(self, n: int = 64, seq: int = 12, vocab: int = 256, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, vocab, (n, seq), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)
        self.ids[:, : seq // 2] = torch.where(self.labels[:, None] == 1, 1, 2)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.labels[i]}


@pytest.fixture
def bert():
    return tiny_bert()


@pytest.fixture
def cls_data():
    return ClassificationSet()


@pytest.fixture
def rebuild_native(monkeypatch, tmp_path):
    """Build this package's C kernels afresh for one test, in its own cache: ``rebuild(module, **settings)`` sets
    ``hf_efficient.optim._native`` attributes (``_OPENMP``, ``_FLAGS``) and makes ``module`` forget its kernels."""
    from hf_efficient.optim import _native

    def rebuild(module, **settings):
        for name, value in settings.items():
            monkeypatch.setattr(_native, name, value)
        monkeypatch.setenv("HF_EFF_CACHE", str(tmp_path))
        monkeypatch.setattr(module, "_COMPILED", {})
        _native.load.cache_clear()
        return _native

    yield rebuild
    _native.load.cache_clear()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_two_processes(mode: str, script: str, *args: str, env: dict | None = None,
                         timeout: int = 600) -> subprocess.CompletedProcess:
    """``accelerate launch`` of ``script`` on 2 local CPU processes (gloo), with ``mode`` ("--multi_gpu" for DDP,
    "--use_deepspeed"): no HF_EFF_* / ACCELERATE_* variables of this process, one thread each, plus ``env``.
    Fails the test, with the output's tail, if the launch fails."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("HF_EFF_", "ACCELERATE_"))}
    full.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", mode, "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port()), script,
           *args]
    proc = subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"accelerate launch failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc
