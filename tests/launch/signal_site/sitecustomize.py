"""Test hook (framework/testing/signals.py puts this directory on PYTHONPATH): a real signal mid-save.

With TESSERA_TEST_SIGNAL_IN_SAVE=STEP:SIGNAME, one rank (TESSERA_TEST_SIGNAL_RANK, default 1; a process without
RANK counts as rank 0) sends SIGNAME to its launcher (its parent) — or to itself with TESSERA_TEST_SIGNAL_TO=self,
for a run without a launcher — while it is writing the shards of checkpoint STEP, then keeps writing for a second,
so that the signal reaches every rank in the middle of the save.

With TESSERA_TEST_SAVE_SLEEP_S=SECONDS, every rank sleeps that long before writing each checkpoint's shards: a
window in which a second signal surely finds the save still running.
"""

import os

_spec = os.environ.get("TESSERA_TEST_SIGNAL_IN_SAVE")
if _spec and os.environ.get("RANK", "0") == os.environ.get("TESSERA_TEST_SIGNAL_RANK", "1"):
    import signal
    import time
    from pathlib import Path
    from typing import Any

    from framework.checkpoint import dcp

    _step, _name = _spec.split(":")
    _real = dcp.write_shards
    _to_self = os.environ.get("TESSERA_TEST_SIGNAL_TO") == "self"

    def _write_shards(state: dict[str, Any], tmp: Path, pg: Any = None) -> None:
        if tmp.name == f"{dcp.TMP_PREFIX}step_{_step}":
            os.kill(os.getpid() if _to_self else os.getppid(), getattr(signal, _name))
            time.sleep(1.0)
        _real(state, tmp, pg)

    dcp.write_shards = _write_shards  # type: ignore[assignment]

_sleep = os.environ.get("TESSERA_TEST_SAVE_SLEEP_S")
if _sleep:
    import time as _time
    from pathlib import Path as _Path
    from typing import Any as _Any

    from framework.checkpoint import dcp as _dcp

    _real_write = _dcp.write_shards

    def _slow_write_shards(state: dict[str, _Any], tmp: _Path, pg: _Any = None) -> None:
        _time.sleep(float(_sleep))
        _real_write(state, tmp, pg)

    _dcp.write_shards = _slow_write_shards  # type: ignore[assignment]
