"""docker/: checked statically on every run (building an image takes minutes and a container builder; the CPU
image was built and run once with buildah: docker/README.md).

- Each Dockerfile parses with BuildKit's own parser (the `dockerfile` package wraps it), and installs only through
  make targets that CI's `make test` builds: `make -n` of the image's call (with its variables) shows those
  variables in the commands, and the same target with CI's defaults is exactly the start of what CI runs.
- The image puts the venv that target makes on PATH and exposes the CLI's default ports.
- docker/compose.yaml is valid against the Compose Specification's JSON schema (tests/fixtures/compose-spec.json,
  compose-spec/compose-spec@170098b), and its WebUI command is parsed by rlfactory's own CLI parser: the port it
  listens on is the one published, the password file is the mounted secret, runs go to the mounted outputs folder
  inside the workspace.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from tests.conftest import ROOT

dockerfile = pytest.importorskip("dockerfile", reason="the Dockerfile parser (dev extra: pip install dockerfile)")
DOCKER = ROOT / "docker"
IMAGES = {"Dockerfile.cpu": "install", "Dockerfile.cuda": "vllm-venv"}  # the make target each image installs with
CI_TARGET = {"install": "test-main", "vllm-venv": "test-vllm"}  # what CI runs that builds it first
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def instructions(name: str) -> list:
    return list(dockerfile.parse_file(str(DOCKER / name)))


def make_calls(name: str) -> list[list[str]]:
    """Every `make ...` in the image's RUN lines, its ARG defaults filled in."""
    args = dict(i.value[0].split("=", 1) for i in instructions(name) if i.cmd == "ARG" and "=" in i.value[0])
    calls = []
    for run in (i for i in instructions(name) if i.cmd == "RUN"):
        text = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], run.value[0])
        calls += [shlex.split(part) for part in text.split("&&") if shlex.split(part)[:1] == ["make"]]
    return calls


def dry_run(*argv: str) -> list[str]:
    # a clean make: under `make test` the outer make's MAKEFLAGS/MAKELEVEL would add "Entering directory" lines and
    # pass its own variables down
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "MFLAGS"))}
    result = subprocess.run(
        ["make", "-n", "-B", *argv], cwd=ROOT, capture_output=True, text=True, check=True, env=env
    )
    return [line for line in result.stdout.splitlines() if not line.startswith("#")]


def cli_defaults(*argv: str):
    from rlfactory.cli import _parser

    return _parser().parse_args(list(argv))


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_image_installs_through_ci_make_targets(name: str) -> None:
    (call,) = make_calls(name)
    targets = [a for a in call[1:] if "=" not in a]
    assigned = dict(a.split("=", 1) for a in call[1:] if "=" in a)
    assert targets == [IMAGES[name]]
    makefile = (ROOT / "Makefile").read_text()
    for variable in assigned:  # make ignores a variable it does not use: each must be one the Makefile reads
        assert re.search(rf"^{variable} \?=", makefile, re.M), f"{name}: the Makefile has no '{variable} ?='"
    image = dry_run(*call[1:])
    for value in assigned.values():
        assert any(value in line for line in image), f"{name}: {value} is in no command of {call}"
    ci = dry_run(CI_TARGET[targets[0]])
    with_defaults = dry_run(targets[0])
    assert ci[: len(with_defaults)] == with_defaults  # CI's target starts by building exactly this
    assert re.search(rf"^test: .*\n(\t.*\n)*.*{CI_TARGET[targets[0]]}", makefile, re.M)  # and `make test` runs it
    assert "make test" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_image_runs_the_installed_venv(name: str) -> None:
    steps = instructions(name)
    workdir = [i.value[0] for i in steps if i.cmd == "WORKDIR"][-1]
    venv = dry_run(IMAGES[name])[0].split()[-1]  # `python3 -m venv DIR`
    env = dict(zip(*[iter(next(i.value for i in steps if i.cmd == "ENV" and "PATH" in i.value))] * 2, strict=True))
    assert env["PATH"].split(":")[0] == f"{workdir}/{venv}/bin"
    assert [i.value for i in steps if i.cmd == "COPY"] == [(".", ".")]
    exposed = {int(p) for i in steps if i.cmd == "EXPOSE" for p in i.value}
    assert exposed == {cli_defaults("webui").port, cli_defaults("serve", "x").port}
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".venv-*", "outputs", ".git"} <= set(ignored)  # a copied venv stamp would skip the install


def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def test_compose_file_is_valid_against_the_spec() -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="dev extra: pip install jsonschema")
    schema = json.loads((ROOT / "tests" / "fixtures" / "compose-spec.json").read_text())
    jsonschema.Draft7Validator(schema).validate(compose())
    with pytest.raises(jsonschema.ValidationError):  # the schema does refuse a wrong key
        jsonschema.Draft7Validator(schema).validate({"services": {"webui": {"portz": ["1:1"]}}})
    services = compose()["services"]
    assert set(services) == {"webui", "webui-cuda"}
    for service in services.values():
        assert (DOCKER / service["build"]["context"]).resolve() == ROOT
        assert service["build"]["dockerfile"] in {f"docker/{name}" for name in IMAGES}
    assert services["webui-cuda"]["profiles"] == ["cuda"]
    assert services["webui-cuda"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


@pytest.mark.parametrize("service", ["webui", "webui-cuda"])
def test_compose_webui_matches_the_cli(service: str) -> None:
    from rlfactory.errors import UserError
    from rlfactory.webui.security import check_exposure

    spec, top = compose()["services"][service], compose()
    command = spec["command"]
    assert command[0] == "rlfactory"
    args = cli_defaults(*command[1:])
    assert args.command == "webui"
    (published,) = spec["ports"]
    host_ip, host_port, container_port = published.split(":")
    assert int(container_port) == args.port and host_ip == "127.0.0.1"
    with pytest.raises(UserError, match="password"):  # 0.0.0.0 in the container: the WebUI refuses it bare
        check_exposure(args.host, args.share, None, args.insecure)
    assert not args.insecure and not args.auth
    (secret,) = spec["secrets"]
    assert args.auth_file == f"/run/secrets/{secret}"
    assert Path(top["secrets"][secret]["file"].split(":-")[-1].rstrip("}")).name in (ROOT / ".gitignore").read_text()
    mounts = {volume.split(":")[-2] if volume.endswith(":ro") else volume.split(":")[-1] for volume in spec["volumes"]}
    workdir = [i.value[0] for i in instructions(Path(spec["build"]["dockerfile"]).name) if i.cmd == "WORKDIR"][-1]
    assert args.workspace == workdir and f"{args.workspace}/outputs" in mounts
    assert set(args.allow_read) <= mounts
    assert str(args.port) in spec["healthcheck"]["test"][-1]
