import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# Stated once: property tests run many small models; shrinking and timing noise on a shared 2-core machine must not
# fail them, and CI runs a fixed, derandomised set so a red run is reproducible.
settings.register_profile(
    "dev", deadline=None, max_examples=25, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.register_profile("ci", parent=settings.get_profile("dev"), derandomize=True)
# scripts/isa-matrix: the same tests again under slower, portable kernels, on a smaller fixed set of examples (the
# bounds are what it checks there, the breadth of the examples is the ci run's)
settings.register_profile("isa", parent=settings.get_profile("ci"), max_examples=6)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

torch.set_num_threads(min(2, torch.get_num_threads()))

# The suite's references are CPU runs: on a machine with a GPU, fzero (as DeepSpeed, which reads the same variable)
# would otherwise train on it and use NCCL, also where a DeepSpeed user's environment says DS_ACCELERATOR=cuda.
# tests/test_cuda.py asks for the GPU itself.
os.environ["DS_ACCELERATOR"] = "cpu"


# Variables set by others, not by a test: pytest's own; torch's inductor's on its first compile (a cache location);
# what `import deepspeed` sets once with setdefault (transformers imports DeepSpeed when it is installed, as the test
# extra installs it: it only makes torch's CUDA availability check use NVML); and Intel OpenMP's switches, which a
# library of a larger environment sets on its first import (seen on a GPU machine's image, none of the test extra's
# packages does), read only when that runtime starts
_OWN_VARIABLES = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "PYTORCH_NVML_BASED_CUDA_CHECK",
                  "KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK"}  # fmt: skip


@pytest.fixture(scope="session", autouse=True)
def torch_extensions(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Where DeepSpeed's reference runs build their C++ ops (its CPU accelerator's `deepspeed_shm_comm`, a minute of
    ninja on 2 cores): one directory of the session's own, so the op is built once per session (every worker process
    inherits it) and never in the user's cache."""
    os.environ["TORCH_EXTENSIONS_DIR"] = str(tmp_path_factory.mktemp("torch_extensions"))


@pytest.fixture
def keep_threads():
    """For tests that run a command's `main` in this process: the command sets torch's thread count for its run
    (`--threads`, default cores / ranks), as a program should; the test gives the suite's back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def retained(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The calls of `fzero.hostmem.retain_freed_memory` made in this process (by a command run in it: `fzero train`),
    recorded instead of made: glibc's settings cannot be put back, so the real call would change the malloc of every
    later test. tests/test_hostmem.py makes it in processes of its own."""
    import fzero

    calls: list[int] = []
    monkeypatch.setattr(fzero.hostmem, "retain_freed_memory", lambda: bool(calls.append(1)))
    return calls


def _global_state() -> dict:
    """What a test may change that would change a later test's arithmetic or behaviour: torch's threads and numeric
    switches, the native kernel's instruction-set path, the environment, a default process group, the directory."""
    import torch.distributed as dist

    from fzero import native

    return {
        "threads": torch.get_num_threads(),
        "interop threads": torch.get_num_interop_threads(),
        "default dtype": torch.get_default_dtype(),
        "grad enabled": torch.is_grad_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "matmul precision": torch.get_float32_matmul_precision(),
        "mkldnn": torch.backends.mkldnn.enabled,
        "cpu capability": torch.backends.cpu.get_cpu_capability(),
        "native isa": native.isa(),
        "process group": dist.is_available() and dist.is_initialized(),
        "environment": {k: v for k, v in os.environ.items() if k not in _OWN_VARIABLES},
        "cwd": os.getcwd(),
    }


@pytest.fixture(autouse=True)
def _restores_global_state():
    """Every test leaves the process as it found it, so a test's result never depends on the tests before it."""
    before = _global_state()
    yield
    after = _global_state()
    changed = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    if "environment" in changed:
        old, new = changed["environment"]
        changed["environment"] = {
            k: (old.get(k), new.get(k)) for k in old.keys() | new.keys() if old.get(k) != new.get(k)
        }
    assert not changed, f"the test changed global state (before, after): {changed}"
