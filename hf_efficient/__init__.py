"""hf_efficient: memory-efficient optimizers as one-word choices for Hugging Face Trainer and Accelerate.

Importing this package registers the ``hf_eff_*`` names with transformers (when it is installed), so
``TrainingArguments(optim="hf_eff_adam8bit")`` works. The core needs only torch.
"""

from .factory import create_optimizer, optimizer_info
from .memory import estimate_memory, optimizer_state_bytes
from .param_groups import build_param_groups, split_parameters
from .registry import available_optimizers, resolve

__all__ = [
    "available_optimizers",
    "build_param_groups",
    "create_optimizer",
    "estimate_memory",
    "optimizer_info",
    "optimizer_state_bytes",
    "resolve",
    "split_parameters",
]
__version__ = "0.1.0"


def _register_with_transformers() -> None:
    import importlib.util

    if importlib.util.find_spec("transformers") is not None:
        from .integrations.transformers import register

        register()


_register_with_transformers()
