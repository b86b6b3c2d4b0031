"""What `gpuflow sample` and `gpuflow export` check before they turn ids into text: the run's
tokenizer.json must be the one it was trained with; --seed, --max-tokens and --temperature
are refused in one line where torch or the time taken would fail them, and a temperature
too small to divide by samples as greedy does, never NaN."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from gpuflow.common.errors import GpuflowError
from gpuflow.data.prepare.pipeline import PrepareConfig, prepare
from gpuflow.interface.cli.main import main
from gpuflow.interface.sample import MAX_TOKENS, SampleConfig, _say_unknown_ids, open_trained
from gpuflow.model.generate import generate_no_sync, next_token
from tests.helpers import entry_hashes, one_error, two_checkpointed_steps

RUN = ["sample", "--run", "runs/r", "--device", "cpu"]
SAMPLE = [*RUN, "--max-tokens", "3"]
EXPORT = ["export", "--run", "runs/r", "--out", "hf"]
NOT_ITS_OWN = "runs/r/tokenizer.json is not the tokenizer runs/r was trained with"


@pytest.fixture(scope="module")
def trained(prepared, tmp_path_factory) -> Path:
    """runs/r: 2 steps, a checkpoint at each, a best one; its data is ``prepared``."""
    return two_checkpointed_steps(prepared, tmp_path_factory.mktemp("checked"))


@pytest.fixture(scope="module")
def tok300(tmp_path_factory) -> Path:
    """A 300-token tokenizer.json made by `gpuflow prepare`, not the run's."""
    root = tmp_path_factory.mktemp("tok300")
    text = root / "text.txt"
    text.write_text("".join(f"line {i}: the quick brown fox, {i * 7} jumps\n" for i in range(400)))
    prepare(PrepareConfig(data=(str(text),), out=str(root / "data"), vocab_size=300))
    return root / "data" / "tokenizer.json"


@pytest.fixture
def run(trained, workdir) -> Path:
    """A copy of ``trained`` in this test's folder: runs/r."""
    shutil.copytree(trained, workdir / "runs")
    return workdir / "runs" / "r"


def _point_data_at(run: Path, folder: Path) -> None:
    """The run's saved data.dir, moved to ``folder`` (as if its data had moved or changed)."""
    config = run / "config.toml"
    lines = config.read_text().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.startswith("dir = "))
    lines[at] = f'dir = "{folder}"\n'
    config.write_text("".join(lines))


def _larger_tokenizer(run: Path, size: int) -> None:
    """The run's tokenizer.json with tokens added, up to ``size``."""
    tokenizer = Tokenizer.from_file(str(run / "tokenizer.json"))
    more = size - tokenizer.get_vocab_size()
    tokenizer.add_tokens([f"added{i}" for i in range(more)])
    tokenizer.save(str(run / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == size


def _refused(argv: list[str], workdir: Path, capsys, *said: str) -> str:
    before = entry_hashes(workdir)
    assert main(argv) == 2
    line = one_error(capsys.readouterr().err, *said)
    assert entry_hashes(workdir) == before  # nothing written: no export folder either
    return line


def _sampled(argv: list[str], capsys) -> tuple[str, str]:
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return out, err


# ---- the run's own tokenizer ---------------------------------------------------------------


@pytest.mark.parametrize("argv", [SAMPLE, EXPORT], ids=["sample", "export"])
def test_a_tokenizer_other_than_its_datas_is_refused(run, workdir, capsys, tok300, argv):
    shutil.copy(tok300, run / "tokenizer.json")
    line = _refused(argv, workdir, capsys, NOT_ITS_OWN, "copy ")
    assert "tokenizer.json to runs/r/tokenizer.json" in line


@pytest.mark.parametrize("argv", [SAMPLE, EXPORT], ids=["sample", "export"])
def test_a_tokenizer_larger_than_the_model_is_refused_without_its_data(run, workdir, capsys, argv):
    _point_data_at(run, workdir / "gone")  # nothing to compare with: the size alone tells
    _larger_tokenizer(run, 600)
    said = "runs/r/tokenizer.json has 600 tokens, more than the model's 512"
    _refused(argv, workdir, capsys, said, "not the tokenizer runs/r was trained with")


def test_data_prepared_again_since_is_said_and_the_run_still_samples(run, workdir, capsys, tok300):
    (workdir / "other").mkdir()  # the data folder, now another tokenizer and no shards
    shutil.copy(tok300, workdir / "other" / "tokenizer.json")
    _point_data_at(run, workdir / "other")
    _, err = _sampled([*SAMPLE, "--prompt", "def"], capsys)
    assert "cannot check that runs/r/tokenizer.json is the tokenizer" in err


@pytest.mark.parametrize("argv", [SAMPLE, EXPORT], ids=["sample", "export"])
def test_a_replaced_tokenizer_is_refused_by_the_checkpoints_record_without_its_data(
    run, workdir, capsys, tok300, argv
):
    _point_data_at(run, workdir / "gone")  # nothing to compare with, and it fits the model
    shutil.copy(tok300, run / "tokenizer.json")
    said = "was trained with another tokenizer than runs/r/tokenizer.json"
    _refused(argv, workdir, capsys, said, "put back the run's own tokenizer.json")


@pytest.mark.parametrize("argv", [SAMPLE, EXPORT], ids=["sample", "export"])
def test_a_config_edited_to_another_model_of_the_same_weights_is_refused(
    run, workdir, capsys, argv
):
    # 4 heads of 16 instead of 2 of 32: every weight keeps its shape, the model computes
    # something else. The checkpoint's record of the shape it was trained as catches it.
    config = run / "config.toml"
    text = config.read_text()
    assert "n_head = 2\n" in text
    config.write_text(text.replace("n_head = 2\n", "n_head = 4\n"))
    said = "gives model n_head 4 (trained with 2), but checkpoint runs/r/checkpoints/"
    _refused(argv, workdir, capsys, said, "put the run's config.toml back as it was trained")


def test_resuming_with_a_config_edited_to_another_model_is_refused(run, workdir, capsys):
    config = run / "config.toml"
    config.write_text(config.read_text().replace("n_head = 2\n", "n_head = 4\n"))
    before = entry_hashes(workdir)
    assert main(["train", "--name", "r", "--resume", "--steps", "4", "--device", "cpu"]) == 2
    one_error(capsys.readouterr().err, "gives model n_head 4 (trained with 2)")
    assert entry_hashes(workdir) == before


def test_sample_without_a_run_takes_the_most_recently_active_one(run, workdir, capsys):
    _, err = _sampled(["sample", "--device", "cpu", "--max-tokens", "3"], capsys)
    assert "sampling runs/r, the run most recently active in runs/" in err


def test_sample_without_a_run_and_no_runs_says_so(workdir, capsys):
    assert main(["sample", "--device", "cpu"]) == 2
    one_error(capsys.readouterr().err, "there is no run in runs/")


def test_ids_the_tokenizer_lacks_are_said_not_dropped_silently():
    notes = []
    _say_unknown_ids([5, 301, 7, 400], 300, Path("runs/r"), notes.append)
    assert len(notes) == 1 and "2 of the 4 tokens drawn (id 301 first) are not in" in notes[0]
    _say_unknown_ids([5, 7], 300, Path("runs/r"), notes.append)
    assert len(notes) == 1  # none drawn: nothing said


def test_the_runs_own_tokenizer_samples_and_exports_with_nothing_said(run, workdir, capsys):
    _, err = _sampled(SAMPLE, capsys)
    assert err == ""
    assert main(EXPORT) == 0
    assert (workdir / "hf" / "tokenizer.json").read_bytes() == (run / "tokenizer.json").read_bytes()


# ---- --seed, --max-tokens ------------------------------------------------------------------


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 99999999999999999999999])
def test_a_seed_torch_cannot_take_is_one_line(run, workdir, capsys, seed):
    _refused([*SAMPLE, "--seed", str(seed)], workdir, capsys, "--seed must be from", str(seed))


@pytest.mark.parametrize("seed", [2**64 - 1, -(2**63)])
def test_the_extreme_seeds_torch_takes_sample(run, capsys, seed):
    _sampled([*SAMPLE, "--seed", str(seed)], capsys)


@pytest.mark.parametrize("tokens", [MAX_TOKENS + 1, 99999999999999999999, 0])
def test_max_tokens_past_the_bound_is_refused(tokens):
    with pytest.raises(GpuflowError, match=f"--max-tokens must be from 1 to {MAX_TOKENS:,}"):
        SampleConfig(max_tokens=tokens)
    assert SampleConfig(max_tokens=MAX_TOKENS).max_tokens == MAX_TOKENS


def test_max_tokens_past_the_bound_is_one_line_and_help_states_it(
    run, workdir, capsys, monkeypatch
):
    def never(*args: object) -> None:
        raise AssertionError("generation started")  # (it would run for minutes)

    monkeypatch.setattr("gpuflow.interface.sample.generate_no_sync", never)
    _refused([*SAMPLE, "--max-tokens", str(MAX_TOKENS + 1)], workdir, capsys, "--max-tokens")
    with pytest.raises(SystemExit):
        main(["sample", "--help"])
    assert f"at most {MAX_TOKENS:,}" in " ".join(capsys.readouterr().out.split())


# ---- temperature, and the tokens drawn -----------------------------------------------------


@pytest.mark.parametrize("temperature", ["1e-45", "5e-324", "1e-20"])
def test_a_tiny_temperature_samples_as_greedy(run, capsys, temperature):
    argv = [*RUN, "--max-tokens", "8", "--prompt", "def"]
    greedy, _ = _sampled([*argv, "--temperature", "0"], capsys)
    assert len(greedy.strip()) > len("def")  # it draws tokens, not end-of-text at once
    tiny, _ = _sampled([*argv, "--temperature", temperature], capsys)
    assert tiny == greedy


def _generate_by_concatenation(model, idx, max_tokens, temperature, top_k) -> torch.Tensor:
    """The sequence regrown every token, as before the output was made once: the reference
    the buffer must match, past the context length too."""
    for _ in range(max_tokens):
        logits = model.next_token_logits(idx[:, -model.config.max_len :])
        idx = torch.cat([idx, next_token(logits, temperature, top_k)], dim=1)
    return idx


@pytest.mark.parametrize(("temperature", "top_k"), [(0.0, 0), (0.8, 50), (1.0, 0)])
def test_generation_draws_what_it_drew_before_past_the_context(trained, temperature, top_k):
    _, config, _, model = open_trained(trained / "r", "best", say=lambda note: None)
    model.eval()
    max_len = config.model.max_len
    ids = torch.arange(max_len - 3).remainder(config.model.vocab_size)[None]  # (1, max_len - 3)
    with torch.no_grad():
        torch.manual_seed(3)
        expected = _generate_by_concatenation(model, ids, 8, temperature, top_k)  # slides on
    torch.manual_seed(3)
    assert torch.equal(generate_no_sync(model, ids, 8, temperature, top_k), expected)
