"""Test sessions. `nox -s tests` is the whole suite: `units` (lint, typecheck, every package
alone, every plugin in plugins/ with its own tests, `slurm`: the sweep's job script under a
one-node Slurm), then integration. CI (.ci/run) runs `units` and `integration` side by side.

Each package session installs only that package (and core-mesh, and whatever the package itself
depends on) into a fresh venv, so a missing dependency declaration fails here, not for users.
"""

from __future__ import annotations

import ctypes.util
import os
import shutil
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PYPROJECT = nox.project.load_toml(ROOT / "pyproject.toml")
CONSTRAINTS = ("-c", str(ROOT / "constraints.txt"))
PACKAGES = [
    "core-mesh",
    "data-pack",
    "models",
    "parallel",
    "checkpoint",
    "ablate",
    "downstream",
    "train-loop",
]
SIBLINGS = {"train-loop": ["data-pack", "models", "parallel", "checkpoint", "ablate", "downstream"]}
# siblings a package's own tests use (not its code): downstream's tests score a real model
# with a real tokenizer, and send bad task files through `llmtrain eval-tasks` (train-loop, with
# the siblings it needs installed from this tree)
TEST_SIBLINGS = {
    "downstream": ["data-pack", "models", "parallel", "checkpoint", "ablate", "train-loop"]
}
# programs outside Python that a session's tests run, by session: {program: Debian package}.
# The HTML report is laid out in Debian's headless chromium: ablate's test_report_browser.py
# drives it directly, integration's test_verdict.py through Playwright. (git, bash and mount,
# which other tests run, come with every Debian machine that can clone the repository.)
SYSTEM_PROGRAMS = {
    "ablate": {"chromium": "chromium"},
    "integration": {"chromium": "chromium"},
    # Debian's Slurm (22.05 on bookworm): the `slurm` session's one-node cluster and its clients
    "slurm": {
        "munged": "munge",
        "slurmctld": "slurmctld",
        "slurmd": "slurmd",
        "sbatch": "slurm-client",
        "scancel": "slurm-client",
        "scontrol": "slurm-client",
        "squeue": "slurm-client",
    },
}
# shared libraries outside Python that a session's tests load, by session: {library (as
# ctypes.util.find_library names it): Debian package}. LightGBM's wheel (ablate's `mixture`
# extra, `fit --mixture`) links the system's OpenMP runtime rather than bringing its own.
SYSTEM_LIBRARIES = {"ablate": {"gomp": "libgomp1"}}
# optional extras a package's own tests exercise, and extra test-only dependency groups
EXTRAS = {"data-pack": "[all]", "checkpoint": "[s3]", "ablate": "[plot,mixture]"}
TEST_GROUPS = {
    "data-pack": ["object-store", "formats"],
    "downstream": ["object-store"],
    "checkpoint": ["object-store"],
    "train-loop": ["object-store"],
}

# what a plugin's own tests need beyond the plugin and the llmtrain packages: other plugins (by
# folder) and requirements. llmtrain-lmeval's tests export the model with llmtrain-hf and compare
# with lm-eval's transformers backend (its `hf` extra).
PLUGIN_TEST_DEPS = {
    # its `moe` extra: OLMoE, Qwen3-MoE and Mixtral convert to llmtrain-moe's models
    "llmtrain-hf": ["plugins/llmtrain-moe"],
    "llmtrain-lmeval": [
        "plugins/llmtrain-hf",
        "lm-eval[hf]",
        # a model plugin that is not a Transformer, under lm-eval (test_model_contract.py)
        "integration_tests/plugins/llmtrain-toy-lm",
    ],
}
# plugins installed only in their own session: llmtrain-lmeval brings lm-eval and its stack
# (datasets, evaluate, scikit-learn, ...), which no other session needs. integration_tests'
# plugin check still installs it (without dependencies) to find its entry point.
OWN_SESSION_PLUGINS = {"llmtrain-lmeval"}
# a model plugin for tests only: the integration session and llmtrain-lmeval's install it
TOY_LM = ROOT / "integration_tests" / "plugins" / "llmtrain-toy-lm"

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = False

# Every test session starts many Python processes (the CLI, torchrun's ranks), each importing
# torch and llmtrain: from .pyc files that takes ~2 s, compiling the sources ~4.5 s. uv installs
# no .pyc files, so the first import writes them into the session's venv; where
# PYTHONDONTWRITEBYTECODE is set (CI's machines set it) nothing would be written and every
# process would compile again.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# uv does not read pip's settings; carry pip's local wheel folder over so the pinned torch
# resolves to the local CPU build where the machine has one.
if "UV_FIND_LINKS" not in os.environ and os.environ.get("PIP_FIND_LINKS"):
    os.environ["UV_FIND_LINKS"] = os.environ["PIP_FIND_LINKS"]


def group(name: str) -> list[str]:
    return nox.project.dependency_groups(PYPROJECT, name)


def package_paths(*names: str) -> list[str]:
    return [str(ROOT / "packages" / name) + EXTRAS.get(name, "") for name in names]


def plugin_paths(*, shared: bool = False) -> list[str]:
    """Every plugin in plugins/; `shared`: those the shared venvs (integration, gpu,
    quickstart) install, without OWN_SESSION_PLUGINS."""
    paths = sorted((ROOT / "plugins").glob("*/pyproject.toml"))
    return [str(p.parent) for p in paths if not (shared and p.parent.name in OWN_SESSION_PLUGINS)]


def install_everything(session: nox.Session) -> None:
    """Every package and the shared plugins."""
    session.install(
        *CONSTRAINTS,
        *package_paths(*PACKAGES),
        str(ROOT),
        *plugin_paths(shared=True),
        *group("test"),
        *group("integration"),
        *group("object-store"),
    )


def pytest(session: nox.Session, *paths: str) -> None:
    """The tests at `paths`, listing the slowest (where the suite's time goes, in every
    session's log); extra arguments after `--` go to pytest."""
    session.run("pytest", *paths, "--durations=15", *session.posargs)


def make_package_session(package: str) -> None:
    @nox.session(name=package)
    def run(session: nox.Session) -> None:
        deps = ["core-mesh", *SIBLINGS.get(package, []), *TEST_SIBLINGS.get(package, []), package]
        tests = [dep for name in ["test", *TEST_GROUPS.get(package, [])] for dep in group(name)]
        session.install(*CONSTRAINTS, *package_paths(*dict.fromkeys(deps)), *tests)
        ensure_programs(session)
        # the shared checks: installs alone, one namespace, one version, torch only where allowed
        session.env["LLMTRAIN_PACKAGE"] = package
        own_tests = ROOT / "packages" / package / "tests"
        pytest(
            session, str(ROOT / "package_tests"), *([str(own_tests)] if own_tests.is_dir() else [])
        )


for _package in PACKAGES:
    make_package_session(_package)


@nox.session
def lint(session: nox.Session) -> None:
    session.install(*group("lint"))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


# what `nox -s typecheck` holds at zero mypy --strict errors (config: pyproject.toml): every
# package's and every plugin's source
TYPED = sorted(
    [*ROOT.glob("packages/*/src/llmtrain/*/py.typed"), *ROOT.glob("plugins/*/src/*/py.typed")]
)


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict over every package's and plugin's source, with their dependencies
    installed so that torch, attrs and the rest are read with their own types."""
    session.install(
        *CONSTRAINTS, *package_paths(*PACKAGES), *plugin_paths(shared=True), *group("typecheck")
    )
    session.run("mypy", *(str(marker.parent) for marker in TYPED))


def ensure_programs(session: nox.Session, tests_of: str | None = None) -> None:
    """The programs and shared libraries outside Python that this session's tests run
    (SYSTEM_PROGRAMS, SYSTEM_LIBRARIES; `tests_of`: the session whose tests these are, default
    this one), installed with Debian's apt where the machine lacks them: each session installs
    its own, whatever ran before it, so a session passes alone on a new machine."""
    name = tests_of or session.name
    missing = [
        package
        for program, package in SYSTEM_PROGRAMS.get(name, {}).items()
        if not shutil.which(program)
    ]
    missing += [
        package
        for library, package in SYSTEM_LIBRARIES.get(name, {}).items()
        if not ctypes.util.find_library(library)
    ]
    missing = list(dict.fromkeys(missing))  # a package that brings several programs, once
    if not missing:
        return
    # one apt at a time: CI runs three sessions at once (.ci/run), and apt refuses a second
    lock = ["flock", str(ROOT / ".nox" / "apt.lock")]
    session.run(*lock, "apt-get", "update", "-qq", external=True)
    apt = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing]
    session.run(*lock, *apt, external=True)


@nox.session
def integration(session: nox.Session) -> None:
    """All packages and plugins together: multi-process gloo, object storage, CLI end to end,
    the HTML report in a headless browser."""
    install_everything(session)
    # the test model plugin that is not a Transformer (test_model_contract.py); its
    # dependencies are installed above
    session.install("--no-deps", str(TOY_LM))
    ensure_programs(session)
    pytest(session, str(ROOT / "integration_tests"), "-m", "not gpu")


# the GPU kit's own tests (tools/gpu): its CPU dry run of every step, and its reports
GPU_KIT_TESTS = ROOT / "tools" / "gpu" / "tests"


@nox.session(name="gpu-kit")
def gpu_kit(session: nox.Session) -> None:
    """The GPU kit on CPU: `tools/gpu/runner.py --dry-run` builds the repo's wheels, installs
    them and starts every step's CPU form (so the first GPU session does not die on a typo);
    the steps' GPU configs and the merged report are checked from made-up figures."""
    install_everything(session)
    ensure_programs(session)
    pytest(session, str(GPU_KIT_TESTS))


# the SLURM job script's tests: a one-node cluster of its own (their conftest.py)
SLURM_TESTS = ROOT / "packages" / "train-loop" / "tests_slurm"


@nox.session
def slurm(session: nox.Session) -> None:
    """`llmtrain sweep --launch slurm` under a real Slurm: the tests start munged, slurmctld and
    slurmd on this machine (a one-node cluster in a temporary directory, stopped whatever
    happens), submit the sweep's job script with sbatch and read the runs back: arrays, the
    requeue at the time limit, scancel and resubmission, a failed run. A cluster that does not
    start fails the session; nothing is skipped."""
    session.install(*CONSTRAINTS, *package_paths(*PACKAGES), *group("test"))
    ensure_programs(session)
    pytest(session, str(SLURM_TESTS))


@nox.session
def gpu(session: nox.Session) -> None:
    """The CUDA checks (nccl, bf16, compile); they skip cleanly on a machine without a GPU."""
    install_everything(session)
    pytest(session, str(ROOT / "integration_tests"), "-m", "gpu")


def make_plugin_session(path: Path) -> str:
    """`plugin-<name>`: the plugin with the llmtrain packages and what its pyproject declares,
    then its own tests (a missing dependency declaration fails here)."""
    name = "plugin-" + path.name.removeprefix("llmtrain-")

    @nox.session(name=name)
    def run(session: nox.Session) -> None:
        extra = [
            str(ROOT / dep) if dep.startswith(("plugins/", "integration_tests/")) else dep
            for dep in PLUGIN_TEST_DEPS.get(path.name, [])
        ]
        session.install(*CONSTRAINTS, *package_paths(*PACKAGES), str(path), *extra, *group("test"))
        ensure_programs(session)
        pytest(session, str(path / "tests"))

    return name


PLUGIN_SESSIONS = [make_plugin_session(Path(p)) for p in plugin_paths()]
# the major version of transformers other than the constraints' (5.x): llmtrain-hf reads and
# writes model directories of both
TRANSFORMERS_4 = "transformers>=4.57,<5"


@nox.session(name="plugin-hf-transformers4")
def plugin_hf_transformers4(session: nox.Session) -> None:
    """llmtrain-hf's tests (every architecture's parity with transformers among them) against
    transformers 4.x; `plugin-hf` runs them against the 5.x of the constraints. The damaged
    directories' refusals (marker `damage`) test llmtrain's readers, not transformers: they run
    in `plugin-hf` only."""
    path = ROOT / "plugins" / "llmtrain-hf"
    moe = str(ROOT / "plugins" / "llmtrain-moe")
    session.install(*CONSTRAINTS, *package_paths(*PACKAGES), str(path), moe, *group("test"))
    session.install(TRANSFORMERS_4)  # replaces the constrained 5.x (and its hub client)
    ensure_programs(session, tests_of="plugin-hf")
    session.run("python", "-c", "import transformers; assert transformers.__version__[0] == '4'")
    pytest(session, str(path / "tests"), "-m", "not damage")


@nox.session(
    python=False,
    requires=[
        "lint",
        "typecheck",
        *PACKAGES,
        *PLUGIN_SESSIONS,
        "plugin-hf-transformers4",
    ],
)
def units(session: nox.Session) -> None:
    """Every session of `tests` but integration and slurm: lint, typecheck, each package alone,
    each plugin with its tests. CI (.ci/run) runs it beside `integration`, one lane a core, and
    `slurm` beside both."""
    session.log("lint, typecheck and every package and plugin session passed")


@nox.session(python=False, requires=["units", "gpu-kit", "slurm", "integration"])
def tests(session: nox.Session) -> None:
    """The whole suite, one session after another: `units`, `gpu-kit`, `slurm`, then
    integration. CI runs them in three lanes side by side (.ci/run)."""
    session.log("lint, every package and plugin session and integration passed")


def install_for_users(session: nox.Session) -> None:
    """What a user installs (the root README's Install section) and the shared plugins: no
    test-only packages. And pip: nox makes venvs with uv, which puts no pip in them, so a user
    who activates the venv and runs the README's `pip install ./my-plugin` would get the
    system's pip, which installs elsewhere and cannot see the checkout's packages."""
    session.install(
        *CONSTRAINTS, "pip", *package_paths(*PACKAGES), str(ROOT), *plugin_paths(shared=True)
    )


@nox.session
def quickstart(session: nox.Session) -> None:
    """The main job on a fresh machine (see README): every plugin loads, then `llmtrain
    quickstart` makes a corpus, trains a tokenizer, packs, trains the tiny model on CPU,
    evaluates and samples, all in `quickstart/`, and prints the next steps, the first of them
    `source .nox/quickstart/bin/activate` (this session's venv, which nothing else puts on the
    user's PATH). Extra arguments go to the command (`nox -s quickstart -- --steps 100`)."""
    install_for_users(session)
    session.run("llmtrain", "plugins", "--check")
    session.run("llmtrain", "quickstart", "--dir", str(ROOT / "quickstart"), *session.posargs)


@nox.session(name="gpu-bundle", python=False)
def gpu_bundle(session: nox.Session) -> None:
    """The GPU kit's bundle (tools/gpu/bundle.sh): wheels of the llmtrain packages and plugins
    and of what the accelerator machine lacks, into .gpu-bundle/ (git-ignored) to carry there."""
    session.run("bash", str(ROOT / "tools" / "gpu" / "bundle.sh"), *session.posargs, external=True)
