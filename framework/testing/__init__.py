"""Test helpers shared by every multi-rank test: `run_distributed` runs one function on N ranks."""

from framework.testing.distributed import DistributedTestError, default_backend, free_port, run_distributed

__all__ = ["DistributedTestError", "default_backend", "free_port", "run_distributed"]
