"""A non-editable install works: the wheel pip builds from the Docker image's build context
(what the Dockerfile COPYs) holds every module of genq's packages, and installed on its own
into a fresh virtual environment it imports the API and the `genq` entry point from there,
not from this checkout.

An editable install hides a missing package (its finder maps whole directories), so only a
real wheel shows one: a list of packages written by hand once left out `api.routes`, and the
Docker image could not start the API. Offline: pip builds without build isolation, with the
setuptools of the running environment, and installs with --no-deps --no-index.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("producer", "worker", "kernels", "api")  # what genq ships; tests/ and benchmarks/ are not
NOT_SHIPPED = ("tests", "benchmarks")
PIP_TIMEOUT_S = 120.0


def docker_context() -> list[str]:
    """The paths the Dockerfile COPYs into its working directory, each to the same name."""
    sources: list[str] = []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        words = line.split()
        if not words or words[0] != "COPY":
            continue
        *names, dest = words[1:]
        assert dest in ("./", ".") or names == [dest.rstrip("/")], f"Dockerfile: {line!r} copies elsewhere"
        sources += names
    return sources


def tree_modules() -> set[str]:
    """Every .py file of the shipped packages, relative to the checkout."""
    return {
        path.relative_to(ROOT).as_posix()
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if "__pycache__" not in path.parts
    }


def run(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    assert done.returncode == 0, f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def can_build_offline() -> bool:
    """What pip's isolated build would install, present here: setuptools (pyproject's >=68)
    with bdist_wheel, built in from 70.1 and the `wheel` package before."""
    version = tuple(int(part) for part in importlib.metadata.version("setuptools").split(".")[:2])
    return version >= (70, 1) or (version >= (68, 0) and importlib.util.find_spec("wheel") is not None)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel `pip install .` builds in the Docker image, built from a copy of its context."""
    if not can_build_offline():
        pytest.skip("this environment's setuptools cannot build a wheel without a download")
    context = tmp_path_factory.mktemp("context")
    for name in docker_context():
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, context / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, context / name)
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "-w", str(out), str(context)], cwd=out)
    [built] = out.glob("genq-*.whl")
    return built


def test_the_docker_context_holds_what_the_build_reads() -> None:
    assert {"pyproject.toml", "README.md", *PACKAGES} <= set(docker_context())


def test_the_wheel_holds_every_module_of_the_packages_and_no_tests(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = tree_modules()
    assert "api/routes/__init__.py" in expected  # the check sees subpackages
    assert sorted(expected - names) == []
    assert [n for n in names if n.split("/", 1)[0] in NOT_SHIPPED] == []
    # the compiled CPU kernels' sources, which kernels.cpu.load builds where the wheel is installed
    sources = {f"kernels/cpu/{p.name}" for p in (ROOT / "kernels" / "cpu").iterdir() if p.suffix in (".cpp", ".h")}
    assert "kernels/cpu/attention.cpp" in sources and sorted(sources - names) == []


def fresh_venv(where: Path, wheel: Path) -> Path:
    """A venv with the wheel installed into its own site-packages and nothing else of genq; the
    running environment's dependencies reach it through a path file (a plain path line: that
    directory's own .pth files, genq's editable finder among them, are not run)."""
    venv = where / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], cwd=where)
    python = venv / "bin" / "python"
    site = Path(run([str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    cwd=where).strip())
    # --target installs beside the running environment, never into it (pip ignores what is installed)
    run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
         "--target", str(site), str(wheel)], cwd=where)
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "genq_test_dependencies.pth").write_text("\n".join(sorted(deps)) + "\n")
    return python


IMPORT_CHECK = textwrap.dedent("""
    import importlib.metadata, json, sys
    import api.main
    [entry] = importlib.metadata.entry_points(group="console_scripts", name="genq")
    entry.load()
    ours = {name: module.__file__ for name, module in sys.modules.items()
            if name.split(".")[0] in {"producer", "worker", "kernels", "api"}}
    print(json.dumps({"ours": ours, "entry": entry.value, "torch": "torch" in sys.modules}))
""")


def test_the_installed_wheel_serves_the_api_from_its_own_venv(wheel: Path, tmp_path: Path) -> None:
    python = fresh_venv(tmp_path, wheel)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    # -I: neither this checkout (the working directory, PYTHONPATH) nor user site-packages
    found = json.loads(run([str(python), "-I", "-c", IMPORT_CHECK], cwd=tmp_path, env=env))
    venv = str(tmp_path / "venv") + os.sep
    assert "api.routes" in found["ours"] and "api.main" in found["ours"]
    assert {name: path for name, path in found["ours"].items() if not path.startswith(venv)} == {}
    assert found["entry"] == "producer.cli:main"
    assert not found["torch"]  # the API never imports torch
