"""`dedup.partition_docs` bounds (data_pipeline/build/dedup.py `DedupConfig.validate`): one document per
partition is a valid (if slow) setting — the sharded stages' output does not depend on the partition size
(tests/data_pipeline/test_sharding.py) — and zero is refused before a build starts, naming the value and the
real default."""

from __future__ import annotations

import pytest

from data_pipeline.build.dedup import DedupConfig
from framework.base.errors import ConfigError


def test_one_document_per_partition_is_valid_and_zero_is_refused() -> None:
    DedupConfig(partition_docs=1).validate()
    default = DedupConfig().partition_docs
    for bad in (0, -3):
        with pytest.raises(ConfigError, match=rf"partition_docs={bad} must be >= 1 \(default {default}\)"):
            DedupConfig(partition_docs=bad).validate()
