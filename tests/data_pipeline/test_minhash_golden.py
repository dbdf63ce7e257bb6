"""MinHash signatures and shingle hashes are pinned to fixed values: they are stored in a build (minhash/, bands/)
and a resumed build reuses them, keyed by the config, not by the code. A change of hash constant, salt or
shingle combination would mix two hash functions in one build without any error; if a change is meant, give the
minhash stage a new invalidation key (data_pipeline/invalidate.py) and update these digests."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from data_pipeline.build.minhash import MinHashConfig, shingle_hashes, signatures

TEXTS = ["The quick brown fox jumps over the lazy dog, again and again.", "def add(a, b):\n    return a + b  # café",
         "", "x y"]


@pytest.mark.parametrize(("scheme", "digest"), [("oph", "9ea9f4478a484add"), ("kperm", "3f660981e40e49e5")])
def test_signatures_are_pinned(scheme: str, digest: str) -> None:
    sig = signatures(TEXTS, MinHashConfig(scheme=scheme))  # type: ignore[arg-type]
    assert sig.dtype == np.uint32 and sig.shape == (4, 100)
    assert hashlib.sha256(sig.tobytes()).hexdigest()[:16] == digest


def test_shingle_hashes_are_pinned() -> None:
    h, starts = shingle_hashes(TEXTS, 5)
    assert hashlib.sha256(h.tobytes() + starts.astype(np.int64).tobytes()).hexdigest()[:16] == "60b7a347b8ab035c"
