"""hf_efficient: memory-efficient optimizers as one-word choices for Hugging Face Trainer and Accelerate.

The core needs only torch: importing this package imports no transformers module. The ``hf_eff_*`` names
reach transformers without any import in user code: the start-up hook installed with the package
(:mod:`hf_efficient._autoload`) patches transformers' ``training_args`` and ``trainer`` modules when a process
imports them. Importing this package does the same even when the hook is off (``HF_EFF_AUTOLOAD=0``).
"""

from . import _autoload
from .factory import create_optimizer, optimizer_info
from .estimate import estimate_memory
from .memory import optimizer_state_bytes
from .param_groups import build_muon_param_groups, build_param_groups, split_parameters
from .registry import available_optimizers, resolve

__all__ = [
    "available_optimizers",
    "build_muon_param_groups",
    "build_param_groups",
    "create_optimizer",
    "estimate_memory",
    "optimizer_info",
    "optimizer_state_bytes",
    "resolve",
    "split_parameters",
]
__version__ = "0.1.0"


# last: patching a transformers module already imported imports .integrations, which needs the names above
_autoload.install()
