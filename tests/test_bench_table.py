"""lab/bench_table.py: docs/benchmarks.md is what the result files give, and a bad or missing result is named."""

import json
import shutil

import pytest

from lab import bench_table
from lab.bench_table import STEP, ResultError, render


@pytest.fixture
def results(tmp_path, monkeypatch):
    """A copy of docs/results/ that a test may break; the page is rendered from it."""
    copy = tmp_path / "results"
    shutil.copytree(bench_table.RESULTS, copy)
    monkeypatch.setattr(bench_table, "RESULTS", copy)
    monkeypatch.setattr(bench_table, "committed", lambda name: "2026-01-01")  # the copy is not in git
    return copy


def edit(path, change):
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_the_committed_page_is_what_the_results_give():
    assert render() == bench_table.OUT.read_text(), "docs/benchmarks.md is stale: run python -m lab.bench_table"


def test_every_row_reads_a_result_that_the_runs_table_lists_once():
    text = render()
    files = {row.file for _, _, rows in bench_table.SECTIONS for row in rows}
    assert set(bench_table.COMMANDS) == files  # no command for a file no row reads
    for name in files:
        assert text.count(f"| `{name}` | `{bench_table.COMMANDS[name]}` |") == 1


def test_the_figures_and_verdicts_come_from_the_result(results):
    edit(results / STEP, lambda d: d["serving"].update(step_ms=101.23, step_ms_p90=102.2, reset_step_ms=103.0))
    text = render()
    assert "| rank step, median, back to back | <= 100 ms | 101.2 ms (p90 102.2) | no | `" + STEP in text
    assert "| position reset: reset step - step (the rotation alone) | <= 10 ms | +1.8 ms" in text
    assert "this tree +3.6% | no |" in text  # 101.23 against the tree before the move's 97.73
    edit(results / "app_bench_auto_cpu_mouth.json", lambda d: d["target"].update(median_s=4.0))
    assert ("| the same, 1.5B model, the engine on two threads in float32, before the CPU budget "
            "| (a one-GPU target) | 4.00 s") in render()


def test_a_missing_result_is_named(results):
    (results / STEP).unlink()
    with pytest.raises(ResultError, match=f"docs/results/{STEP}: missing"):
        render()
    with pytest.raises(SystemExit, match=f"bench_table: docs/results/{STEP}: missing"):
        bench_table.main()


def test_a_result_that_is_not_json_is_named(results):
    (results / "voice_bench_h200.json").write_text("{not json")
    with pytest.raises(ResultError, match="docs/results/voice_bench_h200.json: not JSON"):
        render()


def test_a_missing_figure_names_the_file_and_the_key(results):
    edit(results / STEP, lambda d: d["serving"].pop("cache_upkeep_ms"))
    with pytest.raises(ResultError, match=rf"docs/results/{STEP}\['serving'\]: no 'cache_upkeep_ms'"):
        render()
    edit(results / "turn_bench_cpu_asks.json", lambda d: d.update(modes=[]))
    edit(results / STEP, lambda d: d["serving"].update(cache_upkeep_ms=2.0))
    with pytest.raises(ResultError, match="turn_bench_cpu_asks.json: no mode 'smart_turn'"):
        render()


def test_a_newer_run_of_the_same_benchmark_than_the_one_named_is_an_error(results):
    newer = json.loads((results / STEP).read_text())
    newer["date"] = "2099-01-01"
    (results / "step_57b_tp3_h200_next.json").write_text(json.dumps(newer))
    with pytest.raises(ResultError, match=rf"step_57b_tp3_h200_next.json \(2099-01-01\) is newer than docs/results/{STEP}"):
        render()
    newer["tp_shard"] = 4  # another shard's run is another benchmark
    (results / "step_57b_tp3_h200_next.json").write_text(json.dumps(newer))
    render()


def test_a_result_without_a_date_of_its_own_takes_its_commit_date(results):
    rows = {line.split("`")[1]: line for line in render().splitlines() if line.startswith("| `")}
    assert rows["app_bench_auto_cpu_listen.json"].endswith("| CPU, 2 cores, load 1.97 | - | 2026-01-01 |")  # no date in it
    date = json.loads((results / STEP).read_text())["date"]
    assert rows[STEP].endswith(f"| NVIDIA H200 | torch 2.11.0+cu130, triton 3.6.0 | {date} |")
