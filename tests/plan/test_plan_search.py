"""Search: Megatron's published layouts, bad inputs with explanations, the CLI end to end."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.plan_published import PUBLISHED
from framework.base.errors import ParallelismError
from framework.config import load_config
from framework.plan.cli import main
from framework.plan.hardware import get_hardware
from framework.plan.layout import Workload
from framework.plan.search import plan, plan_or_explain, smallest_cluster
from models.config import model_config


@pytest.mark.parametrize("run", PUBLISHED, ids=[r.name for r in PUBLISHED])
def test_published_megatron_layouts_are_feasible_and_ranked(run: object) -> None:
    from bench.plan_published import PublishedRun

    assert isinstance(run, PublishedRun)
    hw = get_hardware(run.gpu)
    # As Megatron-LM runs a GPT block (Korthikanti et al. activations): in the top 5 distinct (tp, pp).
    megatron = plan(Workload(run.model(), run.seq, run.global_batch, activations="korthikanti"), run.gpus, hw)
    rank = megatron.rank_of(run.tp, run.pp)
    assert rank is not None and rank <= 5, [e.layout.describe() for e in megatron.top(6)]
    assert len({e.layout.key() for e in megatron.top(5)}) == 5
    # As Tessera's own block would run it: still feasible (the rank is reported in docs/BENCHMARKS.md).
    tessera = plan(Workload(run.model(), run.seq, run.global_batch), run.gpus, hw)
    assert tessera.rank_of(run.tp, run.pp) is not None


def test_gpu_count_not_divisible_explains() -> None:
    work = Workload(model_config("llama3-70b", max_seq_len=4096), 4096, 512)
    with pytest.raises(ParallelismError, match=r"--gpus 1020 is not a whole number of 8-GPU nodes.*e\.g\..*"
                                               r"smallest cluster that fits is \d+ x h100-80g"):
        plan_or_explain(work, 1020, get_hardware("h100-80g"))


def test_model_too_large_names_the_smallest_cluster() -> None:
    work = Workload(model_config("llama3-405b", max_seq_len=4096), 4096, 1536)
    hw = get_hardware("a100-40g")
    with pytest.raises(ParallelismError) as err:
        plan_or_explain(work, 16, hw)
    text = str(err.value)
    assert "no layout of 16 x a100-40g fits" in text and "peak memory" in text
    n, lay = smallest_cluster(work, hw) or (0, None)
    assert f"smallest cluster that fits is {n} x a100-40g" in text
    # It is the smallest: it fits, and the next smaller node multiple has no feasible layout.
    assert lay is not None and plan(work, n, hw).feasible
    assert not plan(work, n - hw.gpus_per_node, hw).feasible


def test_cli_end_to_end_writes_a_loadable_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.yaml"
    rc = main(["--model", "llama3-8b", "--gpus", "64", "--gpu", "h100-80g", "--seq", "4096",
               "--global-batch", "256", "--top", "3", "--write-config", str(out), "--check-params"])
    text = capsys.readouterr().out
    assert rc == 0
    assert "exact match" in text and "rejected:" in text and "MFU%" in text
    rows = [line for line in text.splitlines() if line[:3].strip() in {"1", "2", "3"}]
    assert len(rows) == 3 and len({r.split()[1:3] .__str__() for r in rows}) == 3
    cfg = load_config(out)
    assert cfg.model.preset == "llama3-8b" and cfg.data.seq_len == 4096
    assert cfg.train.global_batch_size == 256
    world = cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.dp_shard * cfg.parallel.dp_replicate
    assert world == 64


def test_cli_custom_shape_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "moe.yaml"
    rc = main(["--layers", "8", "--hidden", "1024", "--heads", "16", "--kv-heads", "4", "--ffn", "4096",
               "--vocab", "32000", "--experts", "8", "--top-k", "2", "--mlp", "swiglu", "--tied",
               "--gpus", "16", "--gpu", "a100-40g", "--seq", "2048", "--global-batch", "64", "--top", "2",
               "--write-config", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and " EP" in text
    cfg = load_config(out)
    assert (cfg.model.n_layers, cfg.model.hidden, cfg.model.kv_heads, cfg.model.ffn) == (8, 1024, 4, 4096)
    assert cfg.model.moe.n_experts == 8 and cfg.model.moe.top_k == 2 and cfg.model.tied_embeddings
    assert main(["--model", "llama3-8b", "--layers", "4", "--gpus", "8", "--seq", "128", "--global-batch", "8"]) == 2
    assert "cannot be combined" in capsys.readouterr().err
    assert main(["--model", "llama3-8b", "--gpus", "8", "--seq", "128", "--global-batch", "8",
                 "--schedules", "Zigzag"]) == 2
    assert "unknown ['Zigzag']" in capsys.readouterr().err


def test_registered_in_the_top_level_cli(capsys: pytest.CaptureFixture[str]) -> None:
    from framework.cli import main as tessera

    assert tessera(["plan", "--model", "llama3-8b", "--gpus", "8", "--seq", "2048", "--global-batch", "16",
                    "--top", "1"]) == 0
    assert "llama3-8b" in capsys.readouterr().out
    assert tessera(["plan", "--model", "llama3-405b", "--gpus", "8", "--gpu", "a100-40g", "--seq", "4096",
                    "--global-batch", "64"]) == 2
    assert "smallest cluster that fits" in capsys.readouterr().err
