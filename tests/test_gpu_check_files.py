"""The GPU check's own files stay consistent with the project (runs everywhere, no GPU):
the carried wheels are the versions the suite runs with, and the script parses."""
import re
import subprocess

from conftest import ROOT


def _pins(path) -> dict[str, str]:
    pins = {}
    for line in (ROOT / path).read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version.strip()
    return pins


def test_carried_wheels_are_the_suites_versions():
    wheels, requirements = _pins("tests/gpu/wheels.txt"), _pins("requirements.txt")
    differ = {n: (v, requirements[n]) for n, v in wheels.items() if n in requirements
              and requirements[n] != v}
    missing = sorted(n for n in wheels if n not in requirements)
    assert not differ, f"tests/gpu/wheels.txt pins differ from requirements.txt: {differ}"
    assert not missing, f"tests/gpu/wheels.txt carries packages requirements.txt lacks: {missing}"


def test_the_runtime_and_test_dependencies_are_carried():
    # What nbdist imports and the GPU test files need, which the device image lacks.
    wheels = _pins("tests/gpu/wheels.txt")
    for name in ("ipyparallel", "ipython", "ipywidgets", "ipykernel", "jupyter-client", "nbclient",
                 "nbformat", "mpi4py", "mpich", "scikit-build-core", "pybind11"):
        assert name in wheels, name


def test_scripts_parse():
    for script in ("tests/gpu/check.sh", "tests/gpu/fetch_wheels.sh"):
        subprocess.run(["bash", "-n", str(ROOT / script)], check=True)
