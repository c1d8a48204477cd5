"""tools/cuda_aot.compile_cached: nvcc's outputs kept in build/nvcc-cache, shared by the compile
table and the performance model. Run against a stand-in nvcc (a script that logs each call), so
the rules are checked without the CUDA toolkit."""

import os
import stat
import threading

import pytest

from tools import cuda_aot

FAKE_NVCC = """#!/bin/sh
# Stand-in nvcc: logs the call, writes an object and a PTX entry with launch bounds.
echo call >> "{log}"
sleep 0.2
while [ $# -gt 0 ]; do
  case "$1" in
    -o) out="$2"; shift;;
    --keep-dir) keep="$2"; shift;;
  esac
  shift
done
echo object > "$out"
printf '.entry _Z1kv(\\n.maxntid 128, 1, 1\\n' > "$keep/k.ptx"
echo "ptxas info    : Used 32 registers" >&2
"""


@pytest.fixture
def setup(tmp_path, monkeypatch):
    log = tmp_path / "calls.log"
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text(FAKE_NVCC.format(log=log))
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
    src = tmp_path / "csrc" / "cuda" / "k.cu"
    src.parent.mkdir(parents=True)
    src.write_text("__global__ void k() {}\n")
    (tmp_path / "csrc" / "common.h").write_text("// v1\n")
    monkeypatch.setattr(cuda_aot, "CACHE_DIR", str(tmp_path / "cache"))
    return str(nvcc), str(src), log, tmp_path


def calls(log) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_second_ask_reads_the_cache(setup):
    nvcc, src, log, _ = setup
    a = cuda_aot.compile_cached(nvcc, src)
    b = cuda_aot.compile_cached(nvcc, src)
    assert calls(log) == 1
    assert a == b
    assert a.obj == b"object\n" and "Used 32 registers" in a.log
    assert a.threads == {"_Z1kv": 128}


def test_a_header_change_recompiles_and_drops_the_old_entry(setup):
    nvcc, src, log, tmp = setup
    cuda_aot.compile_cached(nvcc, src)
    (tmp / "csrc" / "common.h").write_text("// v2\n")
    cuda_aot.compile_cached(nvcc, src)
    assert calls(log) == 2
    entries = [e for e in os.listdir(tmp / "cache") if not e.endswith(".lock")]
    assert len(entries) == 1, entries  # the first source's entry is gone
    cuda_aot.compile_cached(nvcc, src, archs=(90,))  # other architectures: their own entry
    assert calls(log) == 3


def test_concurrent_asks_compile_once(setup):
    nvcc, src, log, _ = setup
    got = []
    threads = [threading.Thread(target=lambda: got.append(cuda_aot.compile_cached(nvcc, src)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls(log) == 1 and len(got) == 3


def test_a_failed_compile_leaves_no_entry(setup):
    nvcc, src, _, tmp = setup
    with open(nvcc, "w") as f:
        f.write("#!/bin/sh\necho 'error: no' >&2\nexit 1\n")
    with pytest.raises(RuntimeError, match="nvcc failed"):
        cuda_aot.compile_cached(nvcc, src)
    assert [e for e in os.listdir(tmp / "cache") if not e.endswith(".lock")] == []


def test_table_reads_a_dynamic_shared_memory_note_in_a_header(setup):
    """A kernel family's .cuh (included by the .cu nvcc compiles) may carry the kernel's
    ``// cuda_aot: <name> dynamic_smem=<bytes>`` note: the table reads it there too."""
    nvcc, src, _, tmp = setup
    with open(nvcc, "a") as f:
        f.write("echo \"ptxas info    : Compiling entry function '_Z1kv' for 'sm_90'\" >&2\n")
    (tmp / "csrc" / "cuda" / "family.cuh").write_text("// cuda_aot: k dynamic_smem=4096\n")
    kernels, _ = cuda_aot.compile_file(nvcc, src, archs=(90,))
    assert [(k.name, k.arch, k.dynamic_smem) for k in kernels] == [("k", 90, 4096)]
