"""scripts/compare_plans.py, the plan-by-plan comparison of two trees' schedulers: this tree
against itself is identical on runs that preempt, swap, fork and hit cached prefixes, and a copy
with one changed rule (who samples in a step) is caught."""
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "compare_plans.py"


def _compare(old: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(old), str(ROOT), *args],
                          capture_output=True, text=True, timeout=120)


def test_this_tree_against_itself_is_identical_on_runs_that_exercise_every_path():
    out = _compare(ROOT, "--runs", "40")
    assert out.returncode == 0, out.stdout + out.stderr
    first = out.stdout.splitlines()[0]
    assert first.startswith("40 runs: 40 identical plan by plan, 0 differ"), first
    seen = dict(part.strip().split(" ", 1)[::-1] for part in first.split("had ")[1].split(","))
    for what in ("preemptions", "pages swapped out", "pages copied (fork)",
                 "new seqs starting on cached pages", "aborts and stop-string finishes"):
        assert int(seen[what]) > 0, (what, first)


def test_a_changed_sampling_rule_is_caught(tmp_path):
    shutil.copytree(ROOT / "scheduler_svc", tmp_path / "scheduler_svc")
    rule = tmp_path / "scheduler_svc" / "scheduler.py"
    source = rule.read_text()
    decision = "plan.sampling_seq_ids.append(seq.seq_id)"
    assert source.count(decision) == 1, "the mutation point moved: update this test"
    rule.write_text(source.replace(decision, f"{decision} if seq.seq_id % 5 else None"))
    out = _compare(tmp_path, "--runs", "10", "--max-steps", "200")
    assert out.returncode == 1, out.stdout + out.stderr
    assert " differ" in out.stdout and "seed " in out.stdout and "  old {" in out.stdout
