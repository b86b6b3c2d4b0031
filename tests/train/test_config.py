"""Config resolution: presets, TOML files, --set, and the errors for bad values."""

from __future__ import annotations

import re
import tomllib

import pytest
import torch

from gpuflow.common.errors import GpuflowError
from gpuflow.model.gpt import GPT
from gpuflow.train.config import PRESETS, parse_set, resolve_config, to_toml
from tests.helpers import ROOT


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_its_model(name):
    config = resolve_config(name)
    assert config.preset == name
    with torch.device("meta"):  # shapes only: GPT-2 XL's weights would take 6 GB here
        GPT(config.model)
    assert config.model.d_model % config.model.n_head == 0


@pytest.mark.parametrize(
    ("name", "shape", "parameters"),
    [
        ("gpt2-350m", (24, 16, 1024), 354_000_000),
        ("gpt2-774m", (36, 20, 1280), 773_000_000),
        ("gpt2-1558m", (48, 25, 1600), 1_557_000_000),
    ],
)
def test_the_gpt2_presets_are_gpt2_shapes_with_its_half_million_token_steps(
    name, shape, parameters
):
    config = resolve_config(name)
    model = config.model
    assert (model.n_layer, model.n_head, model.d_model, model.max_len) == (*shape, 1024)
    with torch.device("meta"):
        count = GPT(model).parameter_count()
    assert abs(count - parameters) < 0.01 * parameters  # GPT-2's sizes, padded vocabulary
    assert config.train.batch_tokens == 524288 and config.train.batch_size == 0  # found to fit


def test_settings_that_only_agree_together_can_be_set_one_by_one(tmp_path):
    """The config is validated once, after the file and every --set: each of these orders
    passes through a shape that alone would be refused (1600/12, 768/25)."""
    xl = ["model.n_layer=48", "model.d_model=1600", "model.n_head=25"]
    for sets in (xl, xl[::-1]):
        config = resolve_config("gpt2-124m", None, sets)
        assert (config.model.d_model, config.model.n_head) == (1600, 25)
    path = tmp_path / "medium.toml"
    path.write_text('preset = "gpt2-124m"\n[model]\nd_model = 1024\n')
    assert resolve_config(None, str(path), ["model.n_head=16"]).model.n_head == 16
    with pytest.raises(GpuflowError, match=r"d_model \(1024\) must be divisible by model.n_head"):
        resolve_config(None, str(path))  # the final config is still checked


def test_the_seed_presets_match_the_seed_documents():
    d384 = resolve_config("seed-d384")
    assert (d384.model.d_model, d384.model.n_head, d384.model.n_layer) == (384, 6, 6)
    assert (d384.train.batch_size, d384.model.max_len, d384.model.vocab_size) == (32, 128, 16000)
    d512 = resolve_config("seed-d512")
    assert (d512.model.d_model, d512.train.batch_size, d512.model.max_len) == (512, 64, 512)
    d256 = resolve_config("seed-d256")
    assert (d256.model.d_model, d256.model.n_head) == (256, 8)
    gpt2 = resolve_config("gpt2-124m")
    assert (gpt2.model.n_layer, gpt2.model.n_head, gpt2.model.d_model) == (12, 12, 768)
    assert (gpt2.model.max_len, gpt2.model.vocab_size) == (1024, 50304)


def test_file_then_set_override_the_preset(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('preset = "seed-d256"\n[model]\nn_layer = 3\n[train]\nlr = 1\nsteps = 50\n')
    config = resolve_config(None, str(path), ["train.steps=70", "data.dir=data/my corpus"])
    assert config.preset == "seed-d256"
    assert config.model.n_layer == 3 and config.model.d_model == 256
    assert config.train.lr == 1.0 and isinstance(config.train.lr, float)
    assert config.train.steps == 70
    assert config.data.dir == "data/my corpus"


def test_written_config_reads_back_identically(tmp_path):
    config = resolve_config("tiny", None, ["train.lr=2.5e-4", 'data.dir="a \\"quoted\\" path"'])
    path = tmp_path / "config.toml"
    path.write_text(to_toml(config))
    assert tomllib.loads(path.read_text())["train"]["lr"] == 2.5e-4
    assert resolve_config(None, str(path)) == config


def test_parse_set_reads_toml_values_and_bare_words():
    assert parse_set("train.lr=3e-4") == {"train": {"lr": 3e-4}}
    assert parse_set("data.dir=data/x") == {"data": {"dir": "data/x"}}
    assert parse_set("train.steps = 10") == {"train": {"steps": 10}}


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["model.widht=3"], "unknown key model.widht; valid keys are vocab_size"),
        (["optim.lr=3"], "unknown section 'optim'"),
        (["model.n_head=5"], r"d_model \(128\) must be divisible by model.n_head \(5\)"),
        (["train.batch_size=-1"], "train.batch_size must be >= 0"),
        (["train.batch_size=0"], r"train.batch_size=0 \(the largest micro-batch that fits\) needs"),
        (["train.batch_tokens=1000"], r"batch_tokens \(1000\) must be a multiple of model.max_len"),
        (["model.d_model=-64"], "model.d_model must be a positive integer"),
        (["train.steps=1.5"], "train.steps must be an int"),
        (["train.lr=nan"], "train.lr must be a finite number"),
        (["train.beta2=1.0"], r"train.beta2 must be in \[0, 1\)"),
        (["lr=3"], "is not SECTION.KEY=VALUE"),
        (["train.steps=1e100"], "train.steps must be an int"),  # past a float's exact ints
        (["train.compile=yes"], "train.compile must be a bool"),
        (["train.learning_rate=1e-3"], "nanoGPT's learning_rate is train.lr here"),
        (["model.dropout=0.1"], "nanoGPT's dropout has no counterpart here: the model has no"),
        (["train.n_layer=3"], r"n_layer is a key of \[model\]: model.n_layer"),
        (["train.eval_batchs=3"], r"train.eval_batchs \(did you mean train.eval_batches\?\)"),
        # with $DATA unset this trained on the built-in corpus, saying nothing
        (["data.dir= "], r"--set data.dir= gives no value \(an unset shell variable\?\)"),
    ],
)
def test_bad_settings_name_the_key(sets, message):
    with pytest.raises(GpuflowError, match=message):
        resolve_config("tiny", None, sets)


def test_python_spellings_that_mean_one_thing_are_taken():
    config = resolve_config(
        "tiny", None, ["train.compile=True", "train.lr=.001", "train.steps=1e3"]
    )
    assert (config.train.compile, config.train.lr, config.train.steps) == (True, 0.001, 1000)
    assert resolve_config("tiny", None, ["train.compile=False"]).train.compile is False


def test_a_flat_file_is_told_which_section_a_key_belongs_to(tmp_path):
    flat = tmp_path / "flat.toml"
    flat.write_text("n_layer = 2\n")
    with pytest.raises(GpuflowError, match=r"n_layer is a key of \[model\]: put it under a"):
        resolve_config(None, str(flat))


def test_bad_files_are_refused(tmp_path):
    with pytest.raises(GpuflowError, match="does not exist"):
        resolve_config(None, str(tmp_path / "missing.toml"))
    broken = tmp_path / "broken.toml"
    broken.write_text("[model\n")
    with pytest.raises(GpuflowError, match="not valid TOML"):
        resolve_config(None, str(broken))
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[train]\nepochs = 3\n")
    with pytest.raises(GpuflowError, match=r"unknown key train\.epochs"):
        resolve_config(None, str(unknown))
    with pytest.raises(GpuflowError, match="unknown preset 'huge'"):
        resolve_config("huge")


def test_shipped_config_files_resolve():
    folder = ROOT / "configs"
    files = sorted(folder.glob("*.toml"))
    assert files
    for path in files:
        config = resolve_config(None, str(path))
        assert config.train.steps > 0


def test_data_placement_is_device_or_managed():
    assert resolve_config("tiny", None, ["data.placement=managed"]).data.placement == "managed"
    with pytest.raises(GpuflowError, match=r"data\.placement must be device or managed"):
        resolve_config("tiny", None, ["data.placement=host"])


def test_a_managed_corpus_off_cuda_is_refused_before_the_run_starts(prepared, workdir):
    from gpuflow.device.accelerator import Device
    from gpuflow.train.trainer import Trainer

    config = resolve_config("tiny", None, [f"data.dir={prepared}", "data.placement=managed"])
    trainer = Trainer(config, workdir / "runs" / "m", Device("cpu"))
    with pytest.raises(GpuflowError, match="managed memory, not cpu's"):
        trainer.build(resume=False)
    assert not (workdir / "runs" / "m").exists()


@pytest.mark.parametrize(
    "setting,said",
    [
        ("train.lr=1e308", "train.lr must be a finite number within fp32's range"),
        ("train.lr=nan", "train.lr must be a finite number"),
        ("train.weight_decay=inf", "train.weight_decay must be a finite number"),
        ("train.seed=18446744073709551616", "train.seed must be below 2**64"),
    ],
)
def test_absurd_numbers_are_one_line_errors(setting, said):
    with pytest.raises(GpuflowError, match=re.escape(said)):
        resolve_config("tiny", None, [setting])


def test_fp8_on_the_cpu_is_refused_before_training(workdir):
    from gpuflow.device.accelerator import Device
    from gpuflow.train.trainer import Trainer

    config = resolve_config("tiny", None, ["train.fp8=true", "train.steps=1"])
    with pytest.raises(GpuflowError, match=r"FP8 tensor cores.*train\.fp8=false"):
        Trainer(config, workdir / "runs" / "f", Device("cpu")).run()
    assert not (workdir / "runs" / "f" / "metrics.jsonl").exists()
    assert not (workdir / "data").exists()  # refused before the corpus was prepared
