"""The number formats: one pure-torch reference module per format (the spec in code)."""

from qtensor.formats import elements, mxfp4, mxfp8, nvfp4, rht
from qtensor.formats.mxfp4 import MXFP4Spec
from qtensor.formats.mxfp8 import MXFP8Spec
from qtensor.formats.nvfp4 import NVFP4Spec

__all__ = ["MXFP4Spec", "MXFP8Spec", "NVFP4Spec", "elements", "mxfp4", "mxfp8", "nvfp4", "rht"]
