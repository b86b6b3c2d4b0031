"""``gpuflow export --format hf``: transformers loads the folder as GPT-2 and computes what
gpuflow computes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from gpuflow.common.errors import GpuflowError
from gpuflow.data.tokenizer import eot_id, load_tokenizer
from gpuflow.device.accelerator import Device
from gpuflow.interface.cli.main import main
from gpuflow.interface.export import export_hf
from gpuflow.interface.sample import SampleConfig, sample
from gpuflow.model.gpt import GPT
from gpuflow.train import checkpoint as ckpt
from gpuflow.train.config import resolve_config
from gpuflow.train.runfolder import open_run
from gpuflow.train.trainer import Trainer
from tests.helpers import FAST

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def trained(prepared, tmp_path_factory):
    """A short CPU run with a best checkpoint: runs/ex."""
    folder = tmp_path_factory.mktemp("export") / "runs" / "ex"
    sets = [*FAST, f"data.dir={prepared}", "train.steps=12", "train.eval_interval=6"]
    return Trainer(resolve_config("tiny", None, sets), folder, Device("cpu")).run().run_dir


def test_transformers_loads_the_export_and_its_logits_match(trained, tmp_path):
    out = tmp_path / "hf"
    assert export_hf(trained, out).name == ckpt.BEST  # the best checkpoint by default
    assert {p.name for p in out.iterdir()} == {
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    }  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "GPT2LMHeadModel"
    _, config = open_run(trained)
    ours = GPT(config.model)
    ckpt.load_weights(ckpt.best_checkpoint(trained), ours)
    ours.eval()
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, config.model.vocab_size, (2, 32)))
    with torch.no_grad():
        expected = torch.nn.functional.linear(ours.hidden(ids), ours.wte.weight)  # (B, T, V)
        got = hf(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = "def main():\n    return 1"
    assert tokenizer(text)["input_ids"] == load_tokenizer(out / "tokenizer.json").encode(text).ids


def test_greedy_generate_gives_gpuflow_samples_text(trained, tmp_path):
    out = tmp_path / "hf"
    export_hf(trained, out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = load_tokenizer(trained / "tokenizer.json")
    prompt, steps = "import os", 16
    config = SampleConfig(prompt=prompt, max_tokens=steps, temperature=0.0)
    ours = sample(trained, config, Device("cpu"), say=lambda note: None)
    eot = eot_id(tokenizer)
    ids = torch.tensor([[eot, *tokenizer.encode(prompt, add_special_tokens=False).ids]])
    with torch.no_grad():
        generated = hf.generate(
            ids, max_new_tokens=steps, do_sample=False, eos_token_id=eot, pad_token_id=eot
        )[0, ids.shape[1] :].tolist()
    if eot in generated:
        generated = generated[: generated.index(eot)]
    assert len(generated) >= 4  # text to compare, not an end-of-text at once
    assert tokenizer.decode(ids[0, 1:].tolist() + generated) == ours


def test_the_cli_exports_a_named_checkpoint_and_refuses_a_folder_in_use(trained, tmp_path, capsys):
    out = tmp_path / "latest"
    assert main(["export", "--run", str(trained), "--out", str(out), "--checkpoint", "latest"]) == 0
    assert "exported" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["activation_function"] == "gelu"
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "mine.txt").write_text("not gpuflow's")
    assert main(["export", "--run", str(trained), "--out", str(taken)]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert [p.name for p in taken.iterdir()] == ["mine.txt"]  # untouched
    with pytest.raises(GpuflowError, match="has no checkpoint 'step_999999'"):
        export_hf(trained, tmp_path / "x", "step_999999")
    assert not (tmp_path / "x").exists()
