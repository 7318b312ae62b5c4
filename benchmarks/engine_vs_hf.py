"""The engine against transformers' ``generate``: same checkpoint, same dtype, same torch threads,
greedy, N prompts x 128 new tokens, runs alternated so that a machine's load weighs on both.

    python benchmarks/engine_vs_hf.py                       # batch 8 and 32, models/tiny-moe, CPU
    python benchmarks/engine_vs_hf.py --batches 8 --reps 5 --device cuda --dtype bfloat16

Per batch size it prints each run's output tok/s, the median of each side and their ratio
(engine / transformers), then, from one more engine run, its time per decode step split into
model time and host time. On a CPU the model time is the forward pass and the logits, the
host time the rest of the step (scheduling, batch building, sampling, bookkeeping). On a GPU
the model time is the time the device is busy (kernel spans from ``torch.profiler``) and the
host overhead is the rest of the step's wall time: the time the device waits for the host.
Both sides generate the same tokens; the script checks that the engine's greedy tokens equal
``generate``'s (exit 1 if not). ``--no-transformers`` measures the engine alone (a model
transformers cannot load, or a machine without it).

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
    p.add_argument("--no-transformers", action="store_true", help="the engine alone (its tok/s and step split)")
    return p.parse_args(argv)


class StepTimer:
    """Wraps the engine's step: the wall time of every step (the device synchronised at its
    end) and, on a CPU, the part spent in the model (forward pass and logits), so that the host
    time is what is left. On a GPU the model's share is the time the device is busy: the
    union of its kernels' spans, from ``torch.profiler`` over ``profile_steps`` decode steps
    (those steps' wall times, slowed by the profiler, are left out of the medians)."""

    def __init__(self, engine, batch: int, profile_steps: int = 16):
        self.engine, self.device, self.batch = engine, engine.device, batch
        self.cuda = self.device.type == "cuda"
        self.model_s, self.tokens = 0.0, 0
        self.rows: list[tuple[int, float, float]] = []  # (tokens, step_s, model_s) per unprofiled step
        self.profile_steps, self.profiled, self.busy_s = profile_steps, 0, 0.0
        self._prof = None
        model = engine.model
        for name in ("forward", "logits"):
            setattr(model, name, self._timed(getattr(model, name), name == "forward"))

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _timed(self, fn, counts_tokens: bool):
        def wrapper(*args, **kwargs):
            if counts_tokens:
                self.tokens = args[0].shape[0]  # the step's new tokens
            if self.cuda:  # no sync inside the step: it would serialise the host and the device
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.model_s += time.perf_counter() - t0
            return out

        return wrapper

    def step(self) -> bool:
        # On a GPU, after a few decode steps, profile the next ``profile_steps`` ones.
        decodes = sum(n == self.batch for n, _, _ in self.rows)
        profiling = self.cuda and decodes >= 8 and self.profiled < self.profile_steps
        if profiling and self._prof is None:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self._prof.__enter__()
        self.model_s, self.tokens = 0.0, 0
        t0 = time.perf_counter()
        ran = self.engine.step()
        self._sync()
        if ran and profiling:
            self.profiled += 1
            if self.profiled == self.profile_steps:
                self._prof.__exit__(None, None, None)
                self.busy_s = device_busy_s(self._prof) / self.profile_steps
        elif ran:
            self.rows.append((self.tokens, time.perf_counter() - t0, self.model_s))
        return ran

    def report(self) -> str | None:
        """One line: the decode steps' time split into model (device) and host."""
        decode = [(s, m) for n, s, m in self.rows if n == self.batch]
        if not decode:
            return None
        step_ms = 1e3 * statistics.median(s for s, _ in decode)
        if self.cuda:
            if not self.profiled:
                return None
            busy_ms = 1e3 * self.busy_s
            host_pct = 100 * max(0.0, step_ms - busy_ms) / step_ms
            return (f"batch {self.batch} decode steps: step {step_ms:.3f} ms (median of {len(decode)}), device busy "
                    f"{busy_ms:.3f} ms (mean of {self.profiled} profiled), host overhead {step_ms - busy_ms:.3f} ms "
                    f"({host_pct:.1f}% of the step; target < 10%)")  # fmt: skip
        host_ms = 1e3 * statistics.median(s - m for s, m in decode)
        return (f"batch {self.batch} decode steps ({len(decode)}): step {step_ms:.2f} ms, host (outside the model) "
                f"{host_ms:.2f} ms = {100 * host_ms / step_ms:.1f}% of the step (medians)")  # fmt: skip


def device_busy_s(prof) -> float:
    """Seconds in which at least one kernel or copy ran on a CUDA device (the union of their
    spans, so that overlapping streams are not counted twice)."""
    spans = sorted(
        (e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
    )
    busy_us, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop > end:
            busy_us += stop - max(start, end)
            end = stop
    return busy_us * 1e-6


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
    from pagedweight.config.scenario import parse_bytes
    from pagedweight.core.runtime import CoreConfig
    from pwgpu.engine import Engine, EngineConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    hf, versions = None, f"torch {torch.__version__}"
    if not args.no_transformers:
        import transformers

        transformers.logging.set_verbosity_error()
        hf = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
        hf.generation_config.pad_token_id = hf.generation_config.eos_token_id
        versions += f", transformers {transformers.__version__}"
    cfg = EngineConfig(CoreConfig(budget_bytes=parse_bytes(args.mem_budget)), device=args.device, dtype=args.dtype)
    print(f"model {args.model}, {args.dtype} on {device}, {versions}, torch threads {torch.get_num_threads()}; "
          f"{args.prompt_tokens}-token prompts, {args.new_tokens} new tokens, greedy")  # fmt: skip
    g = torch.Generator().manual_seed(0)
    vocab = Engine(args.model, cfg).arch.vocab_size
    ok = True
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = torch.randint(2, vocab, (batch, args.prompt_tokens), generator=g).tolist()
        out_tokens = batch * args.new_tokens
        # Warm-up of both sides (allocator, kernel compilation, first-call costs), not timed.
        run_engine(Engine(args.model, cfg), prompts, 4)
        if hf is not None:
            run_hf(hf, prompts, 4, device)
        eng_s, hf_s = [], []
        for rep in range(args.reps):
            engine = Engine(args.model, cfg)  # a fresh engine each run: the same empty KV cache
            dt_e, ids_e = run_engine(engine, prompts, args.new_tokens)
            eng_s.append(dt_e)
            line = f"batch {batch} run {rep}: engine {out_tokens / dt_e:8.1f} tok/s"
            if hf is not None:
                dt_h, ids_h = run_hf(hf, prompts, args.new_tokens, device)
                hf_s.append(dt_h)
                same = sum(a == b for a, b in zip(ids_e, ids_h, strict=True))
                ok &= same == batch
                line += f"   transformers {out_tokens / dt_h:8.1f} tok/s   same greedy tokens {same}/{batch}"
            print(line, flush=True)
        e_med = statistics.median(eng_s)
        line = f"batch {batch}: engine {out_tokens / e_med:.1f} tok/s"
        if hf_s:
            h_med = statistics.median(hf_s)
            line += f", transformers {out_tokens / h_med:.1f} tok/s, ratio {h_med / e_med:.2f}x"
        print(f"{line} (medians of {args.reps})")
        # One more engine run, not in the ratio, with its steps split into model and host time.
        timer = StepTimer(Engine(args.model, cfg), batch)
        run_engine(timer.engine, prompts, args.new_tokens, timer)
        print(timer.report() or f"batch {batch}: no decode steps to split", flush=True)
    if not ok:
        print("engine and transformers disagree on some greedy tokens", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
