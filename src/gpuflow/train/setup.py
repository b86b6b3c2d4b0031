"""What a run is built from, made once: ``build_setup`` chooses the data path, opens the
corpus and the validation set, builds the model, its compiled forward and its optimizer,
and restores the checkpoint when resuming; it returns a frozen ``RunSetup`` that the trainer,
the benches and ``profile`` share. Everything that can refuse a run does so here, before the
run's folder changes; what it writes is the built-in corpus's token folder, prepared into
``data/`` on first use (``open_training_data``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from gpuflow.common.console import err_console
from gpuflow.common.errors import GpuflowError
from gpuflow.common.procmem import available_bytes
from gpuflow.data.prepare.for_training import prepared_for_training
from gpuflow.data.resident.batches import check_validation_batch, validation_windows, window_starts
from gpuflow.data.resident.tokens import default_budget
from gpuflow.data.token_bytes import target_bytes, token_bytes
from gpuflow.data.tokens import TokenFolder
from gpuflow.device.accelerator import Device
from gpuflow.device.allocator import check_allocator
from gpuflow.model.fp8 import check_fp8, use_fp8_products
from gpuflow.model.gpt import GPT
from gpuflow.train import checkpoint as ckpt
from gpuflow.train.batching import Batching, device_fit, plan_batching, step_rows, validation_rows
from gpuflow.train.config import RunConfig
from gpuflow.train.datapath import BatchPlan, DataPath, resolve_data_path, row
from gpuflow.train.distributed import Averager, GradientAverager, Ranks, each_host_first, least
from gpuflow.train.meter import IntervalPart
from gpuflow.train.optim import StepOptimizer
from gpuflow.train.optim.adamw import CapturableAdamW, build_optimizer
from gpuflow.train.optim.master_adamw import MasterAdamW, with_fp32_masters
from gpuflow.train.resumed_data import (
    check_checkpoint_tokenizer,
    check_tokenizer,
    compare_with_checkpoints,
    validation_digest,
)
from gpuflow.train.schedule import finished_run
from gpuflow.train.sharded import ShardedAverager
from gpuflow.train.step import StepOptions, compiled_forward
from gpuflow.train.trackers import check_trackers
from gpuflow.transfer.diskread import IoChoice, choose_io
from gpuflow.transfer.loader import upload_tokens
from gpuflow.transfer.upload import place

# Passes over the training tokens past which a run is told it will mostly memorise them.
MANY_PASSES = 4


@dataclass(frozen=True)
class RunSetup:
    """A run's parts, built by ``build_setup``."""

    path: DataPath  # the data path that runs (resolved from train.data_path)
    path_note: str | None  # why it differs from the one asked for, if it does
    data: TokenFolder
    val_batches: list[torch.Tensor]  # (B, T+1) each, on the device; rank 0's alone
    plan: BatchPlan  # what the path's batch source draws from
    batching: Batching  # the step's micro-batches
    io: IoChoice | None  # how the resident corpus is read; None: no resident corpus
    model: GPT
    forward: torch.nn.Module  # the training step's forward: compiled, DDP-wrapped, or the model
    optimizer: StepOptimizer
    averager: Averager | None  # data-parallel: how the step averages over ranks
    start_step: int  # 0, or the restored checkpoint's step
    tokens_seen: int  # by the restored checkpoint: its steps may have run on other ranks
    best_val: float  # the best checkpoint's validation loss (inf: none yet)
    checkpoint: Path | None  # the checkpoint restored, if any
    # The logging interval the restored checkpoint came inside, for the record closing it
    interval: IntervalPart | None = None
    # UTF-8 bytes of the validation set's target tokens (rank 0's; None: not counted, and
    # ``val_bytes_note`` says why)
    val_bytes: int | None = None
    val_bytes_note: str | None = None
    # The validation set's digest (rank 0's), and the step after which the run's evaluations
    # used it (None: all of them), for the checkpoints to record (``train/resumed_data.py``)
    val_set: str | None = None
    val_since: int | None = None

    def bits_per_byte(self, val_loss: float) -> float | None:
        """``val_loss`` (the mean over the validation set's target tokens, in nats) as bits per
        UTF-8 byte of those targets: their summed loss over ln 2 times their bytes. None where
        the bytes were not counted. Host arithmetic on shapes alone: no device work."""
        if not self.val_bytes:
            return None
        targets = sum(b.shape[0] * (b.shape[1] - 1) for b in self.val_batches)  # rows x T
        return val_loss * targets / (math.log(2) * self.val_bytes)


def open_training_data(config: RunConfig) -> TokenFolder:
    """The run's token folder: ``data.dir``, or the built-in corpus, which this prepares (writes)
    on first use."""
    vocab_size = config.model.vocab_size
    folder = Path(config.data.dir) if config.data.dir else prepared_for_training(vocab_size)
    return TokenFolder.open(folder, vocab_size)


def _silent(message: str) -> None:
    """What ranks other than 0 say: nothing."""


def build_setup(
    config: RunConfig, run_dir: Path, device: Device, options: StepOptions, ranks: Ranks,
    resume: bool, say: Callable[[str], None] = err_console.print,
) -> RunSetup:  # fmt: skip
    """The run's parts, and its checkpoint restored if ``resume`` (from ``run_dir``)."""
    cfg = config
    if not ranks.is_main:
        say = _silent  # rank 0 speaks for the job
    path, path_note = resolve_data_path(cfg.train.data_path, device, cfg.train.allocator)
    path_row = row(path)  # a baseline the bench has not registered is refused here
    if ranks.is_main:
        check_trackers(cfg)  # rank 0 alone tracks
    if cfg.train.fp8:  # before the corpus is prepared: a refusal is immediate
        check_fp8(device.torch, cfg.model.d_model, cfg.model.max_len)
    # Data-parallel: the eager paths leave the gradients to DDP, the others average them in
    # the step (the captured one inside its graph).
    ddp = ranks.distributed and path_row.ddp
    averager: Averager | None = None
    if ranks.distributed:
        averager = GradientAverager(ranks.world_size, reduce_gradients=not ddp)
    with each_host_first(ranks):  # the built-in corpus is prepared once per host
        data = open_training_data(cfg)
    _check_sizes(cfg, data, ranks.world_size)  # before anything is allocated for them
    managed = cfg.data.placement == "managed"
    io = _resident_io(cfg, path, device, managed)
    if device.type == "cuda":
        check_allocator(cfg.train.allocator)  # chosen when torch loaded: refused if not
    device.configure_for_training()
    torch.manual_seed(cfg.train.seed)
    model = _model(cfg, device)
    # The training step's forward (and so its backward); evaluation stays eager.
    trained: torch.nn.Module = model
    if ddp:
        trained = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    forward = compiled_forward(trained, device, options) if cfg.train.compile else trained
    adamw = build_optimizer(model, cfg.train, device)
    checkpoint = None
    if resume:
        check_tokenizer(run_dir, data, say)
        checkpoint = ckpt.resumable_checkpoint(run_dir, say)
        if checkpoint is None:
            say(f"{run_dir} has no checkpoint yet: training it from step 0")
        else:
            check_checkpoint_tokenizer(run_dir, checkpoint.path, checkpoint.record.get("data"))
            ckpt.check_model_record(checkpoint.record, cfg.model, checkpoint.path)
            ckpt.apply_checkpoint(checkpoint, model, adamw)
    start_step = checkpoint.step if checkpoint is not None else 0
    if start_step >= cfg.train.steps:
        raise GpuflowError(finished_run(run_dir, start_step, cfg.train.steps, cfg.train))
    # Chosen once, for the data path: the step never swaps it. The captured step on several
    # ranks splits the update over them (train/sharded.py).
    split = ranks.distributed and not ddp and options.fused_clip
    shard = (ranks.rank, ranks.world_size) if split else (0, 1)
    optimizer = optimizer_for(path, adamw, device, options, shard)
    if isinstance(optimizer, MasterAdamW) and optimizer.world_size > 1:
        # peer memory between the GPUs of one host only; NCCL between hosts
        averager = ShardedAverager(optimizer, peer_memory=ranks.one_host)
    if optimizer is not adamw:  # its whole-size state (a resumed run's) goes before measuring
        del adamw
    budget = _device_budget(cfg, device, ranks)
    # Measured with the weights and the optimizer's state in place (before the RNG of a
    # resumed run is restored: the measuring draws from it).
    batching = _batching(cfg, model, device, ranks, path, data, budget)
    tokens_seen, best_val, resumed, interval = 0, math.inf, None, None
    if checkpoint is not None:
        state = ckpt.RunState.from_record(checkpoint.record, start_step * batching.tokens_per_step)
        state.restore_rng(device)
        best_val = ckpt.best_val_loss(run_dir, say)
        resumed, tokens_seen = state.data, state.tokens_seen
        if state.interval is not None and state.interval["through"] == start_step:
            interval = IntervalPart.from_record(state.interval)
    val_batches, val_bytes, bytes_note, val_set = _validation_set(cfg, data, device, ranks)
    val_since = None
    if resumed is not None and val_set is not None:  # rank 0, which evaluates
        comparable = compare_with_checkpoints(
            run_dir, resumed, start_step, best_val, val_set, data, say
        )
        best_val, val_since = comparable.best_val, comparable.since
    plan = BatchPlan(
        data, batching.rows, cfg.model.max_len, cfg.train.seed, cfg.model.vocab_size, budget,
        ranks.rank, ranks.world_size, resumed, managed=managed, io=io.path if io else "pinned",
    )  # fmt: skip
    _warn_about_repeats(cfg, batching.tokens_per_step, data, say)
    return RunSetup(
        path, path_note, data, val_batches, plan, batching, io, model, forward, optimizer,
        averager, start_step, tokens_seen, best_val,
        checkpoint.path if checkpoint is not None else None, interval, val_bytes, bytes_note,
        val_set, val_since,
    )  # fmt: skip


def _check_sizes(cfg: RunConfig, data: TokenFolder, world_size: int) -> None:
    """Refuse a step that cannot be shared out into whole sequences, one that reads more
    tokens than the train split holds, and a val split without a window: one line now,
    where building them would take memory without bound."""
    seq_len = cfg.model.max_len
    sequences = step_rows(cfg, world_size) * world_size
    step_tokens = sequences * seq_len
    check_validation_batch(data.val, 1, seq_len)  # no window at all: model.max_len is wrong
    # (a train split with no window is refused where its windows are drawn)
    if window_starts(data.train, seq_len) and step_tokens > data.train_tokens:
        raise GpuflowError(
            f"a step of {sequences:,} sequences of {seq_len} tokens ({step_tokens:,} tokens, "
            f"from train.batch_size or train.batch_tokens) is more than the train split of "
            f"{data.path} holds ({data.train_tokens:,} tokens); lower train.batch_size or "
            "train.batch_tokens, or prepare more text"
        )


def _validation_set(
    cfg: RunConfig, data: TokenFolder, device: Device, ranks: Ranks
) -> tuple[list[torch.Tensor], int | None, str | None, str | None]:
    """The validation set, read now (a split too short for one window is refused) and
    uploaded once, by the rank that evaluates (rank 0); it stays on the device. The other
    ranks read nothing but their slice of the train split. With it, the UTF-8 bytes of its
    targets (or None, and why not: ``_target_bytes``), and its digest."""
    if not ranks.is_main:
        return [], None, None, None
    data.check_vocab(cfg.model.vocab_size, splits=("val",))  # train: as it is read
    seq_len = cfg.model.max_len
    # A val split with fewer distinct windows than a batch gives them all, once each.
    rows = min(validation_rows(cfg), window_starts(data.val, seq_len))
    windows = validation_windows(data.val, rows, seq_len, cfg.train.eval_batches)
    counted, note = _target_bytes(data, windows, cfg.model.vocab_size)
    uploaded = [upload_tokens(w, device) for w in windows]
    return uploaded, counted, note, validation_digest(windows)


def _target_bytes(
    data: TokenFolder, windows: list[np.ndarray], vocab_size: int
) -> tuple[int | None, str | None]:
    """The UTF-8 bytes of the validation windows' targets, counted once on the host from the
    ids read for the upload (the windows are fixed: every evaluation takes the same ones);
    or None and why, where the folder's tokenizer cannot say what text an id stands for."""
    why = "val bits per byte not measured: "
    if data.tokenizer_path is None:
        return None, f"{why}{data.path} has no tokenizer.json to count the text of its tokens"
    lengths = token_bytes(data.tokenizer_path, vocab_size)
    if lengths is None:
        return None, f"{why}{data.tokenizer_path} is not a byte-level BPE"
    counted = target_bytes(windows, lengths)
    if counted == 0:  # only special tokens: no text to divide by
        return None, f"{why}the validation windows hold no text, only special tokens"
    return counted, None


def _batching(
    cfg: RunConfig, model: GPT, device: Device, ranks: Ranks, path: DataPath, data: TokenFolder,
    budget: int | None,
) -> Batching:  # fmt: skip
    """The run's micro-batches; an automatic micro-batch is measured on this device, beside
    what the run will also hold (its slice of a resident corpus, an fp32 gradient sum), and
    every rank takes the smallest any rank found."""
    fits = None
    if cfg.train.batch_size == 0:
        reserved = 0
        if row(path).resident:
            corpus = sum(s.n_tokens * s.dtype.itemsize for s in data.train) // ranks.world_size
            reserved += min(corpus, budget if budget is not None else default_budget(device))
        if any(p.dtype != torch.float32 for p in model.parameters()):
            reserved += 6 * model.parameter_count()  # fp32 sum, and its narrowed copy
        fits = device_fit(model, device, cfg.model.max_len, cfg.model.vocab_size, reserved)
    batching = plan_batching(cfg, ranks.world_size, fits)
    least_micro = least(batching.micro_batch, ranks)
    if least_micro != batching.micro_batch:
        batching = dataclasses.replace(
            batching,
            micro_batch=least_micro,
            accumulation=batching.rows // least_micro,
            found="the largest that fits every rank's device; set train.batch_size to choose",
        )
    return batching


def _device_budget(cfg: RunConfig, device: Device, ranks: Ranks) -> int | None:
    """The resident corpus's cap in bytes (None: its default)."""
    mb = cfg.data.device_budget_mb
    if mb > 0:
        return int(mb * 1e6)
    if ranks.distributed:
        # One budget for every rank (the least free memory), so that they all keep their
        # slice resident or all stream the corpus in the same chunks.
        return least(default_budget(device), ranks)
    return None


def _resident_io(cfg: RunConfig, path: DataPath, device: Device, managed: bool) -> IoChoice | None:
    """How the resident corpus is read from disk (kvikio or pinned), and why; None where the
    path has no resident corpus (where the settings about one are refused)."""
    if managed and device.type != "cuda":
        raise GpuflowError(f"data.placement=managed is CUDA's managed memory, not {device}'s")
    resident = row(path).resident
    for setting, asked in (("placement=managed", managed), ("io=kvikio", cfg.data.io == "kvikio")):
        if asked and not resident:
            raise GpuflowError(
                f"data.{setting} is about the resident corpus; train.data_path "
                f"{cfg.train.data_path!r} has none: use resident or resident-graph"
            )
    return choose_io(cfg.data.io, device, managed) if resident else None


def optimizer_for(
    path: DataPath, adamw: CapturableAdamW, device: Device, options: StepOptions,
    shard: tuple[int, int] = (0, 1),
) -> StepOptimizer:  # fmt: skip
    """The optimizer ``path``'s step runs: ``adamw`` (restored from a checkpoint, if any)
    handed to a MasterAdamW where the path trains bf16 weights and the kernel runs, updating
    part ``rank`` of ``shard=(rank, world_size)``; elsewhere ``adamw`` itself."""
    if row(path).master_weights and options.master_weights:
        return with_fp32_masters(adamw, device, shard)
    return adamw


# Host bytes a parameter takes while the model is built (fp32) and, on the host, trained:
# the weight, its gradient and AdamW's two moments.
BUILD_BYTES, HOST_TRAIN_BYTES = 4, 16


def _model(cfg: RunConfig, device: Device) -> GPT:
    _check_host_fits(cfg, device)
    try:
        model = place(GPT(cfg.model), device.torch)
        model.recompute_blocks = cfg.train.activation_checkpointing
        if cfg.train.fp8:
            use_fp8_products(model)
        return model
    except RuntimeError as exc:  # the host's allocator refusing (a device's is below)
        if "can't allocate memory" not in str(exc):
            raise
        m = cfg.model
        raise GpuflowError(
            f"the model does not fit in host memory (vocab {m.vocab_size:,} x d_model "
            f"{m.d_model} for its token table alone); lower model.vocab_size, "
            "model.d_model or model.n_layer"
        ) from None


def _check_host_fits(cfg: RunConfig, device: Device) -> None:
    """Refuse, before anything is allocated, a model the host cannot hold: the model is
    built on the host, and each layer's allocation may succeed on its own while the whole
    grows until the kernel kills the process without a word."""
    available = available_bytes()
    if available is None:
        return
    m = cfg.model
    params = (m.vocab_size + m.max_len) * m.d_model + m.n_layer * (
        12 * m.d_model**2 + 4 * m.d_model
    )
    per_param = BUILD_BYTES if device.type != "cpu" else HOST_TRAIN_BYTES
    needed = params * per_param
    if needed > available:
        what = "to build" if device.type != "cpu" else "for its weights, gradients and AdamW state"
        raise GpuflowError(
            f"the model ({params:,} parameters) needs about {needed / 2**30:,.1f} GiB of host "
            f"memory {what}, and this host has {available / 2**30:,.1f} GiB available; lower "
            "model.n_layer, model.d_model or model.vocab_size"
        )


def _warn_about_repeats(
    cfg: RunConfig, tokens_per_step: int, data: TokenFolder, say: Callable[[str], None]
) -> None:
    """Say so when the run will read its training tokens many times over: validation loss
    then rises as the model memorises them (the best checkpoint is kept apart)."""
    tc = cfg.train
    tokens = data.train_tokens
    passes = tc.steps * tokens_per_step / max(tokens, 1)
    if passes > MANY_PASSES:
        say(
            f"note: {tc.steps:,} steps of {tokens_per_step:,} tokens read the "
            f"{tokens:,} training tokens {passes:.0f} times over; validation loss "
            "usually rises after a few passes, so checkpoints/best keeps the best one. "
            "More text (gpuflow prepare --data ...) or fewer --steps avoids it"
        )
