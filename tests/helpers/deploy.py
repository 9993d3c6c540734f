"""deploy/ as the tests read it: Dockerfiles, the compose file, the Kubernetes manifests, the
dashboard and the Prometheus configuration, and the real CLI parsing a container's command line with
its environment (no Docker engine needed)."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]

DEPLOY = ROOT / "deploy"

PROMETHEUS_DIR = DEPLOY / "prometheus"

DASHBOARD = DEPLOY / "grafana" / "dashboards" / "tandem.json"


def prometheus_required() -> bool:
    """.ci/run sets TANDEM_REQUIRE_PROMETHEUS=1: there the tests that need promtool or prometheus
    fail when it is missing; elsewhere they skip."""
    return os.environ.get("TANDEM_REQUIRE_PROMETHEUS", "").strip() not in {"", "0"}


def require_tool(name: str) -> str:
    """The path of `name` (promtool, prometheus); skip without it, or fail where it is required."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} not found (Debian package `prometheus`; .ci/run installs it)"
        if prometheus_required():
            pytest.fail(f"{message}, and TANDEM_REQUIRE_PROMETHEUS is set", pytrace=False)
        pytest.skip(message)
    return path


@dataclass
class Dockerfile:
    path: Path
    instructions: list[tuple[str, str]]

    def values(self, name: str) -> list[str]:
        return [rest for instruction, rest in self.instructions if instruction == name]

    def exec_form(self, name: str) -> list[str]:
        """ENTRYPOINT / CMD as a JSON array (the exec form); [] when absent."""
        found = self.values(name)
        if not found:
            return []
        value = json.loads(found[-1])
        assert isinstance(value, list), f"{self.path.name}: {name} is not in exec form"
        return value

    @property
    def env(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for rest in self.values("ENV"):
            words = shlex.split(rest)
            if "=" not in words[0]:  # the legacy form: ENV KEY value
                env[words[0]] = " ".join(words[1:])
                continue
            for word in words:
                key, _, value = word.partition("=")
                env[key] = value
        return env

    @property
    def exposed(self) -> set[int]:
        return {int(p.split("/")[0]) for rest in self.values("EXPOSE") for p in rest.split()}

    @property
    def healthcheck(self) -> list[str]:
        (rest,) = self.values("HEALTHCHECK")
        return json.loads(rest.split("CMD", 1)[1])


def parse_dockerfile(path: Path) -> Dockerfile:
    instructions, pending = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        instruction, _, rest = line.partition(" ")
        instructions.append((instruction.upper(), rest.strip()))
    return Dockerfile(path, instructions)


def dockerfile(verb: str) -> Dockerfile:
    return parse_dockerfile(DEPLOY / f"{verb}.Dockerfile")


def tandem_command() -> list[str]:
    """`tandem` as installed with this interpreter, or the same entry point through `-m`."""
    script = Path(sys.executable).with_name("tandem")
    return [str(script)] if script.exists() else [sys.executable, "-m", "client.cli"]


def load_prometheus_config() -> dict:
    return yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())


PROMQL_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
}

_LABEL_LISTS = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')

_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def promql_metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords, label
    names (in `{...}` matchers or `by (...)` lists), durations or numbers."""
    expr = _STRINGS.sub('""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range / subquery durations
    expr = _LABEL_LISTS.sub(" ", expr)
    names = set()
    for m in _IDENT.finditer(expr):
        before = expr[m.start() - 1] if m.start() else " "
        after = expr[m.end() :].lstrip()
        if before.isdigit() or before == ".":  # 1e3, 0.5
            continue
        if after.startswith("(") or m.group() in PROMQL_KEYWORDS:
            continue
        names.add(m.group())
    return names


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels(dashboard: dict | None = None) -> list[dict]:
    """Every panel, with those nested in rows (a collapsed row holds its panels in `panels`)."""

    def walk(panels: list[dict]) -> Iterator[dict]:
        for panel in panels:
            yield panel
            yield from walk(panel.get("panels", []))

    return list(walk((dashboard or load_dashboard())["panels"]))


def dashboard_queries(dashboard: dict | None = None) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query of every panel."""
    return [(p["title"], t["expr"]) for p in dashboard_panels(dashboard) for t in p.get("targets", [])]


VERBS = ("executor", "scheduler")

THIRD_PARTY_IMAGES = {"prom/prometheus", "grafana/grafana"}

PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def image_of(verb: str) -> str:
    """The name each Dockerfile's image is built and referenced under."""
    return f"tandem-{verb}"


def image_name(image: str) -> str:
    """registry/name:tag -> name (what kustomize's `images:` matches on)."""
    return image.rsplit("/", 1)[-1].split(":")[0]


class _RecordingEnviron(dict):
    """os.environ stand-in that remembers every variable looked up."""

    def __init__(self, values: dict[str, str]) -> None:
        super().__init__(values)
        self.read: set[str] = set()
        self.log: list[str] = []  # every lookup, in order

    def _record(self, key) -> None:
        self.read.add(key)
        self.log.append(key)

    def get(self, key, default=None):
        self._record(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self._record(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self._record(key)
        return super().__contains__(key)


def _with_environ(env: dict[str, str], fn):
    recording, saved = _RecordingEnviron(env), os.environ
    os.environ = recording  # noqa: B003 (only lookups are replaced, nothing is exported)
    try:
        return fn(), recording.read
    finally:
        os.environ = saved  # noqa: B003


def parse_tandem(argv: list[str], env: dict[str, str]) -> argparse.Namespace:
    """`tandem argv...` parsed by the real CLI with `env` as the whole environment."""
    from client.cli import build_parser

    parser, _ = _with_environ(env, lambda: build_parser(argv))
    return parser.parse_args(argv)


def parse_service_args(verb: str, argv: list[str], env: dict[str, str]) -> argparse.Namespace:
    return parse_tandem([verb, *argv], env)


def cli_env_names(verb: str) -> set[str]:
    """The TANDEM_* variables `tandem <verb>` reads: its own flags' twins and the global ones."""
    from client.cli import build_parser

    module = importlib.import_module(f"{verb}_service.cli")
    _, own = _with_environ({}, lambda: module.add_arguments(argparse.ArgumentParser()))
    _, everything = _with_environ({}, lambda: build_parser([verb]))
    global_names = {"TANDEM_LOG_LEVEL"} & everything
    return {n for n in own | global_names if n.startswith("TANDEM_")}


def flag_environment(verb: str) -> dict[str, tuple[argparse.Action, list[str]]]:
    """option string -> (its action, the TANDEM_* variables read for it), for every flag of
    `tandem <verb>`: its own (`add_arguments`) and the global ones of `tandem`. A variable counts
    for the flag whose add_argument call follows the lookup (a default is evaluated just before)."""
    from client.cli import build_parser

    reads: dict[argparse.Action, list[str]] = {}
    original = argparse._ActionsContainer.add_argument
    recording = _RecordingEnviron({})
    consumed = 0

    def add_argument(self, *args, **kwargs):
        nonlocal consumed
        action = original(self, *args, **kwargs)
        reads[action] = [n for n in recording.log[consumed:] if n.startswith("TANDEM_")]
        consumed = len(recording.log)
        return action

    saved = os.environ
    argparse._ActionsContainer.add_argument = add_argument
    os.environ = recording  # noqa: B003 (only lookups are replaced, nothing is exported)
    try:
        parser = build_parser([verb])
    finally:
        os.environ = saved  # noqa: B003
        argparse._ActionsContainer.add_argument = original
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    actions = [a for a in parser._actions + subparsers.choices[verb]._actions if a.option_strings]
    return {a.option_strings[0]: (a, reads[a]) for a in actions}


def _env_value(action: argparse.Action, default):
    """A value for the flag's variable that differs from its default: (text, parsed value)."""
    if action.nargs == 0:  # store_true / store_false / a switch on by default (--no-NAME)
        return ("0" if default else "1"), not default
    if action.choices:
        choice = next(c for c in action.choices if c != default)
        return str(choice), choice
    if action.type is int:
        return "7", 7
    if action.type is float:
        return "7.5", 7.5
    assert action.type is None, f"{action.option_strings}: no test value for type {action.type}"
    return "/srv/from-the-environment", "/srv/from-the-environment"


@dataclass
class Container:
    layout: str  # "compose", "k8s" (one pair) or "k8s/replicas" (a pair per pod)
    where: str  # "compose:executor", "k8s/executor.yaml:tandem-executor/executor"
    verb: str
    image: str
    env: dict[str, str]  # set by compose / Kubernetes (the Dockerfile's ENV not included)
    argv: list[str]  # after the Dockerfile's ENTRYPOINT
    ports: set[int]
    raw: dict = field(repr=False, default_factory=dict)
    pod: dict = field(repr=False, default_factory=dict)  # Kubernetes: the pod spec
    pod_metadata: dict = field(repr=False, default_factory=dict)  # and its labels, annotations

    @property
    def full_env(self) -> dict[str, str]:
        return {**dockerfile(self.verb).env, **self.env}

    def args(self) -> argparse.Namespace:
        return parse_service_args(self.verb, self.argv, self.full_env)


def load_compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def compose_containers() -> list[Container]:
    containers = []
    for name, service in load_compose()["services"].items():
        if image_name(service["image"]).split("/")[-1] not in {image_of(v) for v in VERBS}:
            continue
        verb = image_name(service["image"]).removeprefix("tandem-")
        docker = dockerfile(verb)
        command = service.get("command", docker.exec_form("CMD"))
        command = shlex.split(command) if isinstance(command, str) else command
        ports = {int(str(p).split("/")[0]) for p in service.get("expose", [])}
        ports |= {int(str(p).split(":")[-1].split("/")[0]) for p in service.get("ports", [])}
        env = {k: str(v) for k, v in (service.get("environment") or {}).items()}
        containers.append(
            Container("compose", f"compose:{name}", verb, service["image"], env, command, ports, service)
        )
    return containers


def k8s_documents() -> Iterator[tuple[Path, dict]]:
    for path in sorted((DEPLOY / "k8s").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield path, doc


def _k8s_env_value(entry: dict) -> str:
    """A variable's value, or for one from a Secret `secret:<name>/<key>` (what the CLI then sees)."""
    if "value" in entry:
        return str(entry["value"])
    ref = entry["valueFrom"]["secretKeyRef"]
    return f"secret:{ref['name']}/{ref['key']}"


def k8s_containers() -> list[Container]:
    containers = []
    for path, doc in k8s_documents():
        if doc["kind"] != "Deployment":
            continue
        pod = doc["spec"]["template"]["spec"]
        for c in pod.get("initContainers", []) + pod["containers"]:
            verb = image_name(c["image"]).removeprefix("tandem-")
            assert verb in VERBS, f"{path.name}: {c['name']} runs {c['image']}, not an image of deploy/"
            assert "command" not in c, f"{path.name}: {c['name']} replaces the Dockerfile's ENTRYPOINT"
            env = {e["name"]: _k8s_env_value(e) for e in c.get("env", [])}
            argv = c.get("args", dockerfile(verb).exec_form("CMD"))
            ports = {p["containerPort"] for p in c.get("ports", [])}
            where = f"k8s/{path.relative_to(DEPLOY / 'k8s')}:{doc['metadata']['name']}/{c['name']}"
            metadata = doc["spec"]["template"]["metadata"]
            layout = str(path.parent.relative_to(DEPLOY))
            containers.append(Container(layout, where, verb, c["image"], env, argv, ports, c, pod, metadata))
    return containers


ALL_CONTAINERS = compose_containers() + k8s_containers()


def _secret_source(container: Container, variable: str) -> str | None:
    """Where the container's `variable` comes from when it is a secret: the Kubernetes Secret key
    (`secret:<name>/<key>`), or the compose variable that must be set (`${NAME:?...}`, no default);
    None for a literal or for nothing."""
    value = container.env.get(variable)
    if value is None:
        return None
    if container.layout == "compose":
        match = re.fullmatch(r"\$\{(\w+):\?[^}]*\}", value)
        return f"compose:${match.group(1)}" if match else None
    return value if value.startswith("secret:") else None


def health_probe_port(verb: str, env: dict[str, str]) -> int:
    """The port deploy/healthcheck.py checks for `verb` in a container with `env`."""
    spec = importlib.util.spec_from_file_location("tandem_healthcheck", DEPLOY / "healthcheck.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    name, default = module.PORTS[verb]
    return int(env.get(name, default))


def grace_seconds(container: Container) -> float:
    """What the container's `--grace` is set to (the flag's dest differs between CLI versions)."""
    parser = argparse.ArgumentParser()
    importlib.import_module(f"{container.verb}_service.cli").add_arguments(parser)
    (action,) = [a for a in parser._actions if "--grace" in a.option_strings]
    return getattr(container.args(), action.dest)


def compile_dockerignore(lines: list[str]) -> list[tuple[bool, re.Pattern]]:
    """(re-included, regex) for each pattern of a .dockerignore, as Docker's patternmatcher reads
    it: `**` any number of directories, `*` and `?` within one path element, `!` re-includes."""
    patterns = []
    for raw in lines:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        line = posixpath.normpath(line.removeprefix("!").strip()).lstrip("/")
        assert "[" not in line and "\\" not in line, f"character classes are not modelled: {line}"
        regex = ""
        for part in re.split(r"(\*\*/|\*\*|\*|\?)", line):
            regex += {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}.get(part, re.escape(part))
        patterns.append((negated, re.compile(regex)))
    return patterns


def dockerignore_patterns(verb: str) -> list[tuple[bool, re.Pattern]]:
    """deploy/<verb>.Dockerfile.dockerignore, which BuildKit reads instead of the context's."""
    return compile_dockerignore((DEPLOY / f"{verb}.Dockerfile.dockerignore").read_text().splitlines())


def dockerignored(path: str, patterns: list[tuple[bool, re.Pattern]]) -> bool:
    """Whether the build context leaves `path` out: Docker's rule, the last pattern that matches the
    path or one of its parent directories decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for negated, regex in patterns:
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            excluded = not negated
    return excluded


def copy_instructions(verb: str) -> list[tuple[list[str], str, bool]]:
    """(sources in the build context, absolute destination, destination is a directory) for each
    COPY of deploy/<verb>.Dockerfile, with WORKDIR applied."""
    workdir, copies = "/", []
    for instruction, rest in dockerfile(verb).instructions:
        if instruction == "WORKDIR":
            workdir = posixpath.join(workdir, rest)
        elif instruction == "COPY":
            words = shlex.split(rest)
            flags = [w for w in words if w.startswith("--")]
            assert not [f for f in flags if f.startswith("--from")], f"{verb}: COPY --from is not modelled"
            *sources, dest = [w for w in words if not w.startswith("--")]
            is_dir = dest.endswith("/") or len(sources) > 1
            copies.append((sources, posixpath.normpath(posixpath.join(workdir, dest)), is_dir))
    return copies


def image_files(verb: str) -> dict[str, Path]:
    """Path in the image -> file of this checkout, for everything the Dockerfile's COPY lines put
    in the image, after the Dockerfile's .dockerignore (what `docker build` would send)."""
    patterns = dockerignore_patterns(verb)
    files: dict[str, Path] = {}
    for sources, dest, dest_is_dir in copy_instructions(verb):
        for source in sources:
            path = ROOT / source
            assert path.exists(), f"{verb}.Dockerfile copies {source}, which does not exist"
            if path.is_dir():  # its contents, into dest
                for f in sorted(path.rglob("*")):
                    relative = f.relative_to(ROOT).as_posix()
                    if f.is_file() and not dockerignored(relative, patterns):
                        files[posixpath.join(dest, f.relative_to(path).as_posix())] = f
            else:
                assert not dockerignored(source, patterns), f"{source}: left out of the context"
                files[posixpath.join(dest, path.name) if dest_is_dir else dest] = path
    return files


def repository_files(source: str) -> list[str]:
    """The files of the repository under `source` (git's list; without git, those on disk)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--", source], cwd=ROOT, capture_output=True, text=True, check=True
        )
        return [f for f in out.stdout.split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        path = ROOT / source
        files = sorted(path.rglob("*")) if path.is_dir() else [path]
        return [f.relative_to(ROOT).as_posix() for f in files if f.is_file() and "__pycache__" not in f.parts]


def image_distributions() -> set[str]:
    """The distributions `pip install .` (no extras) puts in the scheduler image: pyproject's
    dependencies and theirs, as installed here."""
    import importlib.metadata as metadata

    import tomllib
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pending = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    seen: set[str] = set()
    while pending:
        requirement = Requirement(pending.pop())
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(requirement.name)
        if name not in seen:
            seen.add(name)
            pending.extend(metadata.requires(name) or [])
    return seen


def image_top_level_modules() -> set[str]:
    import importlib.metadata as metadata

    from packaging.utils import canonicalize_name

    distributions = image_distributions()
    return {
        module
        for module, dists in metadata.packages_distributions().items()
        if any(canonicalize_name(d) in distributions for d in dists)
    }


IMAGE_SCRIPT = r"""
import importlib, importlib.abc, json, pkgutil, sys
from pathlib import Path

allowed, packages, repository, code, argv = json.loads(sys.argv[1])
allowed = set(allowed) | set(packages) | set(sys.stdlib_module_names)


class OnlyTheImage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        # _sysconfigdata_*: the stdlib's build variables (sysconfig, which pydantic imports).
        if name.split(".")[0] not in allowed and not name.startswith("_sysconfigdata_"):
            raise ModuleNotFoundError(f"No module named {name!r} (not in the image)", name=name)
        return None


sys.meta_path.insert(0, OnlyTheImage())
sys.argv = argv
from client.cli import main

try:
    status = main()
except SystemExit as e:
    status = e.code
assert status == 0, f"{argv} exited {status}"
for package in packages:
    module = importlib.import_module(package)
    for info in pkgutil.walk_packages(module.__path__, package + "."):
        if not info.name.endswith(".__main__"):
            importlib.import_module(info.name)
ours = {p.name for p in Path(repository).iterdir() if (p / "__init__.py").is_file()}
outside = sorted(
    name
    for name, module in list(sys.modules.items())
    if name.split(".")[0] in ours
    and not Path(getattr(module, "__file__", None) or code).resolve().is_relative_to(code)
)
assert not outside, f"imported from outside the image's code: {outside}"
assert "torch" not in sys.modules and "executor_service" not in sys.modules
# The embedded model's tokenizer, which the scheduler uses when the executor serves that model.
from client.defaults import DEFAULT_MODEL
from scheduler_service.tokenizer import Tokenizer

assert Path(DEFAULT_MODEL).resolve().is_relative_to(code), DEFAULT_MODEL
assert Tokenizer(DEFAULT_MODEL).decode(Tokenizer(DEFAULT_MODEL).encode("The list type")) == "The list type"
print("image ok")
"""


def k8s_services() -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for _, doc in k8s_documents() if doc["kind"] == "Service"}


def service_selects(service: dict, container: Container) -> bool:
    labels = container.pod_metadata["labels"]
    return all(labels.get(k) == v for k, v in service["spec"]["selector"].items())


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], cwd=PROMETHEUS_DIR, capture_output=True, text=True, timeout=60)


PROMETHEUS_SERIES = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}

_TYPE_SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "untyped": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
}


def exposed_names(text: str) -> set[str]:
    """The sample names of a /metrics text exposition, parsed by prometheus_client. A labelled
    family with no children yet (a counter of failures before the first one) has its # TYPE line
    but no sample: it counts with the names its type gives."""
    from prometheus_client.parser import text_string_to_metric_families

    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        implied = {family.name + suffix for suffix in _TYPE_SUFFIXES[family.type]}
        samples = {s.name for s in family.samples}
        assert samples <= implied, (family.name, family.type, samples)  # what `implied` relies on
        names |= samples or implied
    return names


@functools.cache
def service_metric_names() -> dict[str, set[str]]:
    """verb -> the sample names in the exposition of that service's metrics registry, built in
    this process the way each server builds it (no server, no Prometheus)."""
    from prometheus_client import generate_latest

    from executor_service.metrics import ExecutorMetrics
    from scheduler_service.metrics import SchedulerMetrics

    return {
        "scheduler": exposed_names(generate_latest(SchedulerMetrics().registry).decode()),
        "executor": exposed_names(generate_latest(ExecutorMetrics().registry).decode()),
    }


def alert_rule_exprs() -> list[tuple[str, str]]:
    rules = yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())
    return [(r.get("alert") or r["record"], r["expr"]) for g in rules["groups"] for r in g["rules"]]


QUERIES = [pytest.param(e, id=f"panel {title}") for title, e in dashboard_queries()] + [
    pytest.param(e, id=f"alert {name}") for name, e in alert_rule_exprs()
]
