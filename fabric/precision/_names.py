"""The precision names fabric accepts, and the legacy spellings Lightning users know."""

PRECISIONS = ("32-true", "64-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")
# 16 and "bf16" have always meant mixed precision in Lightning.
LEGACY_PRECISION = {32: "32-true", "32": "32-true", 64: "64-true", "64": "64-true", 16: "16-mixed",
                    "16": "16-mixed", "bf16": "bf16-mixed"}  # fmt: skip
