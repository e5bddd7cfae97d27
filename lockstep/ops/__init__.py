"""Kernels chosen by name from config: attention backends and the batch-invariant kernels.

Importing the package registers every backend (``sdpa``, ``reference``, ``batch_invariant``).
"""

from lockstep.ops import attention, batch_invariant  # noqa: F401  (registration)
