"""side_by_side's floor model (W4 counts only what a perfect prefix cache would leave to compute)
and its reports."""
from __future__ import annotations

from pathlib import Path

import pytest

import side_by_side
from conversations import ConversationsSpec, turn_lengths


def test_w4_sizes_compute_each_token_once():
    spec = ConversationsSpec()
    sizes = side_by_side.request_sizes("W4")
    lengths = [turn for row in turn_lengths(spec, 2) for turn in row]
    assert len(sizes) == len(lengths) == 512
    assert [(c + p, o) for c, p, o in sizes] == lengths
    # Computed: the system prompt once, every turn's new tokens, and the last output token of
    # each turn that another follows (sampled, never fed back).
    computed = sum(p for _, p, _ in sizes)
    rows = turn_lengths(spec, 2)
    new_tokens = sum(row[0][0] - spec.system_tokens for row in rows) + sum(
        p - prev_p - prev_o for row in rows for (prev_p, prev_o), (p, _) in zip(row, row[1:]))
    assert computed == spec.system_tokens + new_tokens + 64 * 7


def test_w1_to_w3_share_nothing():
    assert all(c == 0 for c, _, _ in side_by_side.request_sizes("W1"))
    llama = side_by_side.model_shape("llama3-8b")
    assert side_by_side.floor_seconds("W4", 790e12, 4.2e12, llama) > 0


def test_every_run_rewrites_the_summary_and_a_cut_off_call_keeps_what_finished(
        tmp_path, monkeypatch):
    """Stand-in runs (each writes the JSON its real command would): after every run the two
    top-level files hold everything so far; vLLM's W2 never finishing leaves it n/a, not the
    rest lost; every run's own files sit under runs/."""
    import json
    import sys

    seen = []

    def fake_run(cmd, log, env=None, timeout=None):
        flag = "--out" if "--out" in cmd else "--json"
        out = Path(cmd[cmd.index(flag) + 1])
        log.write_text("ok\n")
        if "bench_kernels.py" in cmd[1]:
            out.write_text(json.dumps({"copy_bw_GBps": 4000.0,
                                       "matmul": {"peak_tflops": 760.0, "8192": {}}}))
        elif "bench_serving.py" in cmd[1]:
            w = cmd[cmd.index("--workload") + 1]
            out.write_text(json.dumps({"serving": {
                "output_tok_s": {"W1": 8100.0, "W2": 9800.0}[w], "complete": 1, "requests": 1,
                "ttft_p50_s": 2.0, "itl_p50_ms": 11.0}}))
        else:  # vLLM's offline bench: W1 only, as if cut off before W2 finished
            out.write_text(json.dumps({"vllm": "0.26.0", "gpu": "H200", "workloads": {
                "W1": {"output_tok_s": 8000.0, "full_outputs": 1, "requests": 1}}}))
        seen.append((Path(cmd[1]).name, json.loads((tmp_path / "o" / "summary.json").read_text())
                     if (tmp_path / "o" / "summary.json").exists() else None))
        return 0

    monkeypatch.setattr(side_by_side, "run", fake_run)
    monkeypatch.setattr(sys, "argv", ["side_by_side.py", "--workloads", "W1,W2", "--out-dir",
                                      str(tmp_path / "o"), "--vllm-dir", str(tmp_path)])
    side_by_side.main()
    top = sorted(p.name for p in (tmp_path / "o").iterdir())
    assert top == ["runs", "summary.json", "table.md"]
    assert {p.name for p in (tmp_path / "o" / "runs").iterdir()} >= {
        "ceilings.json", "pagedserve_W1.json", "pagedserve_W2.json", "vllm.json"}
    # The ceilings ran first; before vLLM's run the summary already had both of ours.
    assert [name for name, _ in seen] == ["bench_kernels.py", "bench_serving.py",
                                          "bench_serving.py", "vllm_preset.py"]
    before_vllm = seen[3][1]
    assert before_vllm["pagedserve"]["W2"]["output_tok_s"] == 9800.0 and before_vllm["vllm"] == {}
    final = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert final["vllm"]["W1"]["output_tok_s"] == 8000.0
    assert final["ceilings"]["copy_GBps"] == 4000.0
    table = (tmp_path / "o" / "table.md").read_text()
    assert "| W1 | 8,100 | 8,000 | 1.01x |" in table
    assert "| W2 | 9,800 | n/a | n/a |" in table


def test_merge_joins_the_summaries_of_two_calls(tmp_path, monkeypatch, capsys):
    """One call's pagedserve figures and the next call's vLLM ones make one table; the first
    file wins where both have a figure."""
    import json
    import sys

    first = {"ceilings": {"matmul_tflops": 760.0, "copy_GBps": 4000.0}, "vllm_version": None,
             "gpu": None, "prefix_ttft": None, "vllm": {},
             "pagedserve": {"W1": {"output_tok_s": 8100.0, "complete": 256, "requests": 256,
                                   "ttft_p50_s": 2.0, "itl_p50_ms": 11.0}}}
    second = {"ceilings": {"matmul_tflops": 1.0, "copy_GBps": 1.0}, "vllm_version": "0.26.0",
              "gpu": "H200", "prefix_ttft": None, "pagedserve": {},
              "vllm": {"W1": {"output_tok_s": 7900.0, "full_outputs": 256, "requests": 256}}}
    paths = []
    for i, s in enumerate((first, second)):
        paths.append(tmp_path / f"s{i}.json")
        paths[-1].write_text(json.dumps(s))
    monkeypatch.setattr(side_by_side, "run", lambda *a, **k: pytest.fail("ran something"))
    monkeypatch.setattr(sys, "argv", ["side_by_side.py", "--workloads", "W1", "--out-dir",
                                      str(tmp_path / "m"), "--merge", *map(str, paths)])
    side_by_side.main()
    table = (tmp_path / "m" / "table.md").read_text()
    assert "| W1 | 8,100 | 7,900 | 1.03x |" in table and "256/256, 256/256" in table
    assert "matmul 760 TFLOP/s" in table and "vLLM 0.26.0" in table


def test_repeat_quotes_each_sides_median_run_and_lists_every_run(tmp_path, monkeypatch):
    """--repeat 3: W1 runs three times on each side after W2 (ours on fresh services, vLLM in
    one engine: W1,W2,W1,W1, its JSON keeping only the last W1); the table's row is each side's
    median run, the runs are listed in order, the summary carries them."""
    import json
    import sys

    ours_rates = iter([8300.0, 8500.0, 8400.0])
    calls = []

    def fake_run(cmd, log, env=None, timeout=None):
        flag = "--out" if "--out" in cmd else "--json"
        out = Path(cmd[cmd.index(flag) + 1])
        calls.append((Path(cmd[1]).name, out.name))
        if "bench_kernels.py" in cmd[1]:
            log.write_text("ok\n")
            out.write_text(json.dumps({"copy_bw_GBps": 4000.0,
                                       "matmul": {"peak_tflops": 760.0, "8192": {}}}))
        elif "bench_serving.py" in cmd[1]:
            log.write_text("ok\n")
            w = cmd[cmd.index("--workload") + 1]
            rate = next(ours_rates) if w == "W1" else 9800.0
            out.write_text(json.dumps({"serving": {
                "output_tok_s": rate, "complete": 256, "requests": 256, "ttft_p50_s": rate / 1e3,
                "itl_p50_ms": 11.0}}))
        else:
            assert cmd[cmd.index("--workloads") + 1] == "W1,W2,W1,W1"
            lines = [f"RESULT {w} output_tok_s={r} wall_s=8.0 requests=256 prompt_tokens=1 "
                     f"output_tokens=2 full_outputs=256/256"
                     for w, r in (("W1", 8200.0), ("W2", 9000.0), ("W1", 8000.0), ("W1", 8100.0))]
            log.write_text("\n".join(["vllm 0.26.0", *lines, "done"]) + "\n")
            out.write_text(json.dumps({"vllm": "0.26.0", "gpu": "H200", "workloads": {
                "W1": {"output_tok_s": 8100.0, "full_outputs": 256, "requests": 256},
                "W2": {"output_tok_s": 9000.0, "full_outputs": 256, "requests": 256}}}))
        return 0

    monkeypatch.setattr(side_by_side, "run", fake_run)
    monkeypatch.setattr(sys, "argv", ["side_by_side.py", "--workloads", "W1,W2", "--repeat", "3",
                                      "--out-dir", str(tmp_path / "o"), "--vllm-dir",
                                      str(tmp_path)])
    side_by_side.main()
    assert [c for c in calls if c[0] == "bench_serving.py"] == [
        ("bench_serving.py", "pagedserve_W1.json"), ("bench_serving.py", "pagedserve_W2.json"),
        ("bench_serving.py", "pagedserve_W1_run2.json"),
        ("bench_serving.py", "pagedserve_W1_run3.json")]
    table = (tmp_path / "o" / "table.md").read_text()
    assert "| W1 | 8,400 | 8,100 | 1.04x |" in table  # medians: 8,400 of ours, 8,100 of vLLM's
    assert "8.40 s / 11.0 ms" in table  # the median run's own TTFT
    assert "| W2 | 9,800 | 9,000 | 1.09x |" in table
    assert ("W1, every run (tok/s, in order): pagedserve 8,300, 8,500, 8,400; "
            "vLLM 8,200, 8,000, 8,100; ratio of the medians 1.037") in table
    final = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert final["pagedserve"]["W1"]["runs_tok_s"] == [8300.0, 8500.0, 8400.0]
    assert final["vllm"]["W1"]["runs_tok_s"] == [8200.0, 8000.0, 8100.0]
    assert "runs_tok_s" not in final["pagedserve"]["W2"]
    # --from-dir reads the same runs back into the same table, running nothing.
    monkeypatch.setattr(side_by_side, "run", lambda *a, **k: pytest.fail("ran something"))
    monkeypatch.setattr(sys, "argv", ["side_by_side.py", "--workloads", "W1,W2", "--from-dir",
                                      str(tmp_path / "o")])
    side_by_side.main()
    again = (tmp_path / "o" / "table.md").read_text()
    assert "| W1 | 8,400 | 8,100 | 1.04x |" in again and "ratio of the medians 1.037" in again


@pytest.mark.parametrize("repeat", ["0", "-2"])
def test_repeat_below_one_is_refused(tmp_path, monkeypatch, repeat):
    import sys

    monkeypatch.setattr(side_by_side, "run", lambda *a, **k: pytest.fail("ran something"))
    monkeypatch.setattr(sys, "argv", ["side_by_side.py", "--repeat", repeat, "--out-dir",
                                      str(tmp_path / "o")])
    with pytest.raises(SystemExit):
        side_by_side.main()


@pytest.mark.parametrize("preset, billions", [("llama3-8b", 8.03), ("qwen3-8b", 8.19),
                                              ("glm4-9b", 9.40)])
def test_the_floor_counts_each_presets_published_parameters(preset, billions):
    """The floor's weights (matrices of every layer, embedding and head) come to the models'
    published sizes: Llama-3-8B 8.03B, Qwen3-8B 8.2B, GLM-4-9B 9.4B."""
    shape = side_by_side.model_shape(preset)
    params = (shape.num_layers * side_by_side.layer_params(shape)
              + 2 * shape.vocab_size * shape.hidden_size)
    assert abs(params / 1e9 - billions) < 0.01


def test_a_preset_runs_both_sides_on_its_shape(tmp_path, monkeypatch):
    """--preset glm4-9b: bench_serving serves preset:glm4-9b, vLLM runs it through
    vllm_preset.py, and the floor is GLM-4-9B's, not Llama-3-8B's."""
    import json
    import sys

    cmds = []

    def fake_run(cmd, log, env=None, timeout=None):
        cmds.append(cmd)
        log.write_text("ok\n")
        out = Path(cmd[cmd.index("--out" if "--out" in cmd else "--json") + 1])
        if "bench_kernels.py" in cmd[1]:
            out.write_text(json.dumps({"copy_bw_GBps": 4000.0,
                                       "matmul": {"peak_tflops": 760.0}}))
        return 0

    monkeypatch.setattr(side_by_side, "run", fake_run)
    monkeypatch.setattr(sys, "argv", ["side_by_side.py", "--preset", "glm4-9b", "--workloads",
                                      "W1", "--out-dir", str(tmp_path / "o"), "--vllm-dir",
                                      str(tmp_path / "v"), "--", "--max-num-seqs", "128"])
    side_by_side.main()
    serving, vllm = cmds[1], cmds[2]
    assert serving[serving.index("--model") + 1] == "preset:glm4-9b"
    assert serving[-2:] == ["--max-num-seqs", "128"]
    assert Path(vllm[1]).name == "vllm_preset.py"
    assert vllm[vllm.index("--preset") + 1] == "glm4-9b"
    assert vllm[vllm.index("--vllm-dir") + 1] == str(tmp_path / "v")
    outputs = sum(o for _, _, o in side_by_side.request_sizes("W1"))
    floors = {p: f"{outputs / side_by_side.floor_seconds('W1', 760e12, 4000e9, shape):,.0f}"
              for p, shape in ((p, side_by_side.model_shape(p)) for p in ("glm4-9b", "llama3-8b"))}
    assert floors["glm4-9b"] != floors["llama3-8b"]
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["preset"] == "glm4-9b"
    assert f"| n/a | {floors['glm4-9b']} |" in (tmp_path / "o" / "table.md").read_text()


@pytest.mark.parametrize("argv, message", [
    (["--preset", "nope"], "unknown preset 'nope'"),
    (["--preset", "qwen3-8b", "--", "--model", "preset:tiny"], "--preset names the model"),
    (["--preset", "qwen3-8b", "--workloads", "W4"], "runs llama3-8b only; add --skip-vllm"),
])
def test_a_preset_the_run_cannot_honour_is_one_usage_line(tmp_path, monkeypatch, capsys, argv,
                                                         message):
    import sys

    monkeypatch.setattr(side_by_side, "run", lambda *a, **k: pytest.fail("ran something"))
    monkeypatch.setattr(sys, "argv", ["side_by_side.py", "--out-dir", str(tmp_path), *argv])
    with pytest.raises(SystemExit):
        side_by_side.main()
    assert message in capsys.readouterr().err
