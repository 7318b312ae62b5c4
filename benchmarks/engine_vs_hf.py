"""The engine against transformers' ``generate``: same checkpoint, same dtype, same torch threads,
greedy, N prompts x 128 new tokens, runs alternated so that a machine's load weighs on both.

    python benchmarks/engine_vs_hf.py                       # batch 8 and 32, models/tiny-moe, CPU
    python benchmarks/engine_vs_hf.py --batches 8 --reps 5 --device cuda --dtype bfloat16

Per batch size it prints each run's output tok/s, the median of each side and their ratio
(engine / transformers), then the engine's time per decode step split into model time (the
forward pass and the logits, with the device synchronised around them) and host time (the
rest of the step: scheduling, batch building, sampling, bookkeeping). Both sides generate the
same tokens; the script checks that the engine's greedy tokens equal ``generate``'s.

The engine runs with the ``pagedweight`` policy and a budget that holds every expert at the
checkpoint's precision, as ``pwgpu serve`` does by default.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "models" / "tiny-moe"))
    p.add_argument("--batches", default="8,32", help="prompts per run, comma-separated")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3, help="timed runs of each side per batch size")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", help="both sides' compute dtype (the engine's CPU default)")
    p.add_argument("--mem-budget", default="64MiB")
    return p.parse_args(argv)


class StepTimer:
    """Wraps the engine's step, forward and logits: per decode step, the wall time and the part
    spent in the model (the device synchronised before and after, so queued work is counted
    where it runs)."""

    def __init__(self, engine):
        self.engine, self.device = engine, engine.device
        self.model_s, self.tokens = 0.0, 0
        self.rows: list[tuple[int, float, float]] = []  # (tokens, step_s, model_s) per step
        model = engine.model
        for name in ("forward", "logits"):
            setattr(model, name, self._timed(getattr(model, name)))

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            if fn.__name__ == "forward":
                self.tokens = args[0].shape[0]  # the step's new tokens
            self._sync()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self._sync()
            self.model_s += time.perf_counter() - t0
            return out

        return wrapper

    def step(self) -> bool:
        self.model_s, self.tokens = 0.0, 0
        t0 = time.perf_counter()
        ran = self.engine.step()
        self._sync()
        if ran:
            self.rows.append((self.tokens, time.perf_counter() - t0, self.model_s))
        return ran


def run_engine(engine, prompts, new_tokens: int, timer: StepTimer | None = None):
    from pwgpu.sampling import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    ers = [engine.add(p, params) for p in prompts]
    step = timer.step if timer else engine.step
    while engine.has_work():
        if not step():
            engine.core.check_stall(requests_coming=False)
    dt = time.perf_counter() - t0
    return dt, [er.output_ids for er in ers]


def run_hf(hf, prompts, new_tokens: int, device):
    ids = torch.tensor(prompts, device=device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False)  # fmt: skip
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dt = time.perf_counter() - t0
    return dt, out[:, ids.shape[1] :].tolist()


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import transformers

    from pagedweight.config.scenario import parse_bytes
    from pagedweight.core.runtime import CoreConfig
    from pwgpu.engine import Engine, EngineConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    hf.generation_config.pad_token_id = hf.generation_config.eos_token_id
    cfg = EngineConfig(CoreConfig(budget_bytes=parse_bytes(args.mem_budget)), device=args.device, dtype=args.dtype)
    print(f"model {args.model}, {args.dtype} on {device}, torch {torch.__version__} threads {torch.get_num_threads()}, "
          f"transformers {transformers.__version__}; {args.prompt_tokens}-token prompts, {args.new_tokens} new "
          "tokens, greedy")  # fmt: skip
    g = torch.Generator().manual_seed(0)
    vocab = hf.config.vocab_size
    ok = True
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = torch.randint(2, vocab, (batch, args.prompt_tokens), generator=g).tolist()
        out_tokens = batch * args.new_tokens
        # Warm-up of both sides (allocator, first-call costs), not timed.
        engine = Engine(args.model, cfg)
        run_engine(engine, prompts, 4)
        run_hf(hf, prompts, 4, device)
        eng_s, hf_s = [], []
        timer = None
        for rep in range(args.reps):
            engine = Engine(args.model, cfg)  # a fresh engine each run: the same empty KV cache
            timer = StepTimer(engine) if rep == args.reps - 1 else None  # the last run is also split
            dt_e, ids_e = run_engine(engine, prompts, args.new_tokens, timer)
            dt_h, ids_h = run_hf(hf, prompts, args.new_tokens, device)
            eng_s.append(dt_e)
            hf_s.append(dt_h)
            same = sum(a == b for a, b in zip(ids_e, ids_h, strict=True))
            ok &= same == batch
            print(f"batch {batch} run {rep}: engine {out_tokens / dt_e:8.1f} tok/s{' (timed steps)' if timer else ''}"
                  f"   transformers {out_tokens / dt_h:8.1f} tok/s   same greedy tokens {same}/{batch}")  # fmt: skip
        e_med, h_med = statistics.median(eng_s), statistics.median(hf_s)
        print(f"batch {batch}: engine {out_tokens / e_med:.1f} tok/s, transformers {out_tokens / h_med:.1f} tok/s, "
              f"ratio {h_med / e_med:.2f}x (medians of {args.reps})")  # fmt: skip
        decode = [(s, m) for n, s, m in timer.rows if n == batch]
        if decode:
            step_ms = 1e3 * statistics.median(s for s, _ in decode)
            model_ms = 1e3 * statistics.median(m for _, m in decode)
            host = statistics.median((s - m) / s for s, m in decode)
            print(f"batch {batch} decode steps ({len(decode)}): step {step_ms:.2f} ms, model {model_ms:.2f} ms, "
                  f"host {step_ms - model_ms:.2f} ms ({100 * host:.1f}% of the step; medians)")  # fmt: skip
    if not ok:
        print("engine and transformers disagree on some greedy tokens", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
