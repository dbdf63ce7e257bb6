"""`tessera generate` — sample text from a checkpoint.

    tessera generate RUN_OR_CKPT --prompt "def main(" [--prompt ...] [--prompts-file FILE]
                     [--max-new-tokens 64] [--temperature 0] [--top-k 0] [--top-p 1] [--seed 0]
                     [--step N] [--device cpu|cuda] [--dtype fp32|bf16] [--ids] [--no-eos] [--no-cache]
                     [--draft-tokens N]

The checkpoint may come from any layout (it is resharded into one process). Text goes through the run's own
sentencepiece tokenizer (found from the checkpoint's data config, or --tokenizer); with --ids, or for a run on
synthetic data, prompts are space-separated token ids and the output is ids. One prompt streams to the
terminal as it decodes; several are decoded as one batch and printed in order.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("generate", help="sample text from a checkpoint (greedy or sampled, batched)")
    p.add_argument("checkpoint", type=Path, help="run directory, its checkpoints/ or a step_N directory")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    p.add_argument("--prompts-file", type=Path, default=None,
                   help="one prompt per line, or a .jsonl file of {\"prompt\": ...} objects")
    p.add_argument("--step", type=int, default=None, help="default: latest")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="sentencepiece .model or tokenizer.json (default: the run's)")
    p.add_argument("--ids", action="store_true", help="prompts and output are token ids")
    p.add_argument("--no-eos", action="store_true", help="do not stop at the end-of-sequence token")
    p.add_argument("--no-cache", action="store_true", help="recompute every position (reference; slow)")
    p.add_argument("--draft-tokens", type=int, default=0,
                   help="speculative decoding: the model's MTP modules draft this many tokens per forward "
                        "(1..model.mtp_depth; greedy only, same output)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.set_defaults(func=cmd_generate)


def read_prompts(args: argparse.Namespace) -> list[str]:
    from framework.base.errors import ConfigError

    prompts = list(args.prompt)
    if args.prompts_file is not None:
        lines = args.prompts_file.read_text().splitlines()
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            if args.prompts_file.suffix == ".jsonl":
                try:
                    prompts.append(str(json.loads(line)["prompt"]))
                except (json.JSONDecodeError, KeyError, TypeError) as err:
                    raise ConfigError(f"{args.prompts_file}:{n}: expected a JSON object with a \"prompt\" "
                                      f"string ({err}); fix that line") from err
            else:
                prompts.append(line.replace("\\n", "\n"))
    if not prompts:
        raise ConfigError("no prompt: pass --prompt TEXT (repeatable) or --prompts-file FILE")
    return prompts


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from framework.base.errors import ConfigError
    from framework.checkpoint.run_tokenizer import checkpoint_tokenizer
    from framework.infer.generate import DecodeTrace, SamplingConfig, generate, load_generator

    prompts = read_prompts(args)
    model, meta = load_generator(args.checkpoint, args.step, args.device, getattr(torch, _DTYPES[args.dtype]))
    tok_path = args.tokenizer or (None if args.ids else checkpoint_tokenizer(meta, args.checkpoint))
    sp = None
    if tok_path is not None:
        from data_pipeline.tokenizer import Tokenizer

        sp = Tokenizer(tok_path)  # sentencepiece .model or tokenizer.json, as the run's data build
    elif not args.ids:
        raise ConfigError(f"no tokenizer for {args.checkpoint}: the run trained on synthetic data; pass --ids with "
                          f"token-id prompts, or --tokenizer PATH")
    try:
        encoded = [sp.encode(p) if sp is not None else [int(x) for x in p.split()] for p in prompts]
    except ValueError as err:
        raise ConfigError(f"with --ids every prompt is space-separated integers: {err}") from err
    vocab = model.cfg.vocab_size
    if any(not 0 <= t < vocab for ids in encoded for t in ids):
        raise ConfigError(f"a prompt token id is outside [0, model.vocab_size={vocab})")
    cfg = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                         top_p=args.top_p, seed=args.seed, stop_at_eos=not args.no_eos, use_cache=not args.no_cache,
                         draft_tokens=args.draft_tokens)
    eos = int(sp.eos_id) if sp is not None else None
    stream = len(prompts) == 1 and not args.json
    shown: list[int] = []

    def on_token(row: int, token: int) -> None:  # print the new suffix of the decoded text
        before = _detok(sp, encoded[0] + shown)
        shown.append(token)
        sys.stdout.write(_detok(sp, encoded[0] + shown)[len(before):])
        sys.stdout.flush()

    if stream:
        sys.stdout.write(prompts[0] if sp is not None else " ".join(map(str, encoded[0])))
    trace = DecodeTrace()
    outs = generate(model, encoded, cfg, eos, on_token if stream else None, trace)
    if cfg.draft_tokens:
        print(f"speculative decoding: {trace.accepted} of {trace.drafted} drafts accepted, "
              f"{trace.forwards + 1} forwards", file=sys.stderr)
    if stream:
        sys.stdout.write("\n")
        return 0
    for prompt, ids, new in zip(prompts, encoded, outs, strict=True):
        text = _detok(sp, ids + new)[len(_detok(sp, ids)):]
        if args.json:
            print(json.dumps({"prompt": prompt, "completion": text, "tokens": new}))
        else:
            print(f"--- {prompt!r}\n{prompt if sp is not None else ''}{text}")
    return 0


def _detok(sp: Any, ids: list[int]) -> str:
    return str(sp.decode(ids)) if sp is not None else " " + " ".join(map(str, ids))
