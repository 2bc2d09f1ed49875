"""Build the C++ kernels at run time, for the CPU at hand, and keep them in a build directory.

attention_cpu.cpp and linear_bf16.cpp are compiled where they run: -march=native (AVX512-BF16 or AMX tiles
where the CPU has them) and -ffp-contract=off (their fixed summation orders must not gain a fused multiply-add
the source did not write). A build takes about 20 s and `build_dir` keeps it (a server's data directory keeps
it in compile/extensions), so a machine builds each kernel once. What building and loading take lives here:
torch's load_inline, a directory per extension, and a lock of our own through which the next builder removes
the `lock` file torch leaves when a builder dies mid-build.

    source = Path("adaptive_spec/kernels/attention_cpu.cpp").read_text()
    module = build_extension("adaptive_spec_attention_cpu", source, ["attention"], build_dir)  # raises if it cannot
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # not a POSIX system: torch's own lock file is all there is
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)


def build_extension(
    name: str, source: str, functions: list[str], build_dir: Path | str | None, flags: tuple[str, ...] = ()
):
    """Build (or load, when `build_dir` has it) a C++ extension for this machine's CPU: -march=native,
    OpenMP for ATen's parallel_for, and no fused multiply-add the source did not write
    (-ffp-contract=off, which the kernels' fixed reduction orders rely on). Raises if it cannot.

    Each extension builds in a directory of its own under `build_dir` (`build_dir/name`, resolved): torch writes
    an extension's main.cpp and build.ninja into its build directory, so two extensions sharing one
    overwrote each other's and each start rebuilt both, about 18 s each on 2 cores."""
    from torch.utils.cpp_extension import load_inline

    # Resolved: the build files name the directory, so reaching one cache by two paths (a benchmark's server
    # links its data directory's compile/ to the invoker's) rebuilt the extension at each change of path.
    directory = Path(build_dir).resolve() / name if build_dir is not None else None
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
    with _sole_builder(directory):
        return load_inline(
            name=name,
            cpp_sources=source,
            functions=functions,
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", *flags],
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory) if directory is not None else None,
            verbose=False,
        )


@contextmanager
def _sole_builder(directory: Path | None):
    """Hold an exclusive lock on `directory/.builder` while torch builds or loads the extension there, and
    remove a `lock` file left behind by a builder that died.

    torch takes turns through a `lock` file it creates and deletes when done; a process ended mid-build
    (`serve` stopped while its models load ends with os._exit) left it, and every later start waited for
    it forever. The kernel releases this lock when its holder dies, so whoever holds it knows that a
    `lock` file it finds is stale."""
    if directory is None or fcntl is None:
        yield
        return
    with open(directory / ".builder", "a") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)  # waits while another live process builds here
        stale = directory / "lock"
        if stale.exists():
            log.warning("removing %s, left by a build that did not finish", stale)
            stale.unlink(missing_ok=True)
        yield
