"""`fastoptim train` end to end on the tiny GPT-2: its reports, a resumed run equal to an uninterrupted
one, the train/validation split, and its name checks."""
import dataclasses
import json
import random
import re

import pytest

from fastoptim import cli, measure
from fastoptim.train import data, loop

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

TINY = ["--model-size", "tiny", "--steps", "6", "--batch-size", "4", "--eval-every", "2"]
ONE_LR = ["--no-lr-sweep"]  # where the sweep is not what a test is about: a third of the runs
ROW_KEYS = {"optimizer", "lr", "final_val_loss", "step_reaching_reference", "optimizer_share", "ms_per_step",
            "state_bytes", "val_loss_by_lr", "class"}


def train(out, *args):
    cli.main(["train", *TINY, "--out", str(out), *args])
    return json.loads((out / "results.json").read_text())


def test_the_command_writes_the_table_curves_and_json_with_the_requested_rows(tmp_path, capsys):
    names = ["adan", "adamw", "adan-8bit"]
    results = train(tmp_path, "--optimizers", *names)  # each at the default sweep's lrs
    assert results["schema"] == 3 and results["settings"]["optimizers"] == names and results["reference"] == "adan"
    assert [row["optimizer"] for row in results["rows"]] == names
    assert len(results["runs"]) == 3 * len(names)
    for row in results["rows"]:
        assert set(row) == ROW_KEYS
        swept = [run for run in results["runs"] if run["optimizer"] == row["optimizer"]]
        assert [run["lr"] for run in swept] == [loop.RECIPES[row["optimizer"]].lr * f for f in loop.LR_SWEEP]
        assert row["final_val_loss"] == min(run["final_val_loss"] for run in swept)  # the best lr is reported
        assert 0 < row["optimizer_share"] < 1 and row["state_bytes"] > 0
    for run in results["runs"]:
        assert run["eval_steps"] == [0, 2, 4, 6] and len(run["val_loss"]) == 4 and len(run["train_loss"]) == 6
    text = (tmp_path / "results.md").read_text()
    assert text in capsys.readouterr().out
    for name in names:
        assert f"| {name} |" in text
    assert "step reaching adan's" in text and "final val loss by lr" in text
    assert "adan is fastoptim's Adan; adamw is torch's AdamW; adan-8bit is fastoptim's Adan, each with fused=True." \
        in text
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_one_lr_each_without_the_sweep_and_a_busy_machine_is_said_in_the_table_and_picture(tmp_path, monkeypatch):
    monkeypatch.setattr(measure, "BUSY_CORES", -1.0)  # any load counts as busy
    results = train(tmp_path, "--optimizers", "adamw", "lion", *ONE_LR)
    assert [(run["optimizer"], run["lr"]) for run in results["runs"]] == [("adamw", loop.RECIPES["adamw"].lr),
                                                                        ("lion", loop.RECIPES["lion"].lr)]
    assert results["load"]["busy"] and results["load"]["others_cores"] >= 0
    text = (tmp_path / "results.md").read_text()
    assert "WARNING: the machine was busy" in text and "final val loss by lr" not in text
    assert "/" not in text.splitlines()[0], "the title names the standard library, not its path on this machine"


def test_a_resumed_run_has_exactly_the_losses_of_an_uninterrupted_one(tmp_path):
    every = ["--optimizers", *loop.RECIPES, "--checkpoint-every", "4", *ONE_LR]
    uninterrupted = train(tmp_path / "whole", *every)
    cli.main(["train", *TINY, *every, "--out", str(tmp_path / "parts"), "--stop-after", "3"])
    assert not (tmp_path / "parts" / "results.json").exists()
    cli.main(["train", "--resume", str(tmp_path / "parts")])
    resumed = json.loads((tmp_path / "parts" / "results.json").read_text())
    for whole, parts in zip(uninterrupted["runs"], resumed["runs"], strict=True):
        assert whole["train_loss"] == parts["train_loss"] and whole["val_loss"] == parts["val_loss"]
        assert whole["state_bytes"] == parts["state_bytes"]


def test_the_split_is_by_file_deterministic_and_disjoint():
    paths = data.stdlib_files()
    train, validation = data.split(paths)
    assert sorted(train + validation) == paths and not set(train) & set(validation)
    assert 0.05 < len(validation) / len(paths) < 0.2
    shuffled = random.Random(0).sample(paths, len(paths))  # a file's split depends on its name only
    assert [sorted(part) for part in data.split(shuffled)] == [train, validation]
    # CRC-32 of the name, pinned: the same split on every machine, process and Python version
    assert [data.is_validation(name) for name in ("random.py", "shutil.py", "os.py", "ast.py")] == [True, True,
                                                                                                     False, False]


def test_unknown_optimizers_and_options_beside_resume_are_refused_with_the_valid_choices(tmp_path):
    with pytest.raises(SystemExit, match="unknown optimizer adam, sgd; valid: adamw, adan, adamwsn"):
        cli.main(["train", "--optimizers", "adamw", "adam", "sgd"])
    with pytest.raises(SystemExit, match="drop --steps"):
        cli.main(["train", "--resume", str(tmp_path), "--steps", "3"])
    with pytest.raises(SystemExit, match="no settings.json"):
        cli.main(["train", "--resume", str(tmp_path)])


BAD_SETTINGS = [("{", "settings.json cannot be read as JSON"), ('{"x": 1}', r"holds \['x'\], not a run's"),
                ("[1]", "holds list, not a run's"), (None, "no settings.json and checkpoints/"),
                *((json.dumps(loop.DEFAULTS | {key: value}), re.escape(f"does not take: {key} {value!r}"))
                  for key, value in [("model_size", "huge"), ("threads", 0), ("optimizers", "adamw"), ("steps", True),
                                     ("optimizers", ["adamw", "sgd"]), ("optimizers", ["lion", "lion"]),
                                     ("seed", -1), ("lr_sweep", 1)])]


@pytest.mark.parametrize("text, message", BAD_SETTINGS, ids=range(len(BAD_SETTINGS)))
def test_a_resume_of_a_folder_without_a_run_s_settings_is_one_clear_line(tmp_path, text, message):
    """A settings.json truncated, of another version or holding what the command line refuses ended in a
    traceback (JSONDecodeError, KeyError, set_num_threads' RuntimeError), and one without checkpoints/ trained
    every run anew, then failed to save (helper-98, helper-99). Every setting has its check."""
    assert loop.SETTINGS.keys() == loop.DEFAULTS.keys()
    (tmp_path / "settings.json").write_text(text or json.dumps(loop.DEFAULTS))
    if text is not None:
        (tmp_path / "checkpoints").mkdir()
    with pytest.raises(SystemExit, match=message):
        cli.main(["train", "--resume", str(tmp_path)])


@pytest.mark.parametrize("name", [name for name, recipe in loop.RECIPES.items() if recipe.release])
def test_a_released_run_is_the_same_run_without_release_and_a_recipe_cannot_both_release_and_clip(
        tmp_path, monkeypatch, name):
    """The recipes with gradient release step in backward (their grads are gone after it) and train
    exactly as the same recipe stepping after backward, unclipped as they are."""
    steps = []
    original = loop.Recipe.make

    def make(recipe, module, lr):  # what backward leaves for step(): nothing, with release
        optimizer = original(recipe, module, lr)
        optimizer.register_step_pre_hook(lambda opt, *_: steps.append(any(
            p.grad is not None for group in opt.param_groups for p in group["params"])))
        return optimizer
    monkeypatch.setattr(loop.Recipe, "make", make)
    released, recipe = train(tmp_path / "released", "--optimizers", name, *ONE_LR), loop.RECIPES[name]
    monkeypatch.setitem(loop.RECIPES, name, dataclasses.replace(recipe, release=False))
    stepped = train(tmp_path / "stepped", "--optimizers", name, *ONE_LR)
    assert steps == [False] * 6 + [True] * 6
    assert released["runs"][0]["train_loss"] == stepped["runs"][0]["train_loss"]
    assert released["runs"][0]["val_loss"] == stepped["runs"][0]["val_loss"]
    assert released["rows"][0]["optimizer_share"] is None and "| in backward |" in (tmp_path / "released" / "results.md").read_text()
    with pytest.raises(ValueError, match="cannot clip"):
        dataclasses.replace(recipe, clip=True)


def test_ctrl_c_stops_with_the_command_that_resumes_the_runs(tmp_path, monkeypatch):
    """An interrupted run says how to go on from its checkpoints (it printed a raw KeyboardInterrupt: helper-52)."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "train_run", interrupted)
    with pytest.raises(SystemExit, match=f"interrupted; .* fastoptim train --resume {tmp_path}"):
        cli.main(["train", *TINY, "--out", str(tmp_path)])
