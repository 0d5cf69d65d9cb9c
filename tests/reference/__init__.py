"""Independent references: numpy written from SPEC.md's formulas, never from the package's code."""
