"""Hugging Face interop: load/save HF model directories, lockstep model directories, conversion.

``load_hf(dir)`` -> lockstep ``Transformer``; ``save_hf(model, dir)`` -> a directory
``transformers.AutoModelForCausalLM.from_pretrained`` loads; ``load_lockstep_dir`` /
``save_lockstep_dir`` for lockstep's own format (also reads training run directories).
Each family's ``ModelSpec.hf_adapter`` (see :mod:`lockstep.models.hf.adapter`) translates names
and config fields; this package does the file work and error reporting. Callers that take "a
model" from the user (generate, ``init_from``) go through :func:`lockstep.load.load_model`, which
picks among these readers.
"""

from lockstep.models.hf.config_io import config_from_dict, config_to_dict
from lockstep.models.hf.io import (
    load_hf,
    load_hf_config,
    load_lockstep_config,
    load_lockstep_dir,
    read_hf_config,
    save_hf,
    save_lockstep_dir,
)

__all__ = [
    "config_from_dict",
    "config_to_dict",
    "load_hf",
    "load_hf_config",
    "load_lockstep_config",
    "load_lockstep_dir",
    "read_hf_config",
    "save_hf",
    "save_lockstep_dir",
]
