"""Run configuration: presets, TOML files and ``--set`` overrides, validated into dataclasses.

Resolution order, later wins: the preset (``--preset``, else the file's ``preset``, else
``tiny``), the TOML file (``--config``), then each ``--set section.key=value``. Unknown keys
and impossible values are errors that name the key.

    preset = "seed-d384"      # a config file
    [model]
    d_model = 256
    [train]
    steps = 5000
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from gpuflow.common.errors import GpuflowError
from gpuflow.device.allocator import ALLOCATORS
from gpuflow.device.managed import PLACEMENTS
from gpuflow.model.gpt import ModelConfig
from gpuflow.train.config_hints import top_level_hint, unknown_key_hint
from gpuflow.train.datapath import DataPath
from gpuflow.transfer.diskread import IO_PATHS


@dataclass(frozen=True)
class TrainConfig:
    # Sequences in one forward and backward (a micro-batch) on each rank. 0: the largest that
    # fits the device and divides a step's sequences, found once at start-up (batch_tokens
    # must then be set).
    batch_size: int = 32
    # Tokens per optimizer step over the whole job. 0: batch_size x model.max_len x ranks, one
    # micro-batch a step. Otherwise each rank sums the gradients of batch_tokens /
    # (batch_size x model.max_len x ranks) micro-batches before the update (GPT-2's recipe:
    # 524288, about 0.5M tokens).
    batch_tokens: int = 0
    steps: int = 2000
    lr: float = 6e-4  # peak learning rate, reached after warmup
    # The cosine decays from lr (at step warmup_steps) to lr * min_lr_ratio at step
    # schedule_steps, one past a run's last: its last step trains just above that floor.
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    # Steps the schedule (warmup, then cosine) spans; later steps keep its final rate.
    # 0: ``steps``. Set it when resuming with more steps, to keep or stretch the schedule.
    decay_steps: int = 0
    weight_decay: float = 0.1  # on matrices (the token and position tables too); not on norms
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # max global grad norm; 0 turns clipping off
    log_interval: int = 10  # steps between progress updates and metrics.jsonl records
    eval_interval: int = 250  # steps between validation passes (and one at the end)
    eval_batches: int = 20
    checkpoint_interval: int = 1000  # steps between checkpoints (and one at the end)
    keep_checkpoints: int = 3
    seed: int = 1337
    # How batches reach the device: a DataPath (gpuflow.train.datapath); auto is
    # resident-graph on CUDA, else resident.
    data_path: str = "auto"
    # Compile the model's forward and backward with torch.compile where it can run (CUDA:
    # Triton kernels); elsewhere the model runs eagerly. Costs tens of seconds at start-up.
    compile: bool = True
    # Recompute each block's activations in the backward instead of keeping them: for a
    # micro-batch that does not fit otherwise, at the cost of one more forward a step.
    activation_checkpointing: bool = False
    # The blocks' matrix products in FP8 (per-tensor scales, e4m3 forward, e5m2 gradients) on
    # GPUs with FP8 tensor cores (gpuflow.model.fp8); the weights stay as they are.
    fp8: bool = False
    # The CUDA allocator (gpuflow.device.allocator): auto (what PYTORCH_CUDA_ALLOC_CONF
    # selects, else native), native, cudaMallocAsync or expandable.
    allocator: str = "auto"

    def __post_init__(self) -> None:
        _require(
            self,
            "train",
            positive=(
                "steps",
                "lr",
                "log_interval",
                "eval_interval",
                "eval_batches",
                "checkpoint_interval",
                "keep_checkpoints",
            ),
            non_negative=(
                "batch_size", "batch_tokens", "warmup_steps", "decay_steps", "weight_decay",
                "grad_clip", "seed",
            ),
        )  # fmt: skip
        if self.data_path not in tuple(DataPath):
            raise GpuflowError(
                f"train.data_path must be one of {', '.join(DataPath)}, got {self.data_path!r}"
            )
        if self.allocator not in ("auto", *ALLOCATORS):
            raise GpuflowError(
                f"train.allocator must be one of auto, {', '.join(ALLOCATORS)}, got "
                f"{self.allocator!r}"
            )
        if self.seed >= _SEED_LIMIT:
            raise GpuflowError(f"train.seed must be below 2**64, got {self.seed}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise GpuflowError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise GpuflowError(f"train.{name} must be in [0, 1), got {getattr(self, name)}")

    @property
    def schedule_steps(self) -> int:
        """The steps the learning-rate schedule spans."""
        return self.decay_steps or self.steps


@dataclass(frozen=True)
class DataConfig:
    dir: str = ""  # a prepared token folder; empty: the built-in corpus, prepared on first use
    # Device memory the resident corpus may use, in MB; past it, it streams in chunks.
    # 0: half the device's free memory.
    device_budget_mb: float = 0.0
    # Where the resident corpus lives on CUDA: device memory, or managed (unified) memory
    # advised read-mostly and prefetched to the device (gpuflow.device.managed).
    placement: str = "device"
    # How the resident corpus is read from its shards: kvikio (GPUDirect Storage, or its
    # POSIX fallback) straight into device memory, pinned host buffers, or auto: kvikio when
    # it can read here (gpuflow.transfer.diskread).
    io: str = "auto"

    def __post_init__(self) -> None:
        if self.device_budget_mb < 0:
            raise GpuflowError(
                f"data.device_budget_mb must be >= 0 (0: automatic), got {self.device_budget_mb}"
            )
        if self.placement not in PLACEMENTS:
            raise GpuflowError(f"data.placement must be device or managed, got {self.placement!r}")
        if self.io not in IO_PATHS:
            raise GpuflowError(f"data.io must be one of {', '.join(IO_PATHS)}, got {self.io!r}")

    def resolved_dir(self, vocab_size: int) -> Path:
        from gpuflow.data.prepare.pipeline import default_data_dir

        return Path(self.dir) if self.dir else default_data_dir(vocab_size)


@dataclass(frozen=True)
class LogConfig:
    # Where each metrics.jsonl record also goes (gpuflow.train.trackers): TensorBoard event
    # files in runs/<name>/tensorboard/, and a Weights & Biases run (WANDB_MODE=offline
    # keeps it on disk); each needs its extra: pip install 'gpuflow[tensorboard]'.
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "gpuflow"
    wandb_run: str = ""  # the W&B run's name; empty: the run folder's

    def __post_init__(self) -> None:
        if self.wandb and not self.wandb_project.strip():
            raise GpuflowError("log.wandb_project must name a W&B project, got an empty name")


@dataclass(frozen=True)
class RunConfig:
    preset: str = "tiny"
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        # (checked here, where model.max_len is known, so that the values named fit the model)
        tc, seq_len = self.train, self.model.max_len
        if tc.batch_size == 0 and tc.batch_tokens == 0:
            raise GpuflowError(
                "train.batch_size=0 (the largest micro-batch that fits) needs train.batch_tokens, "
                f"the tokens of a step, e.g. --set train.batch_tokens={16 * seq_len} (16 "
                f"sequences of model.max_len {seq_len}; GPT-2's recipe is 524288); or give a "
                "batch_size"
            )
        if tc.batch_tokens % seq_len:
            # The example is whole micro-batches too, which a step must also be (on one
            # process; ``step_rows`` says what several ranks need).
            unit = seq_len * (tc.batch_size or 1)
            raise GpuflowError(
                f"train.batch_tokens ({tc.batch_tokens}) must be a multiple of model.max_len "
                f"({seq_len}): whole sequences, e.g. "
                f"{max(1, round(tc.batch_tokens / unit)) * unit}"
            )


_FP32_MAX = 3.4028234663852886e38  # the step computes in fp32: a larger setting overflows
_SEED_LIMIT = 2**64  # torch's generators take seeds below this


def _require(
    obj: Any, section: str, positive: tuple[str, ...] = (), non_negative: tuple[str, ...] = ()
) -> None:
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, float) and not (math.isfinite(value) and abs(value) <= _FP32_MAX):
            raise GpuflowError(
                f"{section}.{f.name} must be a finite number within fp32's range, got {value}"
            )
    for name in positive:
        if not getattr(obj, name) > 0:
            raise GpuflowError(f"{section}.{name} must be > 0, got {getattr(obj, name)}")
    for name in non_negative:
        if not getattr(obj, name) >= 0:
            raise GpuflowError(f"{section}.{name} must be >= 0, got {getattr(obj, name)}")


GPT2_STEP_TOKENS = 524288  # GPT-2's batch: 512 sequences of 1024 tokens


def _gpt2_recipe(name: str, n_layer: int, n_head: int, d_model: int, lr: float) -> RunConfig:
    return RunConfig(
        preset=name,
        model=ModelConfig(
            vocab_size=50304, n_layer=n_layer, n_head=n_head, d_model=d_model, max_len=1024
        ),
        train=TrainConfig(
            batch_size=0, batch_tokens=GPT2_STEP_TOKENS, steps=2000, lr=lr, warmup_steps=700,
            log_interval=5, eval_interval=100, checkpoint_interval=250,
        ),
    )  # fmt: skip


PRESETS: dict[str, RunConfig] = {
    # A few minutes' worth of learning for 2 CPU cores.
    "tiny": RunConfig(
        preset="tiny",
        model=ModelConfig(vocab_size=4096, n_layer=4, n_head=4, d_model=128, max_len=128),
        train=TrainConfig(
            batch_size=16,
            steps=300,
            lr=3e-3,
            warmup_steps=30,
            log_interval=10,
            eval_interval=100,
            eval_batches=8,
            checkpoint_interval=100,
            compile=False,  # a quick demo: compiling would take longer than training
        ),
    ),
    # The seed's original configuration (d_model 512, batch 64, max_length 512).
    "seed-d512": RunConfig(
        preset="seed-d512",
        model=ModelConfig(vocab_size=16000, n_layer=6, n_head=8, d_model=512, max_len=512),
        train=TrainConfig(batch_size=64),
    ),
    # The seed's wiki_cache_optimized configuration.
    "seed-d384": RunConfig(
        preset="seed-d384",
        model=ModelConfig(vocab_size=16000, n_layer=6, n_head=6, d_model=384, max_len=128),
        train=TrainConfig(batch_size=32),
    ),
    # The seed's wiki_performance_tuned configuration (head_dim 32).
    "seed-d256": RunConfig(
        preset="seed-d256",
        model=ModelConfig(vocab_size=16000, n_layer=6, n_head=8, d_model=256, max_len=128),
        train=TrainConfig(batch_size=32),
    ),
    # GPT-2 small, vocab padded to a multiple of 64 as in nanoGPT.
    "gpt2-124m": RunConfig(
        preset="gpt2-124m",
        model=ModelConfig(vocab_size=50304, n_layer=12, n_head=12, d_model=768, max_len=1024),
        train=TrainConfig(batch_size=16, lr=6e-4, warmup_steps=200),
    ),
    # GPT-2 medium, large and XL, with GPT-2's recipe: about 0.5M tokens a step (524288, 512
    # sequences), reached by summing micro-batches found to fit the device; peak learning
    # rates from the GPT-3 paper's table of sizes (Brown et al. 2020, table 2.1), warmed up
    # over 700 steps (about its 375M tokens). 2000 steps: about 1B tokens.
    "gpt2-350m": _gpt2_recipe("gpt2-350m", n_layer=24, n_head=16, d_model=1024, lr=3e-4),
    "gpt2-774m": _gpt2_recipe("gpt2-774m", n_layer=36, n_head=20, d_model=1280, lr=2.5e-4),
    "gpt2-1558m": _gpt2_recipe("gpt2-1558m", n_layer=48, n_head=25, d_model=1600, lr=2e-4),
}


def preset(name: str) -> RunConfig:
    if not isinstance(name, str) or name not in PRESETS:  # (a list from a file is unhashable)
        raise GpuflowError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


# ---- building from mappings -----------------------------------------------------------------

_SECTIONS = {"model": ModelConfig, "train": TrainConfig, "data": DataConfig, "log": LogConfig}


def _coerce(value: Any, kind: type, key: str) -> Any:
    # What Python users write where TOML wants otherwise, taken where it can mean one thing
    # only: --set train.compile=False, train.lr=.001, train.steps=1e3.
    if kind is bool and isinstance(value, str) and value.lower() in ("true", "false"):
        value = value.lower() == "true"
    if kind is float and isinstance(value, str):
        with suppress(ValueError):
            value = float(value)
    if kind is int and isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is float and isinstance(value, float) and not math.isfinite(value):
        raise GpuflowError(f"{key} must be a finite number, got {value}")
    if type(value) is not kind:
        raise GpuflowError(
            f"{key} must be {'an' if kind is int else 'a'} {kind.__name__}, got {value!r}"
        )
    return value


def section_keys() -> dict[str, tuple[str, ...]]:
    """Each config section's keys, by section name."""
    return {name: tuple(f.name for f in fields(cls)) for name, cls in _SECTIONS.items()}


def checked_changes(overrides: dict[str, Any], origin: str) -> dict[str, dict[str, Any]]:
    """``{"section": {"key": value}}`` (a ``"preset"`` entry is skipped) with every section
    and key checked to exist and every value coerced to its key's type; values themselves are
    checked when the config is built from them (``apply_overrides``)."""
    sections: dict[str, dict[str, Any]] = {}
    for section_name, values in overrides.items():
        if section_name == "preset":
            continue
        section_cls = _SECTIONS.get(section_name)
        if section_cls is None:
            raise GpuflowError(
                f"{origin}: unknown section {section_name!r}; valid sections are "
                f"{', '.join(_SECTIONS)}{top_level_hint(section_name, section_keys())}"
            )
        if not isinstance(values, dict):
            raise GpuflowError(f"{origin}: {section_name} must be a table of keys")
        types = {f.name: f.type for f in fields(section_cls)}
        changes = sections.setdefault(section_name, {})
        for key, value in values.items():
            if key not in types:
                hint = unknown_key_hint(section_name, key, section_keys())
                raise GpuflowError(
                    f"{origin}: unknown key {section_name}.{key}{hint}; valid keys are "
                    f"{', '.join(types)}"
                )
            kind = {"int": int, "float": float, "str": str, "bool": bool}[str(types[key])]
            changes[key] = _coerce(value, kind, f"{section_name}.{key}")
    return sections


def apply_overrides(config: RunConfig, overrides: dict[str, Any], origin: str) -> RunConfig:
    """Return ``config`` with ``{"section": {"key": value}}`` (or ``{"preset": ...}``) applied,
    validated once with all of them in place (a pair of settings that only agree together,
    such as d_model and n_head, may change in one call)."""
    sections = {
        name: replace(getattr(config, name), **changes)
        for name, changes in checked_changes(overrides, origin).items()
    }
    return replace(config, **sections)


def parse_set(assignment: str) -> dict[str, Any]:
    """``"train.lr=3e-4"`` -> ``{"train": {"lr": 0.0003}}``; values are TOML, else a string."""
    key, sep, raw = assignment.partition("=")
    section, dot, name = key.strip().partition(".")
    if not sep or not dot or not section or not name:
        raise GpuflowError(
            f"--set {assignment!r} is not SECTION.KEY=VALUE, e.g. --set train.lr=3e-4"
        )
    if not raw.strip():  # `--set data.dir=$DATA` with DATA unset: not the default, silently
        raise GpuflowError(
            f"--set {key.strip()}= gives no value (an unset shell variable?); give one, or leave "
            "the --set out for the default"
        )
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()  # a bare word such as a path
    return {section: {name: value}}


def load_toml(path: Path | str) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise GpuflowError(f"config file {path} does not exist")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise GpuflowError(f"config file {path} is not valid TOML: {exc}") from None


def resolve_config(
    preset_name: str | None = None,
    config_file: str | None = None,
    sets: list[str] | tuple[str, ...] = (),
) -> RunConfig:
    """Preset, then file, then ``--set`` overrides; see the module docstring."""
    file_values = load_toml(config_file) if config_file else {}
    base_name = preset_name or file_values.get("preset") or "tiny"
    if not isinstance(base_name, str):
        raise GpuflowError(f"{config_file}: preset must be a string, got {base_name!r}")
    return apply_sets(preset(base_name), sets, (file_values, str(config_file)))


def apply_sets(
    config: RunConfig,
    sets: Sequence[str] = (),
    first: tuple[dict[str, Any], str] | None = None,
) -> RunConfig:
    """``config`` with ``first`` (overrides and where they come from: a file) and then each
    ``--set`` assignment applied. Every source is checked for unknown keys and types on its
    own, then the config is built once: values are validated together, after all are in place."""
    merged: dict[str, dict[str, Any]] = {}
    sources = [first] if first and first[0] else []
    sources += [(parse_set(assignment), f"--set {assignment}") for assignment in sets]
    for overrides, origin in sources:
        for section, changes in checked_changes(overrides, origin).items():
            merged.setdefault(section, {}).update(changes)
    return apply_overrides(config, merged, "the config")


# ---- writing --------------------------------------------------------------------------------


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    return repr(value)


def to_toml(config: RunConfig) -> str:
    lines = [f"preset = {_toml_value(config.preset)}"]
    for section in _SECTIONS:
        lines.append(f"\n[{section}]")
        for key, value in dataclasses.asdict(getattr(config, section)).items():
            lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def to_dict(config: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)
