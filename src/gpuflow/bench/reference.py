"""``gpuflow bench reference``: gpuflow's training recipe beside nanoGPT's own ``train.py``.

    gpuflow bench reference --nanogpt ../nanoGPT --preset seed-d384 --devices 0,1 --seeds 2
    gpuflow bench reference --nanogpt ../nanoGPT --preset gpt2-124m --set data.dir=data/web \\
        --set train.batch_size=16 --set train.batch_tokens=131072 --devices 0,1,2
    gpuflow bench reference --nanogpt ../nanoGPT --device cpu --preset tiny --steps 20 \\
        --set model.n_layer=2 --set train.eval_interval=10 --set train.warmup_steps=5

The same model, token data, batch, learning-rate schedule and steps, trained once by
``gpuflow train`` and once by nanoGPT's ``train.py`` (a checkout the user names; nothing of it
is copied here), each in a child process in a scratch folder under the system's temporary
folder (``TMPDIR``): nanoGPT reads a copy of the token folder's bodies there as
``data/<name>/train.bin`` and ``val.bin``, and takes every setting as a ``--key=value``
override. With ``--seeds K`` gpuflow also trains with seeds ``train.seed + 1 ...``: the spread
between its own runs is the noise the gap to nanoGPT is read against. The result holds both
validation curves (at equal tokens and against wall time from each child's start), their
speeds, the gap at every shared step and what still differs between the trainers
(``DIFFERENCES``); ``gpuflow.bench.reference_curves`` reads the children's curves, compares
and draws them.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpuflow.bench.placement import Job, run_jobs
from gpuflow.bench.reference_curves import NANOGPT_SEED, compare, gpuflow_run, nanogpt_run
from gpuflow.bench.scale import child_env, token_folder
from gpuflow.common.console import err_console
from gpuflow.common.errors import GpuflowError
from gpuflow.data.shards import HEADER_BYTES
from gpuflow.data.tokens import TokenFolder, check_ids
from gpuflow.device.accelerator import Device
from gpuflow.train.batching import Batching, plan_batching
from gpuflow.train.config import RunConfig, resolve_config, to_toml
from gpuflow.train.runfolder import RUNS_DIR

NANOGPT_FILES = ("train.py", "model.py", "configurator.py")
DATASET = "gpuflow"  # nanoGPT reads data/<dataset>/ from its cwd: the scratch folder's
NANOGPT_OUT = "nanogpt-out"  # its out_dir, where it saves ckpt.pt, inside the scratch folder
CHUNK_BYTES = 16 << 20  # the token folder is copied 16 MiB at a time: corpora can be GBs
# What still differs between the two trainers given the same settings.
DIFFERENCES = (
    "warmup: nanoGPT's rate at iteration i < warmup is lr*(i+1)/(warmup_iters+1), gpuflow's "
    "lr*(i+1)/warmup_steps",
    "evaluation: nanoGPT averages eval_iters random batches of val (and of train, which its "
    "wall time includes); gpuflow as many batches of fixed val windows spread over the split "
    "(fewer where the split is too short for them all to be disjoint)",
    "precision on CUDA: nanoGPT keeps fp32 weights and an fp32 residual stream under bf16 "
    "autocast; gpuflow a bf16 residual stream and bf16 weights over fp32 master weights",
    "sampling: each draws its own random training windows (nanoGPT always seeds torch with "
    "1337; gpuflow with train.seed)",
    "checkpoints: nanoGPT saves ckpt.pt in the foreground at each evaluation that improves val "
    "loss; gpuflow every train.checkpoint_interval and at each best, written in the background",
)


@dataclass(frozen=True)
class ReferenceConfig:
    nanogpt: str  # the nanoGPT checkout: train.py, model.py, configurator.py
    preset: str | None = "seed-d384"  # None: the config file's
    config_file: str | None = None
    overrides: tuple[str, ...] = ()
    steps: int | None = None  # None: the config's train.steps
    devices: tuple[int, ...] = ()  # GPUs the children are placed on; (): one after another
    seeds: int = 1  # gpuflow runs, with seeds train.seed, train.seed + 1, ...

    def __post_init__(self) -> None:
        if self.seeds < 1:
            raise GpuflowError(f"--seeds must be >= 1, got {self.seeds}")
        if self.steps is not None and self.steps < 1:
            raise GpuflowError(f"--steps must be >= 1, got {self.steps}")
        if len(set(self.devices)) != len(self.devices) or any(d < 0 for d in self.devices):
            raise GpuflowError(
                f"--devices must name distinct GPU indices, like 0,1; got "
                f"{','.join(map(str, self.devices))}"
            )
        folder = Path(self.nanogpt).expanduser()
        missing = [name for name in NANOGPT_FILES if not (folder / name).is_file()]
        if missing:
            raise GpuflowError(
                f"--nanogpt {self.nanogpt} is not a nanoGPT checkout: it lacks "
                f"{', '.join(missing)}; point it at the folder holding nanoGPT's train.py"
            )

    def run_config(self) -> RunConfig:
        """The gpuflow run's config, resolved as ``gpuflow train`` resolves it."""
        steps = [] if self.steps is None else [f"train.steps={self.steps}"]
        return resolve_config(self.preset, self.config_file, [*self.overrides, *steps])


@dataclass(frozen=True)
class Plan:
    config: RunConfig
    batching: Batching


# ---- what both trainers are given --------------------------------------------------------


def check_reference(bench: ReferenceConfig, device: Device) -> Plan:
    """The run both trainers make; refuses, in one line, what nanoGPT cannot run or what
    would leave nothing to compare."""
    if device.type not in ("cuda", "cpu"):
        raise GpuflowError(f"bench reference runs nanoGPT on cuda or the cpu, not {device.type}")
    if bench.devices:
        import torch

        if device.type != "cuda":
            raise GpuflowError(
                "--devices names GPUs; on the cpu the runs go one after another: leave it out"
            )
        if max(bench.devices) >= torch.cuda.device_count():
            raise GpuflowError(
                f"--devices {','.join(map(str, bench.devices))} names GPU "
                f"{max(bench.devices)} but {torch.cuda.device_count()} are visible"
            )
    config = bench.run_config()
    tc, model = config.train, config.model
    if tc.batch_size == 0:
        raise GpuflowError(
            "bench reference needs an explicit micro-batch: train.batch_size=0 means the "
            "largest that fits the device, which nanoGPT's train.py cannot find; set it, e.g. "
            "--set train.batch_size=16"
        )
    if model.vocab_size > 1 << 16:
        raise GpuflowError(
            f"model.vocab_size {model.vocab_size} needs uint32 tokens, and nanoGPT's train.py "
            "reads uint16 only: use a vocabulary of at most 65,536"
        )
    if tc.steps % tc.eval_interval:
        raise GpuflowError(
            f"train.steps ({tc.steps}) is not a multiple of train.eval_interval "
            f"({tc.eval_interval}): nanoGPT evaluates only at multiples of it, so the final "
            "losses would not be at the same step; change --steps or train.eval_interval"
        )
    if tc.warmup_steps == tc.schedule_steps:
        raise GpuflowError(
            f"train.warmup_steps equals the schedule's {tc.schedule_steps} steps, and nanoGPT's "
            "train.py divides by lr_decay_iters - warmup_iters; lower train.warmup_steps"
        )
    if config.data.dir:
        uint16_folder(Path(config.data.dir).expanduser())
    return Plan(config, plan_batching(config))


def uint16_folder(path: Path) -> TokenFolder:
    """The token folder, opened, refused unless every shard holds uint16 tokens."""
    tokens = TokenFolder.open(path)
    wide = next((s for s in tokens.train + tokens.val if s.dtype != np.dtype("<u2")), None)
    if wide is not None:
        raise GpuflowError(
            f"bench reference: {wide.path} holds {wide.dtype.itemsize * 8}-bit tokens and "
            "nanoGPT's train.py reads uint16 only: use a token folder with a vocabulary of at "
            "most 65,536"
        )
    return tokens


def nanogpt_settings(config: RunConfig, batching: Batching, cuda: bool, device: str) -> dict:
    """nanoGPT's globals for the run ``config`` describes, as its configurator takes them
    (each of the type of train.py's default: floats stay floats)."""
    m, t = config.model, config.train
    return {
        "n_layer": m.n_layer, "n_head": m.n_head, "n_embd": m.d_model, "block_size": m.max_len,
        "bias": False, "dropout": 0.0,
        "batch_size": batching.micro_batch,
        "gradient_accumulation_steps": batching.accumulation,
        "learning_rate": float(t.lr), "min_lr": float(t.lr * t.min_lr_ratio),
        "warmup_iters": t.warmup_steps, "lr_decay_iters": t.schedule_steps,
        "max_iters": t.steps, "decay_lr": True,
        "weight_decay": float(t.weight_decay), "beta1": float(t.beta1), "beta2": float(t.beta2),
        "grad_clip": float(t.grad_clip),
        "eval_interval": t.eval_interval, "eval_iters": t.eval_batches,
        "log_interval": t.log_interval,
        "compile": bool(t.compile and cuda),  # torch.compile's kernels need CUDA here
        "dtype": "bfloat16" if cuda else "float32",
        "device": device, "dataset": DATASET, "out_dir": NANOGPT_OUT,
        "always_save_checkpoint": False, "init_from": "scratch", "wandb_log": False,
    }  # fmt: skip


def nanogpt_command(nanogpt: Path, settings: dict[str, Any]) -> list[str]:
    """``python DIR/train.py --key=value ...``: values written so that its configurator's
    ``literal_eval`` gives them back with their types (a string stays a bare word)."""
    flags = [f"--{key}={value!r}" if isinstance(value, float) else f"--{key}={value}"
             for key, value in settings.items()]  # fmt: skip
    return [sys.executable, str(nanogpt / "train.py"), *flags]


def write_nanogpt_data(tokens: TokenFolder, target: Path, vocab_size: int) -> dict[str, int]:
    """The token folder as nanoGPT reads it: each split's shard bodies (headers dropped)
    end to end in ``target/train.bin`` and ``val.bin``, and ``meta.pkl`` with the vocabulary,
    copied in bounded pieces, every id checked against ``vocab_size``. Tokens per split."""
    target.mkdir(parents=True)
    counts = {}
    for split in ("train", "val"):
        count = 0
        with open(target / f"{split}.bin", "wb") as out:
            for shard in getattr(tokens, split):
                with open(shard.path, "rb") as source:
                    source.seek(HEADER_BYTES)
                    while piece := source.read(CHUNK_BYTES):  # whole tokens: an even size
                        check_ids(shard.path, int(np.frombuffer(piece, "<u2").max()), vocab_size)
                        out.write(piece)
                count += shard.n_tokens
        counts[split] = count
    with open(target / "meta.pkl", "wb") as meta:
        pickle.dump({"vocab_size": vocab_size}, meta)
    return counts


def checkout_commit(folder: Path) -> str | None:
    """The commit of the git checkout ``folder`` is the top of, else None (a folder inside
    another repository is not a checkout of nanoGPT: its commit says nothing of it)."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(folder), *args], capture_output=True,
                                  text=True, timeout=30)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != folder.resolve():
        return None
    return git("rev-parse", "HEAD")


def device_slots(devices: tuple[int, ...]) -> list[dict[str, str]]:
    """One environment per GPU in ``devices`` naming it alone (through this process's own
    CUDA_VISIBLE_DEVICES, if set); one empty slot when there are none: one job at a time."""
    if not devices:
        return [{}]
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    named = visible if any(visible) else None
    return [{"CUDA_VISIBLE_DEVICES": named[i] if named else str(i)} for i in devices]


# ---- the bench ---------------------------------------------------------------------------


def run_reference_bench(device: Device, bench: ReferenceConfig) -> dict[str, Any]:
    plan = check_reference(bench, device)
    batching, data_dir = plan.batching, token_folder(plan.config)
    config = dataclasses.replace(
        plan.config, data=dataclasses.replace(plan.config.data, dir=str(data_dir))
    )
    tokens = uint16_folder(data_dir)
    nanogpt = Path(bench.nanogpt).expanduser().absolute()
    child_device = "cuda" if bench.devices else str(device)
    settings = nanogpt_settings(config, batching, device.type == "cuda", child_device)
    seeds = [config.train.seed + k for k in range(bench.seeds)]
    env = {**child_env(), "TTY_COMPATIBLE": "0"}  # plain lines to read, not a live display
    scratch = Path(tempfile.mkdtemp(prefix="gpuflow-reference-"))
    err_console.print(f"runs in {scratch} (removed afterwards)")
    try:
        err_console.print(f"writing nanoGPT's data/{DATASET}/ from {data_dir}...")
        counts = write_nanogpt_data(tokens, scratch / "data" / DATASET, config.model.vocab_size)
        for split, count in counts.items():
            if count <= config.model.max_len:  # nanoGPT draws windows of max_len + 1
                raise GpuflowError(
                    f"bench reference: the {split} split holds {count} tokens; nanoGPT needs "
                    f"more than model.max_len ({config.model.max_len})"
                )
        # train.py exec's configurator.py from its cwd.
        shutil.copyfile(nanogpt / "configurator.py", scratch / "configurator.py")
        nano_job = Job("nanoGPT", nanogpt_command(nanogpt, settings), scratch / "nanogpt.log")
        jobs = [dataclasses.replace(nano_job, env=cold_caches(scratch / "nanogpt-cache"))]
        for seed in seeds:
            jobs.append(_gpuflow_job(config, seed, seed == seeds[0], child_device, scratch))
        finished = run_jobs(
            jobs, device_slots(bench.devices), scratch, env, "bench reference", err_console.print
        )
        step_tokens = batching.tokens_per_step
        nano = nanogpt_run(finished[0], step_tokens, plan.config.train.eval_interval)
        ours = [gpuflow_run(f, scratch / RUNS_DIR / _run_name(s), step_tokens, s)
                for f, s in zip(finished[1:], seeds, strict=True)]  # fmt: skip
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if ours[0]["mfu"] and ours[0]["tokens_per_s"] and nano["tokens_per_s"]:
        # The same model on the same kind of GPU: MFU in proportion to tokens/s.
        nano["mfu"] = ours[0]["mfu"] * nano["tokens_per_s"] / ours[0]["tokens_per_s"]
    return {
        "preset": config.preset,
        "steps": config.train.steps,
        "seeds": bench.seeds,
        "overrides": list(bench.overrides),
        "config": dataclasses.asdict(config),
        "batching": {
            "micro_batch": batching.micro_batch,
            "accumulation": batching.accumulation,
            "tokens_per_step": batching.tokens_per_step,
        },
        "data_dir": str(data_dir),
        "tokens": counts,
        "nanogpt": {
            "dir": str(nanogpt),
            "commit": checkout_commit(nanogpt),
            "settings": settings,
            "seed": NANOGPT_SEED,
        },
        "devices": list(bench.devices),
        "concurrent": len(bench.devices) >= len(jobs),
        "differences": list(DIFFERENCES),
        "runs": [nano, *ours],
        **compare(nano, ours),
    }


def _run_name(seed: int) -> str:
    return f"gpuflow-seed{seed}"


def _gpuflow_job(config: RunConfig, seed: int, first: bool, device: str, scratch: Path) -> Job:
    """``gpuflow train`` of ``config`` with ``seed``, from a config file in the scratch."""
    name = _run_name(seed)
    seeded = dataclasses.replace(config, train=dataclasses.replace(config.train, seed=seed))
    toml = scratch / f"{name}.toml"
    toml.write_text(to_toml(seeded), encoding="utf-8")
    command = [sys.executable, "-m", "gpuflow", "train", "--config", str(toml), "--name", name,
               "--device", device]  # fmt: skip
    label = "gpuflow" if first else f"gpuflow seed {seed}"
    return Job(label, command, scratch / f"{name}.log", cold_caches(scratch / f"{name}-cache"))


def cold_caches(folder: Path) -> dict[str, str]:
    """A child's own torch.compile and Triton caches: each compiles from cold, so that a run
    after another of the same shape (a second seed, a second bench) does not start sooner."""
    return {
        "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor"),
        "TRITON_CACHE_DIR": str(folder / "triton"),
    }
