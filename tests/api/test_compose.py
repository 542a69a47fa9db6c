"""docker-compose.yml and the Dockerfile, checked as data (no Docker engine runs the tests): the four
services from one image built here, PostgreSQL healthy before the API, the API published on loopback
only, no environment variable that nothing reads, one Ray cluster, and the image's pins and command."""

from __future__ import annotations

import json
import re
import shlex
from fnmatch import fnmatch
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
SERVICES = {"postgres", "api", "ray-head", "ray-worker"}
OURS = {"api", "ray-head", "ray-worker"}  # built from this repository's Dockerfile

# Variables outside advisor.settings.Settings that a container of our image may set, and who reads each.
EXTERNAL_ENV = {
    # Ray's auth mode for nodes and drivers; advisor.tune.driver._ray_init defaults it to "disabled"
    # only where it is unset, so the cluster's "token" reaches the API's jobs too.
    "RAY_AUTH_MODE": "ray",
    # Ray's cluster token, read by `ray start` and ray.init() when RAY_AUTH_MODE=token.
    "RAY_AUTH_TOKEN": "ray",
    # Ray's usage statistics switch (`ray start` reads it; advisor.tune.driver sets the same default).
    "RAY_USAGE_STATS_ENABLED": "ray",
    # The niceness a Ray node starts its workers at (Ray's default 15; advisor.tune.driver sets 0).
    "RAY_worker_niceness": "ray",
}
# Values for the variables compose requires (${VAR:?...}) when a test interpolates the file.
REQUIRED = {"ADVISOR_API_TOKEN": "api-token", "RAY_AUTH_TOKEN": "ray-token"}

_VAR = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's interpolation: ${V}, ${V:-default}, ${V-default}, ${V:?error}, ${V?error}; $$ is a $."""

    def one(m: re.Match) -> str:
        name, op, arg = m["name"], m["op"], m["arg"]
        have = env.get(name)
        unset = have is None or (have == "" and op is not None and op.startswith(":"))
        if op and op.endswith("?") and unset:
            raise KeyError(f"{name} is required: {arg}")
        if op and op.endswith("-") and unset:
            return arg
        return have or ""

    return "$".join(_VAR.sub(one, part) for part in value.split("$$"))


def load_compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # ["KEY=value", "KEY"] form
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def command(service: dict) -> str:
    cmd = service.get("command") or ""
    return " ".join(cmd) if isinstance(cmd, list) else cmd


def build_of(service: dict) -> tuple[Path, str] | None:
    build = service.get("build")
    if build is None:
        return None
    if isinstance(build, str):
        build = {"context": build}
    return (COMPOSE.parent / build.get("context", ".")).resolve(), build.get("dockerfile", "Dockerfile")


def known_variables() -> set[str]:
    from advisor.settings import Settings

    return {f"ADVISOR_{name.upper()}" for name in Settings.model_fields} | set(EXTERNAL_ENV)


# -- the services and the image -------------------------------------------------------------------

def test_four_services_from_one_image_built_here():
    services = load_compose()["services"]
    assert SERVICES <= set(services), f"missing services: {sorted(SERVICES - set(services))}"
    assert services["postgres"]["image"].startswith("postgres:16")
    images = set()
    for name in sorted(OURS):
        build = build_of(services[name])
        assert build is not None, f"{name} has no build section: it must run the image built from {DOCKERFILE.name}"
        context, dockerfile = build
        assert context == ROOT and (context / dockerfile) == DOCKERFILE, f"{name} builds {context / dockerfile}"
        images.add(services[name].get("image"))
    assert len(images) == 1 and None not in images, f"api and the Ray nodes must share one image tag, got {images}"


def test_api_waits_for_healthy_postgres_and_the_ray_head():
    services = load_compose()["services"]
    depends = services["api"].get("depends_on")
    assert isinstance(depends, dict), "api's depends_on needs the long form, with conditions"
    assert depends["postgres"]["condition"] == "service_healthy"
    assert depends["ray-head"]["condition"] == "service_healthy"
    assert services["ray-worker"]["depends_on"]["ray-head"]["condition"] == "service_healthy"
    for name in ("postgres", "ray-head"):  # service_healthy waits forever on a service with no healthcheck
        test = services[name].get("healthcheck", {}).get("test")
        assert test and test != ["NONE"], f"{name} has no healthcheck"
    assert "pg_isready" in " ".join(services["postgres"]["healthcheck"]["test"])


def _published(port) -> tuple[str | None, str]:  # noqa: ANN001 - a string or a mapping, as compose allows
    """(host ip or None for every interface, container port) of one `ports` entry."""
    if isinstance(port, dict):
        return port.get("host_ip"), str(port["target"])
    parts = str(port).split("/")[0].rsplit(":", 2)
    return (parts[0] if len(parts) == 3 else None), parts[-1]


def test_only_the_api_is_published_and_only_on_loopback():
    services = load_compose()["services"]
    for name, service in services.items():
        for port in service.get("ports", []):
            host_ip, _ = _published(port)
            assert host_ip in ("127.0.0.1", "::1"), f"{name} publishes {port!r} beyond loopback"
        assert name == "api" or not service.get("ports"), f"{name} publishes ports; only the API should"
    assert ("127.0.0.1", "8000") in [_published(p) for p in services["api"].get("ports", [])]


# -- environment ----------------------------------------------------------------------------------

def test_every_variable_set_on_our_image_is_one_the_code_reads():
    services, known = load_compose()["services"], known_variables()
    for name in sorted(OURS):
        assert "env_file" not in services[name], f"{name}: set variables inline, where this test can check them"
        unknown = sorted(set(environment(services[name])) - known)
        assert not unknown, (f"{name} sets {unknown}, which neither advisor.settings.Settings nor the "
                             f"allowlist in this test reads")
    unknown = sorted(k for k in dockerfile_env() if k.startswith("ADVISOR_") and k not in known)
    assert not unknown, f"the Dockerfile sets {unknown}, which advisor.settings.Settings does not read"


def test_environment_values_are_valid_settings(monkeypatch):
    from advisor.settings import Settings

    services = load_compose()["services"]
    for name in sorted(OURS):
        with monkeypatch.context() as m:
            for key, value in environment(services[name]).items():
                m.setenv(key, interpolate(value, REQUIRED))
            settings = Settings()  # raises if a value does not parse
        assert str(settings.data_dir) == "/data", name
    api = environment(services["api"])
    assert interpolate(api["ADVISOR_API_HOST"], REQUIRED) == "0.0.0.0"
    assert interpolate(api.get("ADVISOR_WORKLOAD_MODULES", ""), REQUIRED) == ""  # nothing allowed unless set


def test_the_tokens_are_required():
    services = load_compose()["services"]
    api = environment(services["api"])
    with pytest.raises(KeyError, match="ADVISOR_API_TOKEN"):
        interpolate(api["ADVISOR_API_TOKEN"], {})
    with pytest.raises(KeyError, match="ADVISOR_API_TOKEN"):  # set but empty is not a token either
        interpolate(api["ADVISOR_API_TOKEN"], {"ADVISOR_API_TOKEN": ""})
    assert interpolate(api["ADVISOR_API_TOKEN"], REQUIRED) == REQUIRED["ADVISOR_API_TOKEN"]


def test_database_url_is_the_compose_postgres_through_psycopg():
    from sqlalchemy.engine import make_url

    services = load_compose()["services"]
    pg = environment(services["postgres"])
    for env in (REQUIRED, {**REQUIRED, "POSTGRES_PASSWORD": "s3cret"}):
        urls = {name: interpolate(environment(services[name]).get("ADVISOR_DATABASE_URL", ""), env)
                for name in sorted(OURS)}
        # trials run on the Ray workers and write the store themselves: every node needs the URL
        assert all(urls.values()), f"services without ADVISOR_DATABASE_URL: {[n for n, u in urls.items() if not u]}"
        assert len(set(urls.values())) == 1, f"services disagree on the database: {urls}"
        url = make_url(urls["api"])
        assert url.drivername == "postgresql+psycopg"
        assert url.host == "postgres" and (url.port or 5432) == 5432
        assert url.username == interpolate(pg["POSTGRES_USER"], env)
        assert url.password == interpolate(pg["POSTGRES_PASSWORD"], env)
        assert url.database == interpolate(pg["POSTGRES_DB"], env)


# -- the Ray cluster ------------------------------------------------------------------------------

def test_one_ray_cluster_with_trials_on_the_workers():
    services = load_compose()["services"]
    head, worker, api = (command(services[n]) for n in ("ray-head", "ray-worker", "api"))
    port = re.search(r"--port[= ](\d+)", head)
    assert "ray start --head" in head and port, head
    address = f"ray-head:{port[1]}"
    assert f"--address={address}" in worker, worker
    assert interpolate(environment(services["api"])["ADVISOR_RAY_ADDRESS"], REQUIRED) == address
    # A CPU trial reserves every CPU of the cluster (advisor.tune.driver._resources), so the head and
    # the API's own node must bring none, or no node could ever hold that trial.
    assert "--num-cpus=0" in head
    # A Ray driver needs a node on its host: the API joins the cluster, resourceless, then serves.
    joined = re.search(r"ray start --address=\S+ (.*?)&& exec advisor serve --host 0\.0\.0\.0", api)
    assert joined and "--num-cpus=0" in joined[1] and "--num-gpus=0" in joined[1], api
    for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):  # nodes and drivers must agree or refuse each other
        values = {interpolate(environment(services[n]).get(key, ""), REQUIRED) for n in OURS}
        assert len(values) == 1, f"{key} differs between the Ray nodes: {values}"
    assert environment(services["api"])["RAY_AUTH_MODE"] == "token"
    # The trials run in the worker node's workers: at Ray's default niceness (15) they would yield
    # the CPU to everything else on the node and measure that.
    assert environment(services["ray-worker"]).get("RAY_worker_niceness") == "0"


def test_gpu_reservation_block_is_valid_once_uncommented():
    lines = COMPOSE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "# deploy:")
    end = start
    while end < len(lines) and re.match(r"^\s*# ", lines[end]):
        end += 1
    uncommented = lines[:start] + [re.sub(r"^(\s*)# ", r"\1", ln) for ln in lines[start:end]] + lines[end:]
    worker = yaml.safe_load("\n".join(uncommented))["services"]["ray-worker"]
    device = worker["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]


# -- the Dockerfile -------------------------------------------------------------------------------

def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(ln for ln in DOCKERFILE.read_text().splitlines()
                                          if not ln.lstrip().startswith("#")))
    out = []
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def dockerfile_env() -> dict[str, str]:
    env = {}
    for word, rest in dockerfile_instructions():
        if word == "ENV":
            tokens = shlex.split(rest)
            if "=" not in tokens[0]:  # legacy `ENV KEY value`
                tokens = [f"{tokens[0]}={' '.join(tokens[1:])}"]
            env.update(t.split("=", 1) for t in tokens)
    return env


def _exec_form(rest: str) -> list[str]:
    return json.loads(rest) if rest.startswith("[") else shlex.split(rest)


def test_dockerfile_pins_torch_first_and_serves_on_all_interfaces():
    steps = dockerfile_instructions()
    assert steps[0][0] == "FROM" and steps[0][1].startswith("python:3.11-slim")
    pin = re.search(r"^TORCH \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M)[1]
    assert pin == "torch==2.13.0"
    runs = [rest for word, rest in steps if word == "RUN"]
    torch = next((i for i, r in enumerate(runs) if "pip install" in r and pin in r.replace('"', "")), None)
    package = next((i for i, r in enumerate(runs) if re.search(r"pip install \.(\s|$)", r)), None)
    assert torch is not None, f"no RUN installs {pin}"
    assert package is not None and torch < package, "torch must be installed before the package"
    assert re.search(r"--index-url \"?\$\{?TORCH_INDEX\}?", runs[torch]), runs[torch]
    args = dict(rest.split("=", 1) for word, rest in steps if word == "ARG" and "=" in rest)
    assert args["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"
    users = [rest for word, rest in steps if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the image must run as a non-root user"
    assert dockerfile_env()["ADVISOR_DATA_DIR"] == "/data"
    assert any("/data" in _exec_form(rest) for word, rest in steps if word == "VOLUME")
    assert any("8000" in rest.split() for word, rest in steps if word == "EXPOSE")
    last = {word: _exec_form(rest) for word, rest in steps if word in ("CMD", "ENTRYPOINT")}
    argv = last.get("ENTRYPOINT", []) + last.get("CMD", [])
    assert argv[:2] == ["advisor", "serve"] and "--host 0.0.0.0" in " ".join(argv), argv


def test_the_image_has_the_compilers_compiled_trials_and_the_heap_replay_need():
    """torch.compile's CPU backend builds with g++ and the estimator's heap logger with cc: the slim base
    image has neither, so a RUN installs them (without recommends, the apt lists removed in that layer)."""
    runs = [rest for word, rest in dockerfile_instructions() if word == "RUN"]
    apt = next((r for r in runs if "apt-get install" in r), None)
    assert apt is not None, "no RUN installs a compiler"
    packages = set(apt.split("apt-get install", 1)[1].split("&&")[0].split())
    assert {"g++", "libc6-dev"} <= packages and "--no-install-recommends" in packages, apt
    assert "rm -rf /var/lib/apt/lists/*" in apt, "the apt lists must go in the same layer"
    assert runs.index(apt) < next(i for i, r in enumerate(runs) if re.search(r"pip install \.(\s|$)", r))


def test_dockerignore_keeps_environments_out_and_the_build_inputs_in():
    patterns = [ln.strip().rstrip("/") for ln in (ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    for needed in (".venv", ".data", ".git"):
        assert needed in patterns, f".dockerignore does not exclude {needed}"
    for path in ("pyproject.toml", "README.md", "advisor/__init__.py", "api/__init__.py", "probes/__init__.py",
                 "search_spaces/__init__.py", "search_spaces/presets/quick.yaml"):  # what `pip install .` reads
        hits = [p for p in patterns if not p.startswith("!") and (fnmatch(path, p) or fnmatch(path.split("/")[0], p))]
        assert not hits, f".dockerignore drops {path} (by {hits}), which the image build needs"


# -- the README -----------------------------------------------------------------------------------

def test_required_variables_are_documented_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    section = readme.partition("\n## Running the service\n")[2].split("\n## ")[0]
    assert section, "README.md has no '## Running the service' section"
    required = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*):?\?", COMPOSE.read_text()))
    assert "ADVISOR_API_TOKEN" in required
    missing = sorted(v for v in required if v not in section)
    assert not missing, f"docker-compose.yml requires {missing}, which README.md's 'Running the service' omits"
    assert "docker compose up --build" in section
