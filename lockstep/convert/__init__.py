"""Low-precision training converters (FP8 tensorwise/rowwise, MXFP8) as model transforms.

``LowPrecisionConfig`` (the run's ``low_precision`` section) says which layers; :func:`convert_model`
swaps them in place (torchao's Float8 / MXFP8 GEMMs for linears, lockstep's emulation for MoE
experts) and reports what it did. See docs/numerics.md ("Low-precision training").
"""

from lockstep.convert.apply import ConversionReport, convert_model, plan_conversion  # noqa: F401
from lockstep.convert.config import LowPrecisionConfig  # noqa: F401
