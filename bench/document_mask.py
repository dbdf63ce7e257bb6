"""Cost of per-document attention (`data.document_mask`): decoder forward + backward with the block-causal mask
against plain causal attention (`is_causal=True`) and against the former bool-mask path, same model and tokens.

    PYTHONPATH=. python bench/document_mask.py [--repeats 5] [--device cpu] [--write docs/benchmarks/document_mask.md]

The two variants run interleaved (plain, masked, plain, masked, ...) so machine load hits both alike; the figure
is the ratio of medians, masked / plain. Rows hold documents of ~`doc_len` tokens (EOD at random positions).
The mask itself is (B, 1, T, T) bool: B*T^2 bytes, listed per configuration.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from models.attention import document_mask
from models.config import PRESETS, ModelConfig
from models.decoder import build_model
from models.documents import DocumentMasking, block_causal_mask

SHAPES = [(4, 256, 64), (2, 1024, 256), (1, 2048, 512)]  # (rows, seq_len, mean document length)
KEY = "document-mask"
HEADING = "## Per-document attention cost"


def _step(model: torch.nn.Module, inputs: torch.Tensor, kwargs: dict[str, torch.Tensor]) -> float:
    t0 = time.perf_counter()
    model(inputs, **kwargs).float().square().mean().backward()
    if inputs.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def saved_bytes(model: torch.nn.Module, inputs: torch.Tensor, kwargs: dict[str, torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd keeps for backward over one forward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(inputs, **kwargs)
    return sum(storages.values())


def measure(cfg: ModelConfig, rows: int, seq: int, doc_len: int, repeats: int, device: torch.device
            ) -> dict[str, tuple[float, int]]:
    """Per variant (plain, bool = the former per-layer bool mask, masked = one shared additive mask):
    (median s of one forward + backward, bytes kept for backward)."""
    model = build_model(cfg, seed=0, device=device)
    gen = torch.Generator().manual_seed(0)
    eod = cfg.vocab_size - 1
    inputs = torch.randint(0, eod, (rows, seq), generator=gen)
    inputs[torch.rand(rows, seq, generator=gen) < 1.0 / doc_len] = eod
    inputs = inputs.to(device)
    masked = DocumentMasking(eod_id=eod).model_kwargs(inputs)
    builders = {"plain": document_mask, "bool": block_causal_mask, "masked": document_mask}
    times: dict[str, list[float]] = {name: [] for name in builders}
    kept: dict[str, int] = {}
    for i in range(repeats + 1):
        for name, builder in builders.items():
            model.mask_builder = builder
            kwargs = {} if name == "plain" else masked
            dt = _step(model, inputs, kwargs)
            model.zero_grad(set_to_none=True)
            if i:  # the first round warms up
                times[name].append(dt)
            else:
                kept[name] = saved_bytes(model, inputs, kwargs)
    return {name: (statistics.median(times[name]), kept[name]) for name in builders}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--preset", default="smoke-3m")
    parser.add_argument("--write", type=Path, default=None, help="replace this section of a markdown file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    cfg = ModelConfig(**{**PRESETS[args.preset], "max_seq_len": max(s for _, s, _ in SHAPES)})  # type: ignore[arg-type]
    lines = [HEADING, "",
             f"Command: `PYTHONPATH=. python bench/document_mask.py --repeats {args.repeats} --device {args.device}"
             f"{' --write ' + str(args.write) if args.write else ''}` (torch {torch.__version__}, {device}, fp32, "
             f"1 thread, model {args.preset}, median of {args.repeats}, both variants interleaved in one run). "
             "Forward + backward of the whole decoder; plain = `is_causal=True`; bool = the former path (one bool "
             "mask handed to SDPA, which converts it to a float copy in every layer); shared = one additive fp32 "
             "mask built per forward and taken by every layer as is (the CPU path now). Saved = bytes autograd "
             "keeps for backward over one forward.", "",
             "| rows x seq_len | mean doc length | plain ms | bool ms | shared ms | shared / bool time | plain saved "
             "| bool saved | shared saved | shared / bool saved |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    mib = 2**20
    for rows, seq, doc_len in SHAPES:
        r = measure(cfg, rows, seq, doc_len, args.repeats, device)
        (tp, sp), (tb, sb), (tm, sm) = r["plain"], r["bool"], r["masked"]
        lines.append(f"| {rows} x {seq} | {doc_len} | {1e3 * tp:.1f} | {1e3 * tb:.1f} | {1e3 * tm:.1f} | "
                     f"{tm / tb:.2f} | {sp / mib:.1f} MiB | {sb / mib:.1f} MiB | {sm / mib:.1f} MiB | {sm / sb:.2f} |")
    lines += ["", f"Load average during the run: {os.getloadavg()[0]:.1f} (the shared 2-core machine; timings are "
              "noisy, the interleaving keeps the ratio fair). SDPA computes every score and then masks, so nothing "
              "is skipped on CPU. On CUDA document masks take FlexAttention block masks (models/attention.py), "
              "which skip the masked tiles and keep no mask beyond a few int32 block tables; FlexAttention has no "
              "CPU backward, so that path is not timed here (tests/models/test_attention_kernels.py checks what it "
              "keeps)."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        from bench.sections import replace_section

        replace_section(args.write, KEY, text)


if __name__ == "__main__":
    main()
