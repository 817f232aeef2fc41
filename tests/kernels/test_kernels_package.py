"""The package around the kernels: import without Triton, device checks, CUDA compilation."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kernels._common import HAS_TRITON, check_device

REPO = Path(__file__).resolve().parents[2]


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environ.update(env, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO, env=environ, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_import_without_triton() -> None:
    """References work without Triton; launching a kernel says what is missing."""
    result = _run_python(
        """
        import sys
        sys.modules["triton"] = None  # makes `import triton` raise ImportError
        import torch
        import kernels
        assert not kernels.HAS_TRITON
        x, w = torch.randn(2, 8), torch.ones(8)
        kernels.rms_norm_ref(x, w)
        try:
            kernels.rms_norm(x, w)
        except RuntimeError as e:
            assert "Triton" in str(e), e
            print("clear error")
        """
    )
    assert result.returncode == 0, result.stderr
    assert "clear error" in result.stdout


def test_cpu_tensors_need_the_interpreter() -> None:
    not_interpreted = object()  # anything that is not an interpreted kernel
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        check_device(not_interpreted, x=torch.zeros(1))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_kernels_compile_for_hopper() -> None:
    """Lower every kernel variant to a sm_90 cubin: catches what the interpreter accepts."""
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        pytest.skip("triton has no CUDA backend here")
    result = _run_python("from kernels.compile_check import main; raise SystemExit(main())",
                         TRITON_DEFAULT_FP_FUSION="1")  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("ok ") >= 8, result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_gpu_check_fails_clearly_without_cuda() -> None:
    from kernels.bench import check_kernels

    with pytest.raises(RuntimeError, match="CUDA GPU"):
        check_kernels()


def test_without_a_compiler_the_torch_attention_path_serves_with_one_warning(tmp_path: Path) -> None:
    """No C++ compiler (CXX names none; a fresh copy of the sources, so no earlier build is at
    hand): kernels.cpu.load() warns once and says False, `auto` picks the torch backend on the
    CPU, and asking for `cpu` by name is refused with the reason."""
    import shutil

    shutil.copytree(REPO / "kernels", tmp_path / "kernels", ignore=shutil.ignore_patterns("_build", "__pycache__"))
    code = textwrap.dedent(f"""
        import logging
        import torch
        logging.basicConfig(level=logging.WARNING)
        from kernels import cpu
        assert cpu.__file__.startswith({str(tmp_path)!r}), cpu.__file__
        print("loaded", cpu.load(), cpu.load())
        from worker.model_executor.attention_selector import resolve_attention_backend
        print("auto", resolve_attention_backend("auto", torch.device("cpu")))
        try:
            resolve_attention_backend("cpu", torch.device("cpu"))
        except ValueError as e:
            print("refused:", e)
        """)
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environ.update(CXX=str(tmp_path / "no-such-compiler"), PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=environ, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "loaded False False" in result.stdout and "auto torch" in result.stdout, result.stdout
    assert "refused: attention_backend 'cpu' needs genq's compiled CPU kernels" in result.stdout
    assert result.stderr.count("compiled CPU kernels are unavailable") == 1, result.stderr[-3000:]
