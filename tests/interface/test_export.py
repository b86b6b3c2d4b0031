"""``gpuflow export --format hf``: transformers loads the folder as GPT-2 and computes what
gpuflow computes; where the two differ (the context length, ``<|endoftext|>`` in decoded
text) is as docs/cli.md says; the files are made as a checkpoint's are."""

from __future__ import annotations

import json
import os
import stat

import numpy as np
import pytest
import torch

from gpuflow.common.errors import GpuflowError
from gpuflow.data.tokenizer_file import eot_id, load_tokenizer
from gpuflow.device.accelerator import Device
from gpuflow.interface.cli.main import main
from gpuflow.interface.export import export_hf
from gpuflow.interface.sample import SampleConfig, open_trained, sample
from gpuflow.model.generate import generate_no_sync
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
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "link").symlink_to(empty)  # renaming the export into place would replace it
    assert main(["export", "--run", str(trained), "--out", str(tmp_path / "link")]) == 2
    assert f"link is a link to {empty}; pass --out" in capsys.readouterr().err
    assert (tmp_path / "link").is_symlink() and not any(empty.iterdir())
    here = tmp_path / "here"  # an empty current folder: no folder can be swapped in for it
    here.mkdir()
    os.chdir(here)
    try:
        assert main(["export", "--run", str(trained), "--out", "."]) == 2
    finally:
        os.chdir(tmp_path)
    assert ". is the current folder or holds it; choose another --out" in capsys.readouterr().err
    assert list(tmp_path.glob(".*tmp-*")) == [] and not any(here.iterdir())
    with pytest.raises(GpuflowError, match="has no checkpoint 'step_999999'"):
        export_hf(trained, tmp_path / "x", "step_999999")
    assert not (tmp_path / "x").exists()


def test_a_killed_exports_leftover_goes_and_a_users_folder_stays(trained, tmp_path):
    gone = 2**22 + 7  # past Linux's largest pid: no such process
    leftover = tmp_path / f".hf.tmp-{gone}"
    leftover.mkdir()
    (leftover / "config.json").write_text("{}")
    users = tmp_path / f".hf.tmp-{gone + 1}"
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    export_hf(trained, tmp_path / "hf")
    assert not leftover.exists()
    assert (users / "notes.txt").read_text() == "mine"


def test_the_exported_files_are_made_as_a_checkpoints_are(trained, tmp_path):
    old = os.umask(0o022)  # a user's usual umask, whatever this process runs under
    try:
        export_hf(trained, tmp_path / "hf")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "hf").iterdir()}
    assert set(modes.values()) == {0o644}, modes  # safetensors alone would make 0600
    weights = ckpt.best_checkpoint(trained) / "model.safetensors"
    assert stat.S_IMODE(weights.stat().st_mode) == 0o644


def test_decoded_text_differs_only_in_end_of_text_as_the_docs_say(trained, tmp_path):
    out = tmp_path / "hf"
    export_hf(trained, out)
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    ours = load_tokenizer(out / "tokenizer.json")
    ids = ours.encode("x = 1 ; y = ( 2 , 3 )<|endoftext|>import os").ids
    assert eot_id(ours) in ids
    assert theirs.decode(ids) == "x = 1 ; y = ( 2 , 3 )<|endoftext|>import os"  # kept
    assert ours.decode(ids) == "x = 1 ; y = ( 2 , 3 )import os"  # gpuflow's: dropped
    assert theirs.decode(ids, skip_special_tokens=True) == ours.decode(ids)
    assert theirs("import os")["input_ids"][0] != eot_id(ours)  # no <|endoftext|> put first


def test_generate_stops_at_the_context_length_where_sample_slides_on(trained, tmp_path):
    out = tmp_path / "hf"
    export_hf(trained, out)
    config = json.loads((out / "config.json").read_text())
    _, run_config = open_run(trained)
    assert config["n_positions"] == run_config.model.max_len == 32
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([[config["eos_token_id"]]])
    past = dict(max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad(), pytest.raises(IndexError):  # positions past n_positions
        hf.generate(ids, **past)
    _, _, _, model = open_trained(trained, "best", say=lambda note: None)
    assert generate_no_sync(model.eval(), ids, 40, 0.0, 0).shape == (1, 41)  # its window slides


def test_export_takes_the_hf_format_alone(trained, tmp_path, capsys):
    with pytest.raises(SystemExit) as refused:
        main(["export", "--run", str(trained), "--out", str(tmp_path / "x"), "--format", "onnx"])
    assert refused.value.code == 2 and "invalid choice: 'onnx'" in capsys.readouterr().err
    assert main(["export", "--run", str(trained), "--out", str(tmp_path / "y"), "--format=hf"]) == 0
    assert (tmp_path / "y" / "model.safetensors").is_file()


def test_a_full_disk_is_one_line_and_leaves_nothing(trained, tmp_path, capsys, monkeypatch):
    from safetensors import SafetensorError

    import gpuflow.interface.export as export_module

    def full(*args, **kwargs):  # what safetensors raises where the disk fills
        raise SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    monkeypatch.setattr(export_module, "save_file", full)
    out = tmp_path / "hf"
    assert main(["export", "--run", str(trained), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "No space left on device" in err, err
    assert [line for line in err.splitlines() if line.startswith("error:")], err
    assert sorted(p.name for p in tmp_path.iterdir()) == []
