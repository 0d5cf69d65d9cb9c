"""A compiled update's options, split into what shapes its computation and the numbers it takes as arguments,
so that one compilation serves every value of those numbers."""

from __future__ import annotations

import copy
import dataclasses


def split_options(options, stand_ins: dict) -> tuple:
    """`(structure, values)`: `options` with its set fields named in `stand_ins` replaced by their stand-ins,
    and those fields' values, which `joined_options` puts back."""
    values = {
        name: getattr(options, name) for name in stand_ins if getattr(options, name) is not None
    }
    return dataclasses.replace(options, **{name: stand_ins[name] for name in values}), values


def joined_options(structure, values: dict):
    """`structure` with `values`, arrays in a compiled function, not checked again."""
    options = copy.copy(structure)
    for name, value in values.items():
        object.__setattr__(options, name, value)
    return options
