"""The docs run as written (CONTRIBUTING.md, "Docs that run", states the rules):

* every ```python block of README.md and docs/*.md is a complete program: run, each in a
  namespace of its own, in a fresh process from the repository's root; a block whose info string
  is ``python fragment`` shows a form, not a program, and is only compiled;
* every ```bash run block is run, the blocks of a page in order in one temporary directory, each
  command with CI's scale appended (:data:`SCALE`: flags that shrink the run; the last flag
  given wins); the other shell blocks (GPUs, downloads, whole trainings) are not;
* what the docs say of the code is the code's: the default CUDA architectures, the GPU check's plan,
  the shipped configs, the `fusedres` commands.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^```([^\n`]*)\n(.*?)^```", re.M | re.S)


def heavy(source: str) -> bool:
    """Whether a block is too slow for `make test` (CI's slow step runs it): it builds
    ResNet-1001, whose plan at batch 128 takes minutes on 2 cores."""
    return "preact_resnet1001" in source


# CI's scale: appended to each command of a `bash run` block that starts with the key.
SCALE = {
    "fusedres train": ["--epochs", "4", "--no-progress"],  # digits: 44 iterations
    "fusedres landscape": ["--grid", "3", "--batches", "1"],
    "fusedres lesion": ["--draws", "2"],
}


def blocks(info: str) -> list[tuple[str, str]]:
    """(page:line, source) of every fenced block whose info string is ``info``."""
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in _BLOCK.finditer(text):
            if m.group(1).strip() == info:
                line = text.count("\n", 0, m.start()) + 1
                out.append((f"{page.relative_to(ROOT)}:{line}", m.group(2)))
    return out


# Runs each program of a JSON list [[name, source], ...] in a namespace of its own, as
# `python file.py` would (__name__ == "__main__"), and prints the names of those that raised.
_RUNNER = r"""
import json, sys, traceback
failed = []
for name, source in json.load(sys.stdin):
    try:
        exec(compile(source, name, "exec"), {"__name__": "__main__"})
    except BaseException:
        failed.append(name)
        print(f"--- {name}", file=sys.stderr)
        traceback.print_exc()
print(json.dumps(failed))
"""


def test_every_python_block_is_a_program_or_a_fragment():
    marked = {b.group(1).strip() for p in PAGES for b in _BLOCK.finditer(p.read_text())}
    assert {m for m in marked if m.startswith("python")} <= {"python", "python fragment"}
    assert blocks("python"), "no python blocks found: the extraction broke"
    for name, source in blocks("python fragment"):
        compile(source, name, "exec")


@pytest.mark.parametrize("group", ["quick", "heavy"])
def test_python_blocks_run(group):
    programs = [(n, s) for n, s in blocks("python") if heavy(s) == (group == "heavy")]
    assert programs
    proc = subprocess.run([sys.executable, "-c", _RUNNER], input=json.dumps(programs),
                          capture_output=True, text=True, cwd=ROOT, timeout=1800,
                          env=dict(os.environ, PYTHONWARNINGS="ignore", MPLBACKEND="Agg"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    failed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert failed == [], proc.stderr[-6000:]


def commands(source: str) -> list[list[str]]:
    """The commands of a shell block (continuation lines joined, comments dropped), each with
    its CI scale appended."""
    out = []
    for line in source.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        for prefix, extra in SCALE.items():
            if words[:len(prefix.split())] == prefix.split():
                words = words + extra
        out.append(words)
    return out


def test_commands_take_the_scale():
    cmds = commands("fusedres train --config digits \\\n    --out runs/x   # the demo\n"
                    "# a comment\nfusedres compare runs/x\n")
    assert cmds == [["fusedres", "train", "--config", "digits", "--out", "runs/x",
                     *SCALE["fusedres train"]], ["fusedres", "compare", "runs/x"]]


def _shell_pages() -> list[str]:
    return sorted({name.rsplit(":", 1)[0] for name, _ in blocks("bash run")})


@pytest.mark.parametrize("page", _shell_pages())
def test_shell_blocks_run(page, tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="ignore", MPLBACKEND="Agg",
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
    for name, source in blocks("bash run"):
        if not name.startswith(page + ":"):
            continue
        for words in commands(source):
            proc = subprocess.run(words, capture_output=True, text=True, cwd=tmp_path, env=env,
                                  timeout=900)
            assert proc.returncode == 0, f"{name}: {shlex.join(words)}\n{proc.stderr[-3000:]}"


# --------------------------------------------------------------------------- doc = code

def test_cuda_arch_default_is_setup_pys():
    default = re.search(r'^DEFAULT_CUDA_ARCHS = "([^"]+)"', (ROOT / "setup.py").read_text(),
                        re.M).group(1)
    for page in ("docs/development.md", "docs/install.md"):
        text = " ".join((ROOT / page).read_text().split())
        assert f"`{default}`" in text, f"{page} does not state setup.py's default {default}"


def test_gpu_md_states_the_checks_plan():
    """docs/gpu.md's phase table is benchmarks/gpu_check.py's PLAN: every phase, in order,
    its slot in seconds (phases sharing a row share the row's slot), the total as default."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    text = (ROOT / "docs" / "gpu.md").read_text()
    rows = re.findall(r"^\| ([a-z, ]+) \| (\d+) s \|", text, re.M)
    documented = [(name.strip(), int(slot)) for names, slot in rows for name in names.split(",")]
    assert [n for n, _ in documented] == [n for n, _ in gpu_check.PLAN]
    for names, slot in rows:
        assert sum(dict(gpu_check.PLAN)[n.strip()] for n in names.split(",")) == int(slot), names
    assert f"default {gpu_check.DEFAULT_TIME_LIMIT:g} s" in " ".join(text.split())


def test_train_help_names_every_shipped_config(capsys):
    from fusedres.apps.train import main
    from fusedres.apps.train.config import PACKAGE_CONFIGS

    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    names = sorted(p.stem for p in PACKAGE_CONFIGS.glob("*.yaml"))
    assert len(names) >= 9 and all(n in text for n in names), names


def test_every_fusedres_command_is_documented():
    from fusedres.apps.cli import COMMANDS

    text = " ".join(p.read_text() for p in PAGES)
    assert [c for c in COMMANDS if f"fusedres {c}" not in text] == []
