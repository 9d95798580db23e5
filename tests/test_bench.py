"""`fastoptim bench` end to end on a tiny model, its name checks, its JSON schema, its handling of
missing peers, oversized models and Ctrl-C, its report of noise (spread, load, the busy warning),
the width of its tables, its rounds, and the memory method it relies on."""
import argparse
import importlib
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from fastoptim import cli, measure
from fastoptim.bench import memory, peers, run

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

TINY = ["--models", "gpt2-tiny", "--steps", "2", "--repeats", "2"]
TOP_KEYS = {"schema", "fastoptim", "torch", "machine", "date", "device", "dtype", "threads", "steps", "repeats", "baseline",
            "gradients", "spread_limit", "load_at_start", "busy", "interrupted", "models"}
MODEL_KEYS = {"model", "status", "message", "params", "tensors", "param_bytes", "grad_bytes", "optimizers",
              "probe_gbps", "probe_spread", "probe_range_gbps", "load"}
LOAD_KEYS = {"cpus", "load_before", "load_after", "others_cores", "busy"}
RESULT_KEYS = {"optimizer", "library", "status", "message", "ms_per_step", "min_ms", "max_ms", "spread", "noisy",
               "total_ms", "samples_ms", "first_step_ms", "state_bytes", "peak_extra_bytes", "peak_bytes",
               "traffic_bytes", "gbps", "of_probe", "time_vs_baseline", "peak_vs_baseline", "kept_bytes_per_param",
               "kept_vs_baseline"}


def bench(tmp_path, *args):
    cli.main(["bench", *TINY, "--out", str(tmp_path), *args])
    return json.loads((tmp_path / "results.json").read_text())


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    names = ["torch-adam-foreach", "adan-foreach", "adan-fused-multi", "adamwsn-fused-single"]
    return out, bench(out, "--optimizers", *names), names


def row(text, *cells):
    """Whether the padded markdown ``text`` has a row starting with ``cells``."""
    return any([cell.strip() for cell in line.split("|")[1:1 + len(cells)]] == list(cells)
               for line in text.splitlines())


def test_the_command_writes_the_table_json_and_plot_with_the_requested_rows(tiny_run, capsys):
    out, results, names = tiny_run
    (entry,) = results["models"]
    assert entry["model"] == "gpt2-tiny" and entry["status"] == "ok"
    assert [r["optimizer"] for r in entry["optimizers"]] == names
    for r in entry["optimizers"]:
        assert r["status"] == "ok", r
        assert len(r["samples_ms"]) == 2 and r["ms_per_step"] > 0
        assert r["total_ms"] == pytest.approx(2 * r["ms_per_step"])
        assert r["state_bytes"] > 0 and r["peak_extra_bytes"] is not None and r["gbps"] > 0
    assert entry["optimizers"][0]["time_vs_baseline"] == 1.0
    text = (out / "results.md").read_text()
    for name in names:
        assert row(text, name + (" *" if name.startswith("torch") else ""))
    assert row(text, "optimizer", "gpt2-tiny")  # the summary: optimizers as rows, models as columns
    assert "bytes per parameter kept between steps" in text and row(text, "FlashOptim (Databricks, 2026)")
    assert max(map(len, text.splitlines())) <= 120
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_figures_are_consistent(tiny_run):
    _, results, _ = tiny_run
    (entry,) = results["models"]
    params = entry["param_bytes"]
    states = {r["optimizer"]: r["state_bytes"] for r in entry["optimizers"]}
    assert states["adan-foreach"] == states["adan-fused-multi"] == pytest.approx(4 * params, rel=0.01)
    assert states["torch-adam-foreach"] == pytest.approx(2 * params, rel=0.01)
    assert states["adamwsn-fused-single"] < 1.5 * params  # exp_avg, and a reduced exp_avg_sq
    for r in entry["optimizers"]:
        assert r["peak_bytes"] == params + entry["grad_bytes"] + r["state_bytes"] + r["peak_extra_bytes"]
        assert r["kept_bytes_per_param"] == (params + entry["grad_bytes"] + r["state_bytes"]) / entry["params"]
    kept = {r["optimizer"]: r["kept_bytes_per_param"] for r in entry["optimizers"]}
    assert kept["torch-adam-foreach"] == pytest.approx(16, rel=0.01)  # fp32 params, grads and two states
    assert kept["adan-fused-multi"] == pytest.approx(24, rel=0.01)  # and Adan's four


def test_the_json_schema_is_stable(tiny_run):
    _, results, _ = tiny_run
    assert results["schema"] == 4 and set(results) == TOP_KEYS
    assert {"cpu", "cpus", "memory_bytes", "gpu", "system", "python"} <= set(results["machine"])
    assert set(results["load_at_start"]) == LOAD_KEYS
    for entry in results["models"]:
        assert set(entry) == MODEL_KEYS and set(entry["load"]) == LOAD_KEYS
        for r in entry["optimizers"]:
            assert set(r) == RESULT_KEYS


def test_each_figure_carries_its_spread_and_the_load_it_was_taken_under(tiny_run):
    _, results, _ = tiny_run
    (entry,) = results["models"]
    for r in entry["optimizers"]:
        low, middle, high = min(r["samples_ms"]), r["ms_per_step"], max(r["samples_ms"])
        assert (r["min_ms"], r["max_ms"]) == (low, high) and low <= middle <= high
        assert r["spread"] == pytest.approx((high - low) / middle)
        assert r["noisy"] == (r["spread"] > 0.10)
    load = entry["load"]
    assert load["cpus"] >= 1 and len(load["load_before"]) == len(load["load_after"]) == 3
    assert load["others_cores"] >= 0 and load["busy"] == (load["others_cores"] >= measure.BUSY_CORES)
    assert results["busy"] == (results["load_at_start"]["busy"] or load["busy"])


def test_compare_shows_two_runs_side_by_side(tiny_run, capsys):
    out, _, names = tiny_run
    cli.main(["bench", "--compare", str(out / "results.json"), str(out / "results.json")])
    text = capsys.readouterr().out
    for name in names:
        assert f"| gpt2-tiny | {name} |" in text
    assert "| 1.00 " in text


@pytest.mark.parametrize("args, message", [
    (["--models", "gpt2-huge"], "unknown model gpt2-huge; valid: gpt2-h6-l6-d768"),
    (["--models", "gpt2-tiny", "--optimizers", "adan-fastest"], "unknown optimizer adan-fastest; valid: adan-loop"),
    (["--models", "gpt2-tiny", "--optimizers", "adan-loop", "--baseline", "adam"], "unknown optimizer adam"),
])
def test_unknown_names_are_refused_with_the_valid_ones(args, message):
    with pytest.raises(SystemExit, match=message):
        cli.main(["bench", *args])


@pytest.mark.parametrize("command", [["--list"], ["--compare", "a.json", "b.json"]])
def test_list_and_compare_refuse_the_options_they_would_ignore(command):
    """``--list`` and ``--compare`` measure nothing: options beside them, which they ignored silently, are
    refused by name."""
    with pytest.raises(SystemExit, match=r"takes no other option: it measures nothing \(given: --models, --steps\)"):
        cli.main(["bench", *command, "--models", "gpt2-tiny", "--steps", "5"])
    with pytest.raises(SystemExit, match=r"--list takes no other option.*\(given: --compare\)"):
        cli.main(["bench", "--list", "--compare", "a.json", "b.json"])


def test_list_and_compare_do_not_check_the_default_output_folder(tmp_path, monkeypatch, capsys):
    """They write nothing: a file named as the default ``--out`` does not stop them (helper-63: it did, and
    ``--list --out x`` there said the default was a file, not that --out was given)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bench-out").write_text("")
    cli.main(["bench", "--list"])
    assert "models:" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"--list takes no other option: it measures nothing \(given: --out\)"):
        cli.main(["bench", "--list", "--out", "elsewhere"])


def test_list_prints_every_model_and_optimizer(capsys):
    cli.main(["bench", "--list"])
    text = capsys.readouterr().out
    for name in ("gpt2-h16-l24-d2048", "resnet101", "vit-l", "swin-l", "convnext-l", "adan-fused-multi",
                 "adamwsn-loop", "torch-adamw-fused", "timm-adan", "bnb-adamw8bit", "adan-foreach-compiled"):
        assert name in text


def test_a_missing_or_failing_peer_is_reported_not_dropped(tmp_path, monkeypatch):
    def missing(*_args, **_options):
        raise ImportError("No module named 'bitsandbytes'")

    def failing(*_args, **_options):
        raise RuntimeError("no CPU kernel")
    monkeypatch.setattr(peers, "bitsandbytes_adamw8bit", missing)
    monkeypatch.setattr(peers, "torchao_adamw8bit", failing)
    results = bench(tmp_path, "--optimizers", "adamw-fused-multi", "bnb-adamw8bit", "torchao-adamw8bit",
                    "--no-memory")
    rows = {r["optimizer"]: r for r in results["models"][0]["optimizers"]}
    assert rows["adamw-fused-multi"]["status"] == "ok"
    assert rows["bnb-adamw8bit"]["status"] == "missing" and "bitsandbytes" in rows["bnb-adamw8bit"]["message"]
    assert rows["torchao-adamw8bit"]["status"] == "failed" and "no CPU kernel" in rows["torchao-adamw8bit"]["message"]
    text = (tmp_path / "results.md").read_text()
    assert row(text, "bnb-adamw8bit *", "—") and "- bnb-adamw8bit: missing: No module named 'bitsandbytes'" in text
    assert 'pip install "fastoptim[peers-gpu]"' in text


def test_a_fused_row_whose_engine_fell_back_to_foreach_says_so(tmp_path, monkeypatch):
    """A fused engine that left tensors to foreach (no native build, a backend that cannot run the
    tensors) measured foreach's speed under the fused row's name, with nothing in the results to say so.
    Its row now carries the reason; rows that ran their kernels carry none."""
    from fastoptim.engines.backends import cpu as cpu_backend

    with monkeypatch.context() as patch:
        patch.setattr(cpu_backend, "AVAILABLE", False)  # as without a native build
        results = bench(tmp_path, "--optimizers", "adamw-fused-multi", "adamw-foreach", "--no-memory")
    rows = {r["optimizer"]: r for r in results["models"][0]["optimizers"]}
    assert rows["adamw-fused-multi"]["status"] == "ok"
    assert rows["adamw-fused-multi"]["message"] == ("its fused engine left tensors to foreach: the native library is "
                                                    "not built or not loaded (see `fastoptim info`)")
    assert rows["adamw-foreach"]["message"] is None
    assert "- adamw-fused-multi: ok: its fused engine left tensors to foreach" in (tmp_path / "results.md").read_text()
    rows = {r["optimizer"]: r for r in bench(tmp_path, "--optimizers", "adamw-fused-multi",
                                            "--no-memory")["models"][0]["optimizers"]}
    assert rows["adamw-fused-multi"]["message"] is None


def test_the_first_steps_other_warnings_are_shown_once_even_where_it_raises():
    """Noting a fused engine's fallback leaves a step's other warnings to the filters in force: a warning given
    before the step raised was lost, and one under the default filter was shown again (helper-107)."""
    def failing_step():
        warnings.warn("peer: this device is unsupported", UserWarning)
        raise RuntimeError("boom")

    def warning_step():
        warnings.warn("peer advice", UserWarning)

    def fused_step():
        warnings.warn(f"{run.FALLBACK_WARNING}no kernel for this; those tensors take the foreach engine")

    for fused in ([], ["failing", "warning", "fused"]):  # the rows whose first step notes a fallback, or none
        with warnings.catch_warnings(record=True) as shown:
            warnings.simplefilter("default")
            _, errors, _ = run.time_steps({"failing": failing_step}, 1, 2, fused=fused)
            _, _, fallbacks = run.time_steps({"warning": warning_step, "fused": fused_step}, 1, 3, fused=fused)
        assert errors == {"failing": "RuntimeError: boom"}
        assert fallbacks == ({"fused": "no kernel for this"} if fused else {})
        messages, fallback = [str(w.message) for w in shown], f"{run.FALLBACK_WARNING}no kernel for this; those " \
                                                                 "tensors take the foreach engine"
        assert messages[0] == "peer: this device is unsupported"
        if fused:  # a row that notes fallbacks sets filters, after which a warning shown once may show again
            assert "peer advice" in messages and set(messages[1:]) == {"peer advice", fallback}
        else:
            assert messages[1:] == ["peer advice", fallback]


def test_a_model_too_large_for_free_memory_is_skipped_before_it_is_built(tmp_path, monkeypatch):
    monkeypatch.setattr(run, "free_bytes", lambda device: 1 << 20)
    monkeypatch.setattr(run, "with_gradients", lambda *a, **k: pytest.fail("built a model that does not fit"))
    results = bench(tmp_path, "--optimizers", "adan-foreach")
    (entry,) = results["models"]
    assert entry["status"] == "skipped" and "GiB is free" in entry["message"]


def test_ctrl_c_writes_what_was_measured(tmp_path, monkeypatch):
    measure_model = run.measure_model

    def interrupted_on_the_second_model(entry, *args):
        if entry["model"] == "llama-60m":
            raise KeyboardInterrupt
        measure_model(entry, *args)
    monkeypatch.setattr(run, "measure_model", interrupted_on_the_second_model)
    with pytest.raises(SystemExit) as stop:
        cli.main(["bench", *TINY, "--models", "gpt2-tiny", "llama-60m", "--optimizers", "adan-fused-multi",
                  "--no-memory", "--out", str(tmp_path)])
    assert stop.value.code == 130
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["interrupted"]
    first, second = results["models"]
    assert first["status"] == "ok" and first["optimizers"][0]["ms_per_step"] > 0
    assert second["status"] == "interrupted"
    assert "Interrupted" in (tmp_path / "results.md").read_text()


def test_a_busy_machine_is_warned_of_at_the_top_and_bottom_and_memory_ticks_per_optimizer(tmp_path, monkeypatch,
                                                                                         capsys):
    monkeypatch.setattr(measure, "BUSY_CORES", -1.0)  # any load counts as busy
    ticks = []
    monkeypatch.setattr(run.Progress, "advance", lambda self, model, what, n=1: ticks.append((what, n)))
    names = ["adan-fused-multi", "adamw-fused-multi"]
    results = bench(tmp_path, "--optimizers", *names)
    assert results["busy"] and results["models"][0]["load"]["busy"]
    printed = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("WARNING: the machine was busy") for line in printed[:4])
    assert any(line.startswith("WARNING: the machine was busy") for line in printed[-5:])
    text = (tmp_path / "results.md").read_text()
    assert text.count("WARNING: the machine was busy") == 2
    assert [what for what, _ in ticks if what.startswith("memory")] == [f"memory of {name}" for name in names]
    assert sum(n for _, n in ticks) == 1 + (2 + 1) * len(names)  # build, 2 repeats and the memory of each


def test_rounds_hold_one_family_when_the_budget_allows_no_more(tmp_path, monkeypatch):
    monkeypatch.setattr(run, "ROUND_STATE_BYTES", 0)
    rounds = []
    next_round = run.next_round

    def recorded(*args):
        table, sizes = next_round(*args)
        rounds.append(sorted(table))
        return table, sizes
    monkeypatch.setattr(run, "next_round", recorded)
    results = bench(tmp_path, "--optimizers", "adan-foreach", "adan-fused-multi", "adamw-foreach", "--no-memory")
    assert rounds == [["adan-foreach", "adan-fused-multi"], ["adamw-foreach"]]  # a family shares its instance
    assert all(r["status"] == "ok" and r["ms_per_step"] > 0 for r in results["models"][0]["optimizers"])


def test_torchs_engines_of_one_algorithm_are_instances_of_their_own():
    """Found on an H100: shared, torch's foreach Adam kept its step counts on the CPU, where its
    fused one refuses them for CUDA params, so every torch-*-fused row of --device cuda failed."""
    table = run.optimizers()
    for name in ("torch-adam", "torch-adamw"):
        assert table[f"{name}-foreach"].family != table[f"{name}-fused"].family
        params = [torch.nn.Parameter(torch.randn(3))]
        assert table[f"{name}-fused"].make(params, None).param_groups[0]["fused"]


def test_import_noise_is_kept_off_the_output(capfd):
    from fastoptim.extras import output_discarded
    with output_discarded():
        os.write(1, b"from C\n")
        os.write(2, b"from C\n")
        print("from Python", file=sys.stderr)
        warnings.warn("deprecated")
    print("after")
    assert capfd.readouterr() == ("after\n", "")


def test_the_peers_import_quietly():
    pytest.importorskip("torchao")
    code = "from fastoptim.extras import quiet_import; quiet_import('transformers'); quiet_import('torchao.optim')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout == out.stderr == ""


# --- the memory method ------------------------------------------------------------------------------

class Allocating(torch.optim.Optimizer):
    """A deliberately wasteful SGD: ``p.grad * lr`` makes a param-sized temporary every step."""

    def __init__(self, params):
        super().__init__(params, dict(lr=1e-3))

    @torch.no_grad()
    def step(self):
        for p in self.param_groups[0]["params"]:
            p.sub_(p.grad * 1e-3)


class InPlace(Allocating):
    @torch.no_grad()
    def step(self):
        for p in self.param_groups[0]["params"]:
            p.add_(p.grad, alpha=-1e-3)


def peaks_of_toys(numel):
    """In a measuring subprocess: the peak extra bytes of a step of each toy optimizer."""
    param = torch.nn.Parameter(torch.zeros(numel))
    param.grad = torch.ones(numel)
    return {cls.__name__: memory.measure_step(cls([param]).step) for cls in (Allocating, InPlace)}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")
def test_the_memory_method_tells_an_allocating_step_from_an_in_place_one():
    numel = 1 << 22  # 16 MiB of fp32
    peaks = memory.in_subprocess("tests.test_bench:peaks_of_toys", numel)
    assert peaks["Allocating"] >= 0.9 * 4 * numel  # the kernel's RSS counters lag by a few pages
    assert peaks["InPlace"] < 4 * numel // 16


def test_the_dispatch_benchmarks_python_time_runs_no_kernel():
    """benchmarks/dispatch.py times the eager step's Python with the native call replaced: the
    replaced function must be the one a step calls (a step then changes nothing)."""
    from benchmarks.dispatch import python_seconds
    import fastoptim
    param = torch.nn.Parameter(torch.ones(64))
    param.grad = torch.ones(64)
    optimizer = fastoptim.Adan([param], lr=0.1, fused=True)
    optimizer.step()
    before = param.detach().clone()
    assert python_seconds(optimizer, 3) > 0
    assert torch.equal(param, before)
    optimizer.step()
    assert not torch.equal(param, before)


def test_the_eight_bit_speed_benchmarks_walk_steps_adamw(tmp_path):
    """benchmarks/eight_bit_speed.py times a prototype walk: its companded codec must decode what the
    reference does, and on each state format its first step must move the params as fastoptim's
    AdamW does (the states start at zero, so the formats' error is not in it yet) and store the
    states (a walk that skipped its work would time nothing)."""
    import fastoptim
    from benchmarks import eight_bit_speed as speed
    codecs, numel = speed.library_codecs(), 4096
    for group in speed.GROUPS:
        prototype = speed.build(tmp_path, group)
        speed.check_codec(prototype)
        for format_name in speed.FORMATS:
            run = speed.prototype_step(prototype, numel, format_name, codecs)
            param, grad, states = run.held
            reference = torch.nn.Parameter(param.clone())
            reference.grad = grad.clone()
            s = speed.STEP_SCALARS
            fastoptim.AdamW([reference], lr=s["lr"], betas=(s["beta1"], s["beta2"]), eps=s["eps"],
                            weight_decay=s["weight_decay"], foreach=False, fused=False).step()
            before = [state.clone() for state in states if state is not None]
            run(2)
            torch.testing.assert_close(param, reference.detach(), rtol=1e-6, atol=1e-7)
            after = [state for state in states if state is not None]
            assert all((new != old).sum() > new.numel() // 2 for new, old in zip(after, before))


def numeric_options(command):
    """The options of ``fastoptim COMMAND`` that take a number, with the lowest value each allows."""
    parser = argparse.ArgumentParser()
    importlib.import_module(f"fastoptim.{command}.command").add_arguments(parser)
    options = [action for action in parser._actions if action.type is not None and action.choices is None
               and action.type not in (measure.named, measure.output_folder)]  # the names and folders
    assert all(action.type is not str and action.type is not int for action in options), \
        "a numeric option without a lower bound"
    lowest = {"--seed": 0}
    return [(action.option_strings[-1], lowest.get(action.option_strings[-1], 1)) for action in options]


@pytest.mark.parametrize("command", ["bench", "train"])
def test_every_numeric_option_refuses_a_value_below_its_bound(command, capsys):
    options = numeric_options(command)
    assert {"bench": {"--steps", "--repeats", "--threads"},
            "train": {"--steps", "--batch-size", "--eval-every", "--checkpoint-every", "--seed", "--threads",
                      "--stop-after"}}[command] == {name for name, _ in options}
    for name, lowest in options:
        for bad in (str(lowest - 1), "-5", "1.5", "x"):
            with pytest.raises(SystemExit) as stop:
                cli.main([command, name, bad])
            assert stop.value.code == 2, (name, bad)
            error = capsys.readouterr().err
            assert name in error and (f"must be at least {lowest}" in error or "invalid int value" in error), error


@pytest.mark.parametrize("command, option, value, message", [
    ("train", "--resume", "", "must not be empty"), ("train", "--out", "", "must not be empty"),
    ("bench", "--baseline", "", "must not be empty"), ("bench", "--out", "", "must not be empty"),
    ("bench", "--out", "a file", "is a file, not a folder"), ("train", "--out", "a file", "is a file, not a folder")])
def test_an_empty_name_or_an_output_folder_that_is_a_file_is_refused_before_anything_runs(
        command, option, value, message, tmp_path, capsys):
    """An empty shell variable in ``--resume "$DIR"`` started a new default run over the last one's checkpoints;
    an ``--out`` that is a file lost a whole benchmark's measurements at its end (helper-52)."""
    if value == "a file":
        value = str(tmp_path / "results")
        (tmp_path / "results").write_text("")
    with pytest.raises(SystemExit) as stop:
        cli.main([command, option, value, *(["--list"] if command == "bench" else [])])
    error = capsys.readouterr().err
    assert stop.value.code == 2 and f"argument {option}: " in error and message in error, error


def test_an_output_folder_that_cannot_be_made_stops_the_bench_before_it_measures(capsys):
    """One the argument's check lets through as root (its nearest folder is writable to root, but it cannot be
    made there); refused by the argument's check where /proc is not writable."""
    with pytest.raises(SystemExit) as stop:
        cli.main(["bench", *TINY, "--models", "gpt2-tiny", "--optimizers", "adan-loop", "--out",
                  "/proc/fastoptim-test/results"])
    assert str(stop.value).startswith("--out /proc/fastoptim-test/results: ") or stop.value.code == 2
    assert "ms/step" not in capsys.readouterr().out


@pytest.mark.parametrize("content, message", [(None, "No such file"), ("not json", "Expecting value"),
                                              ('{"schema": 3, "runs": []}', "not the results.json of a fastoptim bench")])
def test_compare_refuses_what_is_no_bench_result_in_one_line(content, message, tmp_path):
    path = tmp_path / "results.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit, match=f"--compare {path}: {message}"):
        cli.main(["bench", "--compare", str(path), str(path)])


@pytest.mark.parametrize("command, args", [
    ("bench", ["--models", "gpt2-tiny", "--optimizers", "adan-loop", "adan-loop"]),
    ("bench", ["--models", "gpt2-tiny", "gpt2-tiny", "--optimizers", "adan-loop"]),
    ("train", ["--optimizers", "adan", "adan"])])
def test_a_name_given_twice_is_refused_before_anything_runs(command, args):
    """A name given twice was run twice under one name: one row, one checkpoint file (helper-52)."""
    with pytest.raises(SystemExit, match="named more than once: "):
        cli.main([command, *args])
