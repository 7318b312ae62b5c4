"""The engine against transformers' ``generate``: same checkpoint, same dtype, same torch threads,
greedy, runs alternated so that a machine's load weighs on both.

    python benchmarks/engine_vs_hf.py                       # batch 8 and 32, models/tiny-moe, CPU
    python benchmarks/engine_vs_hf.py --batches 8 --reps 5 --device cuda --dtype bfloat16
    python benchmarks/engine_vs_hf.py --lengths azure       # requests of the Azure trace's lengths

Two workloads:

- ``--lengths uniform`` (the default): N prompts of ``--prompt-tokens`` x ``--new-tokens`` new
  tokens, one ``generate`` call of batch N. Both sides do the same work step for step; this
  measures the engine's step against transformers' step.
- ``--lengths azure``: ``--requests`` requests (default 2 x the batch) with the prompt and
  output lengths of rows drawn (seeded) from the Azure conversation trace
  (``../shared/traces/azure_conv_2023.csv``), prompts clipped to ``--max-prompt-tokens`` so
  that every request fits the model's context. The engine gets them all at once and keeps at
  most ``batch`` running (continuous batching, ``max_num_seqs``); transformers runs them as a
  serving loop without an engine would: batches of ``batch`` in order, prompts left-padded to
  the batch's longest, each batch generating until its longest output is done. Throughput is
  the requests' own output tokens per second on both sides.

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
# ../shared beside the checkout (or beside the folder of worktrees).
SHARED = next(
    (p for p in (ROOT.parent / "shared", ROOT.parent.parent / "shared") if p.is_dir()), ROOT.parent / "shared"
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "models" / "tiny-moe"))
    p.add_argument("--batches", default="8,32", help="prompts per run, comma-separated")
    p.add_argument("--lengths", choices=("uniform", "azure"), default="uniform",
                   help="uniform: each request --prompt-tokens x --new-tokens; azure: the trace's lengths")  # fmt: skip
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--requests", type=int, default=None, help="--lengths azure: requests per batch size (2 x batch)")
    p.add_argument("--max-prompt-tokens", type=int, default=1024, help="--lengths azure: longer prompts clipped")
    p.add_argument("--trace", default=str(SHARED / "traces" / "azure_conv_2023.csv"), help="--lengths azure: the trace")
    p.add_argument("--reps", type=int, default=3, help="timed runs of each side per batch size")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", help="both sides' compute dtype (the engine's CPU default)")
    p.add_argument("--mem-budget", default=None,
                   help="the engine's pool (default 64MiB uniform, 1GiB azure: every expert at full precision and "
                        "the KV of every running request, so no precision changes)")  # fmt: skip
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


def run_engine(engine, prompts, new_tokens: list[int], timer: StepTimer | None = None):
    from pwgpu.sampling import SamplingParams

    t0 = time.perf_counter()
    ers = [
        engine.add(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        for p, n in zip(prompts, new_tokens, strict=True)
    ]
    step = timer.step if timer else engine.step
    while engine.has_work():
        if not step():
            engine.core.check_stall(requests_coming=False)
    dt = time.perf_counter() - t0
    return dt, [er.output_ids for er in ers]


def run_hf(hf, prompts, new_tokens: list[int], device, batch: int):
    """``generate`` over the requests in batches of ``batch``, in order: prompts left-padded to
    the batch's longest (masked), each batch generating its longest output (``generate`` has no
    per-row length; rows done early keep going). Returns each request's own tokens."""
    pad = hf.generation_config.pad_token_id
    outs: list[list[int]] = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        rows, lens = prompts[i : i + batch], new_tokens[i : i + batch]
        width = max(map(len, rows))
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens),
                              do_sample=False)  # fmt: skip
        outs += [row[width : width + n] for row, n in zip(out.tolist(), lens, strict=True)]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, outs


def azure_lengths(path: Path, count: int, max_prompt: int, seed: int) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of ``count`` rows drawn without replacement, seeded, from an
    Azure-format trace (``ContextTokens``, ``GeneratedTokens``); prompts clipped to ``max_prompt``."""
    import pandas as pd

    if not path.is_file():
        raise SystemExit(f"engine_vs_hf: --lengths azure needs the Azure trace at {path} (--trace FILE)")
    rows = pd.read_csv(path, usecols=["ContextTokens", "GeneratedTokens"])
    rows = rows.sample(n=count, random_state=seed)
    pairs = zip(rows.ContextTokens, rows.GeneratedTokens, strict=True)
    return [(min(int(p), max_prompt), max(int(n), 1)) for p, n in pairs]


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from pagedweight.config.scenario import parse_bytes
    from pagedweight.core.runtime import CoreConfig
    from pagedweight.core.scheduler import SchedulerConfig
    from pwgpu.engine import Engine, EngineConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    varied = args.lengths == "azure"
    budget_bytes = parse_bytes(args.mem_budget or ("1GiB" if varied else "64MiB"))
    hf, versions = None, f"torch {torch.__version__}"
    if not args.no_transformers:
        import transformers

        transformers.logging.set_verbosity_error()
        hf = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
        hf.generation_config.pad_token_id = hf.generation_config.eos_token_id
        versions += f", transformers {transformers.__version__}"
    shape = (f"the Azure trace's lengths (prompts clipped to {args.max_prompt_tokens})" if varied
             else f"{args.prompt_tokens}-token prompts, {args.new_tokens} new tokens")  # fmt: skip
    print(f"model {args.model}, {args.dtype} on {device}, {versions}, torch threads {torch.get_num_threads()}; "
          f"{shape}, greedy")  # fmt: skip
    g = torch.Generator().manual_seed(0)
    ok = True
    for batch in (int(b) for b in args.batches.split(",")):
        core = CoreConfig(budget_bytes=budget_bytes, scheduler=SchedulerConfig(max_num_seqs=batch))
        cfg = EngineConfig(core, device=args.device, dtype=args.dtype)
        vocab = Engine(args.model, cfg).arch.vocab_size
        if varied:
            count = args.requests or 2 * batch
            lengths = azure_lengths(Path(args.trace), count, args.max_prompt_tokens, seed=batch)
        else:
            lengths = [(args.prompt_tokens, args.new_tokens)] * batch
        prompts = [torch.randint(2, vocab, (p,), generator=g).tolist() for p, _ in lengths]
        new_tokens = [n for _, n in lengths]
        out_tokens = sum(new_tokens)
        if varied:
            prompt_tokens = [p for p, _ in lengths]
            print(f"batch {batch}: {len(lengths)} requests, prompt tokens mean {statistics.mean(prompt_tokens):.0f} "
                  f"max {max(prompt_tokens)}, output tokens mean {out_tokens / len(lengths):.0f} "
                  f"max {max(new_tokens)}")  # fmt: skip
        # Warm-up of both sides (allocator, kernel compilation, first-call costs), not timed.
        run_engine(Engine(args.model, cfg), prompts[:batch], [4] * len(prompts[:batch]))
        if hf is not None:
            run_hf(hf, prompts[:batch], [4] * len(prompts[:batch]), device, batch)
        eng_s, hf_s = [], []
        for rep in range(args.reps):
            engine = Engine(args.model, cfg)  # a fresh engine each run: the same empty KV cache
            dt_e, ids_e = run_engine(engine, prompts, new_tokens)
            changes = sum(engine.core.num_transitions.values())
            if changes:  # a precision change would make the engine's model another one
                print(f"batch {batch}: the engine changed precision {changes} times: raise --mem-budget",
                      file=sys.stderr)  # fmt: skip
                return 1
            eng_s.append(dt_e)
            line = f"batch {batch} run {rep}: engine {out_tokens / dt_e:8.1f} tok/s"
            if hf is not None:
                dt_h, ids_h = run_hf(hf, prompts, new_tokens, device, batch)
                hf_s.append(dt_h)
                same = sum(a == b for a, b in zip(ids_e, ids_h, strict=True))
                # Uniform batches run the same shapes on both sides; padded batches change the
                # shapes transformers multiplies, so its rounding (and rarely a greedy pick) may differ.
                ok &= same == len(prompts) or varied
                line += f"   transformers {out_tokens / dt_h:8.1f} tok/s   same greedy tokens {same}/{len(prompts)}"
            print(line, flush=True)
        e_med = statistics.median(eng_s)
        line = f"batch {batch}: engine {out_tokens / e_med:.1f} tok/s"
        if hf_s:
            h_med = statistics.median(hf_s)
            line += f", transformers {out_tokens / h_med:.1f} tok/s, ratio {h_med / e_med:.2f}x"
        print(f"{line} (medians of {args.reps})")
        # One more engine run, not in the ratio, with its steps split into model and host time.
        timer = StepTimer(Engine(args.model, cfg), batch)
        run_engine(timer.engine, prompts, new_tokens, timer)
        print(timer.report() or f"batch {batch}: no decode steps to split", flush=True)
    if not ok:
        print("engine and transformers disagree on some greedy tokens", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
