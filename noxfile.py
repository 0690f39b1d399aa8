"""nox sessions: lint, tests, gpu, bench, demo, docs.

Every session installs torch (pinned) before akv, so nixl's unpinned torch requirement does
not pull CUDA wheels onto CPU machines. Set AKV_TORCH_VERSION to change the pin (the gpu
session needs a CUDA build of torch).
"""

from __future__ import annotations

import os

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True

TORCH = f"torch=={os.environ.get('AKV_TORCH_VERSION', '2.13.0')}"


def install(session: nox.Session, *extras: str) -> None:
    session.install(TORCH)
    spec = f".[{','.join(extras)}]" if extras else "."
    session.install("-e", spec)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff and mypy --strict."""
    install(session, "lint", "test", "bench", "docs")
    session.run("ruff", "check", "akv", "tests", "examples", "noxfile.py")
    session.run("ruff", "format", "--check", "akv", "tests", "examples", "noxfile.py")
    session.run("mypy")


@nox.session
def tests(session: nox.Session) -> None:
    """The CPU test suite (real NIXL agents over UCX loopback, DRAM)."""
    install(session, "test", "examples")
    session.run("pytest", "-q", "-m", "not gpu", *session.posargs)


@nox.session
def gpu(session: nox.Session) -> None:
    """The tests marked gpu, on CUDA tensors (VRAM). Skips with a message where CUDA is absent."""
    install(session, "test")
    probe = "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 3)"
    try:
        session.run("python", "-c", probe, silent=True)
    except nox.command.CommandFailed:
        session.skip(
            "no CUDA device or CUDA-enabled torch here: the gpu session needs an NVIDIA GPU "
            "(set AKV_TORCH_VERSION to a CUDA build of torch)"
        )
    session.run("pytest", "-q", "-m", "gpu", "-rs", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """`akv bench` (pass --quick, --plot FILE.png, --json after --)."""
    install(session, "bench")
    session.run("akv", "bench", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """The disaggregated demo (arguments after -- go to `akv demo`)."""
    install(session)
    session.run("akv", "demo", *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """Build the docs site in strict mode."""
    install(session, "docs")
    session.run("mkdocs", "build", "--strict")
