"""The options of `convert()`, declared once (fields.py: `option()`), grouped in sections (sections.py: calibration,
reconstruction, healing, output) and gathered, with what to convert to, into ConvertOptions (convert_options.py)."""

from .convert_options import FLAT_NAMES, RANK_ALLOCATIONS, ConvertOptions, option_fields, resolved
from .registry import all_formats, register_target, target_names, target_of
from .sections import HEAL_DATA, SECTIONS, CalibrationOptions, HealingOptions, OutputOptions, ReconstructionOptions

__all__ = [
    "FLAT_NAMES",
    "HEAL_DATA",
    "RANK_ALLOCATIONS",
    "SECTIONS",
    "CalibrationOptions",
    "ConvertOptions",
    "HealingOptions",
    "OutputOptions",
    "ReconstructionOptions",
    "all_formats",
    "option_fields",
    "register_target",
    "resolved",
    "target_names",
    "target_of",
]
