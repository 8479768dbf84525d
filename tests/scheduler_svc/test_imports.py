"""scheduler_svc stays CPU-only: importing every module loads neither torch nor cupy."""
import pathlib
import subprocess
import sys

import scheduler_svc

MODULES = sorted(p.stem for p in pathlib.Path(scheduler_svc.__file__).parent.glob("*.py")
                 if p.stem != "__init__")


def test_scheduler_imports_without_torch_or_cupy():
    code = "\n".join(
        ["import sys"]
        + [f"import scheduler_svc.{m}" for m in MODULES]
        + ["bad = sorted(m for m in sys.modules if m.split('.')[0] in "
           "('torch', 'cupy', 'pagedserve_kernels', 'executor_svc'))",
           "assert not bad, bad"])
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_module_is_checked():
    assert {"engine", "scheduler", "server", "block_manager"} <= set(MODULES)
