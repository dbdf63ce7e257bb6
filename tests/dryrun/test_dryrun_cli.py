"""`tessera dryrun` end to end, rank classes at full size (pure), the over-budget stop, the launch gate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from framework.cli import main
from framework.config import load_config
from framework.dryrun.run import rank_classes
from framework.testing.tiny import TINY

ROOT = Path(__file__).resolve().parents[2]


def test_rank_classes_of_the_reference_layouts() -> None:
    cfg = load_config(str(ROOT / "configs/pretrain/llama3.1-405b-256n-h100.yaml"), [])
    classes = rank_classes(cfg, 2048)
    assert [(c.name, c.rank, c.members, c.layers) for c in classes] == [
        ("pp0 (first)", 0, 128, 7), ("pp1..14 (middle)", 128, 1792, 8), ("pp15 (last)", 1920, 128, 7)]
    cfg = load_config(str(ROOT / "configs/pretrain/gpt3-175b-128n-a100.yaml"), [])
    classes = rank_classes(cfg, 1024)  # interleaved: every rank holds 2 chunks of 6 layers; stage 0 and 15 differ
    assert [(c.name, c.members, c.layers) for c in classes] == [
        ("pp0 (first)", 128, 12), ("pp1..6 (middle)", 768, 12), ("pp7 (last)", 128, 12)]
    cfg = load_config(TINY, ["parallel.pp=2", "parallel.pp_schedule=ZBVZeroBubble", "model.n_layers=8"])
    assert [c.name for c in rank_classes(cfg, 4)] == ["pp0 (first+last)", "pp1 (middle)"]  # V: stage 0 and 3 on pp0


@pytest.mark.slow
def test_cli_writes_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "dry.json"
    rc = main(["dryrun", TINY, "parallel.tp=2", "parallel.pp=2", "parallel.pp_layer_split=[1,3]", "--world", "8",
               "--json", str(out), "--vs-planner"])
    text = capsys.readouterr().out
    assert rc == 0, text
    # The planner's states held between steps (ZeRO-1 on FSDP2: fp32 shards of parameters, gradients, AdamW)
    # equal what the engine holds, on both stages of an uneven split.
    rows = [line.split(" model states ")[1].split() for line in text.splitlines() if " model states " in line]
    ratios = [float(row[2]) for row in rows]
    assert len(ratios) == 2 and all(abs(r - 1.0) <= 0.02 for r in ratios), text
    assert "pp0 (first)" in text and "pp1 (last)" in text and "fits" in text
    data = json.loads(out.read_text())
    assert data["world_size"] == 8 and len(data["classes"]) == 2
    last = data["classes"][1]
    axes = {c["axis"] for c in last["measure"]["collectives"]}
    assert {"tp", "pp", "dp_shard"} <= axes
    assert last["measure"]["peak_by_label"]["logits_loss"] > 0  # the head lives on the last stage only
    assert "logits_loss" not in data["classes"][0]["measure"]["peak_by_label"]


@pytest.mark.slow
def test_planner_terms_agree_with_the_dry_run_at_405b_shapes(capsys: pytest.CaptureFixture[str]) -> None:
    # The 405B reference config's shapes (TP8, seq 8k, 128k vocabulary, ZeRO-1, full recompute, bf16) cut to
    # 4 layers on PP2: fake tensors cost by op count, not size. The planner's formulas against the measured step.
    rc = main(["dryrun", str(ROOT / "configs/pretrain/llama3.1-405b-256n-h100.yaml"), "model.n_layers=4",
               "parallel.pp=2", "parallel.pp_layer_split=[2,2]", "train.global_batch_size=8", "--world", "32",
               "--vs-planner"])
    text = capsys.readouterr().out
    assert rc == 0, text
    terms = ("model states", "activations", "logits and loss", "peak")  # framework/dryrun/planner.py rows
    ratio = {(line[:3], line[23:39].strip()): float(line[39:].split()[2]) for line in text.splitlines()
             if line.startswith(("pp0 (first)", "pp1 (last)")) and line[23:39].strip() in terms}
    # every term of both stages: states, kept activations (block inputs and their RoPE rows, the stage output
    # torch keeps, receive buffers; on the last stage what its backward has not freed yet: the head's tensors go
    # first) and the peak (one moment of the step: the embedding's gradient is its rows)
    assert all(abs(r - 1.0) <= 0.10 for r in ratio.values()) and len(ratio) == 8, text
    assert abs(ratio[("pp1", "model states")] - 1.0) <= 0.02, text


def test_planner_counts_the_rope_table_each_checkpointed_block_keeps(capsys: pytest.CaptureFixture[str]) -> None:
    # FSDP casts every block's floating inputs, the whole fp32 RoPE table too, and a checkpointed block keeps the
    # copy: with max_seq_len 128 x the step's sequence it is most of what the first stage keeps for backward
    # (without the term the planner's figure is 0.14 of the measured). Only that term: at this size the peaks
    # are set by MiB-scale transients the planner does not model.
    rc = main(["dryrun", TINY, "model.max_seq_len=4096", "parallel.pp=2", "parallel.dp_shard=2",
               "parallel.zero_stage=1", "parallel.recompute=full", "train.precision=bf16", "--world", "4",
               "--vs-planner"])
    text = capsys.readouterr().out
    assert rc == 0, text
    rows = [line for line in text.splitlines() if line.startswith("pp0 (first)") and line[23:39].strip() ==
            "activations"]
    assert len(rows) == 1 and abs(float(rows[0][39:].split()[2]) - 1.0) <= 0.10, text


@pytest.mark.slow
def test_a_layout_that_cannot_fit_stops_early_and_says_what_to_change(capsys: pytest.CaptureFixture[str]) -> None:
    # Llama-3-8B replicated on one A100-40GB: fp32 weights and gradients alone pass 40 GB.
    rc = main(["dryrun", TINY, "model.preset=llama3-8b", "model.n_layers=8", "parallel.dp_shard=1",
               "parallel.zero_stage=0", "data.seq_len=256", "train.global_batch_size=1", "train.micro_batch_size=1",
               "--world", "1", "--gpu", "a100-40g"])
    text = capsys.readouterr().out
    assert rc == 3, text
    assert "DOES NOT FIT" in text and "to fit:" in text


def test_405b_at_tp1_pp1_is_refused_with_its_cause(capsys: pytest.CaptureFixture[str]) -> None:
    # The reference config with the layout collapsed to pure data parallelism over 128 ranks (fewer than its
    # 2,048 to keep FSDP's per-rank chunking cheap here): the build holds only each rank's fp32 shards
    # (405B x 4 B / 128 = 11.8 GiB, not the 1.6 TB whole), and ZeRO-1 keeps every gathered unit from forward to
    # backward, which passes the budget during the first forward.
    rc = main(["dryrun", str(ROOT / "configs/pretrain/llama3.1-405b-256n-h100.yaml"), "parallel.tp=1",
               "parallel.pp=1", "parallel.pp_layer_split=null", "train.global_batch_size=128", "--world", "128"])
    text = capsys.readouterr().out
    assert rc == 3, text
    assert "DOES NOT FIT" in text and "stopped at" in text and "gathered FSDP units dominate" in text, text
    setup = float(text.split("tensors from building the model")[1].split(")")[1].split(",")[0])
    assert 11.0 < setup < 12.5, text  # the shards, drawn after fully_shard


@pytest.mark.slow
def test_fp8_dry_run_moves_fp8_on_the_tensor_parallel_wire(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """train.fp8 (tensorwise) on DP2 x TP2 + SP: the fake backend carries float8, so torchao's FP8 TP styles run
    as on NCCL (gloo cannot). In bf16 each sequence-parallel all-gather has a reduce-scatter of the same buffer;
    with FP8 the block's four all-gathers per micro-batch (attention and MLP inputs in e4m3 forward, wo's and w2's
    output gradients in e5m2 backward) move 1 byte per element, the reduce-scatters still bf16's 2."""
    pytest.importorskip("torchao", reason="train.fp8 needs torchao")
    out = tmp_path / "dry.json"
    rc = main(["dryrun", TINY, "train.precision=bf16", "train.fp8.enabled=true", "parallel.dp_shard=2",
               "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.zero_stage=3", "--world", "4",
               "--json", str(out), "--vs-planner"])
    text = capsys.readouterr().out
    assert rc == 0, text
    comm = {(c["axis"], c["op"]): c for c in json.loads(out.read_text())["classes"][0]["measure"]["collectives"]}
    gather, scatter = comm[("tp", "all_gather")], comm[("tp", "reduce_scatter")]
    assert {"float8_e4m3fn", "float8_e5m2"} <= set(gather["dtypes"]), gather
    cfg = load_config(TINY, [])
    n_micro = cfg.train.global_batch_size // cfg.train.micro_batch_size // 2
    buffer = cfg.data.seq_len * cfg.train.micro_batch_size * cfg.model.hidden  # one gathered block input
    assert gather["bytes"] == scatter["bytes"] - 4 * cfg.model.n_layers * n_micro * buffer, (gather, scatter)
    states = [line.split() for line in text.splitlines() if " model states " in line]
    assert states and abs(float(states[0][-1]) - 1.0) <= 0.02, text
