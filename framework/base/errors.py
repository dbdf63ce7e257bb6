"""Tessera's typed errors.

Every message states the offending value, the constraint it broke and the fix, so a user can act on it
without reading the source.
"""

from __future__ import annotations


class TesseraError(Exception):
    """Base class of every error Tessera raises on purpose."""


class ConfigError(TesseraError):
    """A configuration value is unknown, of the wrong type, or inconsistent with another."""


class ParallelismError(TesseraError):
    """A parallel layout does not fit the world size, the model or the hardware."""


class CheckpointError(TesseraError):
    """A checkpoint is missing, incomplete, corrupt, or incompatible with the run."""


class DivergenceError(TesseraError):
    """Training diverges persistently: the loss guard's rollbacks did not help (checkpoint.guard.max_rollbacks)."""


class DataError(TesseraError):
    """Input data or a data build is missing, malformed or inconsistent."""


def divisors(n: int) -> list[int]:
    """All positive divisors of `n`, ascending (used in error messages that suggest valid values)."""
    return [d for d in range(1, n + 1) if n % d == 0]
