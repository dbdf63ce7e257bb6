"""What every rank would print alike is printed once (framework/base/logs.py decides which rank speaks): a 4-rank run's
console holds each mixture line, each warning and the error that stops it once; pool workers leave a stop signal
to their parent instead of each printing it."""

from __future__ import annotations

import collections
import re
from pathlib import Path

import pytest

from framework.testing.tiny import TINY, tiny_config
from framework.train.trainer import Trainer


@pytest.mark.distributed
def test_a_four_rank_console_holds_each_line_once(stdlib_build: object, tmp_path: Path) -> None:
    from launch.local import run_local

    run = tmp_path / "run"
    data = ["data.kind=stdlib", f"data.cache_dir={stdlib_build.cfg.cache_dir}",  # type: ignore[attr-defined]
            "model.vocab_size=4096", "data.warn_epochs=0.0"]
    Trainer(tiny_config(run, *data, "train.steps=1", "train.warmup_steps=0",
                        "checkpoint.interval=1")).train()
    # The same run restarted on 4 ranks with another model shape: every rank prepares the data (mixture lines and
    # a warning per source), then every rank refuses the checkpoint with the same CheckpointError.
    console = tmp_path / "console.txt"
    with open(console, "w") as out:
        code = run_local(4, TINY, [f"run.dir={run}", *data, "model.n_layers=3", "train.steps=2",
                                       "train.warmup_steps=0"], threads=1,
                         output=out, grace_s=30)
    text = console.read_text()
    assert code == 2, text
    lines = [re.sub(r"^\[data \d\d:\d\d:\d\d\] |^\d\d:\d\d:\d\d ", "", ln) for ln in text.splitlines()]
    counts = collections.Counter(lines)
    mixture = [ln for ln in lines if ln.startswith("mixture ")]
    warnings = [ln for ln in lines if ln.startswith("WARNING: source")]
    errors = [ln for ln in lines if "tessera: error: CheckpointError" in ln]
    assert len(mixture) == 3 and len(warnings) == 3, text  # the stdlib build's three sources
    assert all(counts[ln] == 1 for ln in mixture + warnings), text
    assert len(errors) == 1 and "model.n_layers" in errors[0], text


def test_pool_workers_leave_a_stop_signal_to_their_parent(tmp_path: Path, capfd: pytest.CaptureFixture[str]) \
        -> None:
    from data_pipeline.build.stdlib_corpus import iter_stdlib_documents
    from framework.checkpoint.signals import StopSignals

    for i in range(6):
        (tmp_path / f"mod{i}.py").write_text(f'"""Module {i}: a docstring long enough to keep as prose."""\n'
                                             f"def f{i}(x):\n    return x + {i}\n")
    handlers = StopSignals(armed=False).install()  # as `tessera` installs them for every command
    try:
        docs = list(iter_stdlib_documents(workers=2, root=tmp_path))  # the pool's exit SIGTERMs its workers
    finally:
        handlers.restore()
    assert len(docs) >= 6
    err = capfd.readouterr().err
    assert "stopped by SIGTERM" not in err and "Traceback" not in err, err


def test_a_tokenizer_larger_than_the_model_is_refused_before_any_rank_starts(
        stdlib_build: object, capsys: pytest.CaptureFixture[str]) -> None:
    from framework.cli import main

    build = f"data.build_dir={stdlib_build.build_dir}"  # type: ignore[attr-defined]
    # tiny.yaml's model has 512 ids; the build's tokenizer 4,096: refused by the launcher, not by 2 ranks after
    # they drew the mixture.
    assert main(["launch", "local", "--nproc", "2", TINY, "data.kind=build", build, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "model.vocab_size=512 is smaller than the tokenizer's vocabulary (4096)" in err, err
    assert main(["launch", "local", "--nproc", "2", TINY, "data.kind=build", build, "model.vocab_size=4096",
                 "--dry-run"]) == 0


def test_a_worker_signalled_before_its_initializer_takes_the_default_action() -> None:
    """The pool's exit can SIGTERM a worker that is still starting, before `pool_worker` resets its dispositions
    (seen under load in the full suite): the handler it inherited through fork must not raise StopSignal there."""
    import os
    import signal

    from framework.checkpoint.signals import StopSignals

    handlers = StopSignals(armed=False).install()
    try:
        pid = os.fork()
        if pid == 0:  # a worker that has not run its initializer: the parent's handler is still installed
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                os._exit(0)  # the signal was swallowed
            except BaseException:
                os._exit(3)  # the inherited handler raised StopSignal in the worker
        _, status = os.waitpid(pid, 0)
    finally:
        handlers.restore()
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status
