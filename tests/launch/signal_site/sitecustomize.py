"""Test hook (tests/launch/test_launch_signals.py puts this directory on PYTHONPATH): a real signal mid-save.

With TESSERA_TEST_SIGNAL_IN_SAVE=STEP:SIGNAME, rank 1 sends SIGNAME to its launcher (its parent) while it is
writing the shards of checkpoint STEP, then keeps writing for a second, so that the launcher's forwarded signal
reaches every rank in the middle of the save.
"""

import os

_spec = os.environ.get("TESSERA_TEST_SIGNAL_IN_SAVE")
if _spec and os.environ.get("RANK") == "1":
    import signal
    import time
    from pathlib import Path
    from typing import Any

    from framework.checkpoint import dcp

    _step, _name = _spec.split(":")
    _real = dcp.write_shards

    def _write_shards(state: dict[str, Any], tmp: Path, pg: Any = None) -> None:
        if tmp.name == f"{dcp.TMP_PREFIX}step_{_step}":
            os.kill(os.getppid(), getattr(signal, _name))
            time.sleep(1.0)
        _real(state, tmp, pg)

    dcp.write_shards = _write_shards  # type: ignore[assignment]
