"""Moving averages of measured times and rates, shared by the coordinator and the workers."""

from __future__ import annotations


def ewma(old: float | None, new: float, weight: float) -> float:
    """An exponentially weighted moving average's next value: ``new`` weighs ``weight`` (``new``
    itself while ``old`` is None: nothing measured yet)."""
    return new if old is None else old + weight * (new - old)
