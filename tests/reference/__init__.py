"""Independent references: numpy written from the formulas of docs/algorithms.md, never from the package's code."""
