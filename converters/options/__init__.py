"""The options of `convert()`, declared once (fields.py: `option()`), grouped in sections (sections.py: calibration,
reconstruction, healing, output) and gathered, with what to convert to, into ConvertOptions (convert_options.py)."""

from .convert_options import (FLAT_NAMES, FORMATS, RANK_ALLOCATIONS, TARGETS, ConvertOptions, option_fields,
                              resolved)
from .sections import HEAL_DATA, SECTIONS, CalibrationOptions, HealingOptions, OutputOptions, ReconstructionOptions

__all__ = ["FLAT_NAMES", "FORMATS", "HEAL_DATA", "RANK_ALLOCATIONS", "SECTIONS", "TARGETS", "CalibrationOptions",
           "ConvertOptions", "HealingOptions", "OutputOptions", "ReconstructionOptions", "option_fields", "resolved"]
