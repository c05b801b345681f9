"""Checks on the deployment artifacts (Helm chart, compose files), shared by the tests/test_deploy_*.py files.

Every check is a function that returns a list of problems (empty = fine), so the positive tests assert an
empty list for each shipped layout and the negative tests feed a deliberately broken object and assert the
check names the problem. Nothing here needs a cluster, a Docker daemon or the network:

* the chart is linted and rendered by Helm's own Go code through ``helm-python-sdk`` (a bundled shared
  library, no ``helm`` binary);
* rendered manifests are validated against the Kubernetes OpenAPI schemas shipped in
  ``kubernetes-validate``;
* compose files are validated against the compose-spec JSON schema bundled with ``check-jsonschema``.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import yaml

from services.common.deploy_profile import DeployProfile, load_profile, parse_profile

REPO = Path(__file__).resolve().parents[1]
CHART_DIR = REPO / "helm" / "minicpmo"
STAGES = ("thinker", "talker", "code2wav")
COMPONENT_LABEL = "app.kubernetes.io/component"
# Oldest Kubernetes the chart supports (Chart.yaml kubeVersion: native gRPC probes are GA in 1.27) and the
# newest schema kubernetes-validate ships.
KUBE_VERSIONS = ("1.27.0", "1.37.0")
# Kubernetes resource a stage requests when it shares a GPU with another stage (device-plugin
# time-slicing with renamed resources); a stage with a card to itself requests nvidia.com/gpu.
SHARED_GPU_RESOURCE = "nvidia.com/gpu.shared"
EXCLUSIVE_GPU_RESOURCE = "nvidia.com/gpu"


@dataclass(frozen=True)
class Layout:
    """One deployment layout: its deploy profile, Helm values file and compose override file."""

    name: str
    profile: str
    values_file: Path
    compose_files: tuple[Path, ...]


LAYOUTS: dict[str, Layout] = {
    "1gpu": Layout(
        "1gpu",
        "minicpmo_4_5",
        CHART_DIR / "values-1gpu.yaml",
        (REPO / "docker-compose.yml", REPO / "docker-compose.override.yml"),
    ),
    "2gpu": Layout(
        "2gpu",
        "minicpmo_4_5_2gpu",
        CHART_DIR / "values-2gpu.yaml",
        (REPO / "docker-compose.yml", REPO / "compose" / "2gpu.yml"),
    ),
    "3gpu": Layout(
        "3gpu",
        "minicpmo_4_5_3gpu",
        CHART_DIR / "values-3gpu.yaml",
        (REPO / "docker-compose.yml", REPO / "compose" / "3gpu.yml"),
    ),
    "8x4090": Layout(
        "8x4090",
        "minicpmo_4_5_8x4090",
        CHART_DIR / "values-8x4090.yaml",
        (REPO / "docker-compose.yml", REPO / "compose" / "8x4090.yml"),
    ),
    "cpu": Layout(
        "cpu",
        "cpu",
        CHART_DIR / "values-cpu.yaml",
        (REPO / "docker-compose.yml", REPO / "compose" / "cpu.yml"),
    ),
    # the 1-GPU layout with the mutual-TLS add-on: every layout check must hold for it too
    "1gpu-tls": Layout(
        "1gpu-tls",
        "minicpmo_4_5",
        CHART_DIR / "values-1gpu.yaml",
        (REPO / "docker-compose.yml", REPO / "docker-compose.override.yml", REPO / "compose" / "tls.yml"),
    ),
    # the 1-GPU layout with the MPS add-on (an MPS control daemon service; the stages as its clients)
    "1gpu-mps": Layout(
        "1gpu-mps",
        "minicpmo_4_5",
        CHART_DIR / "values-1gpu.yaml",
        (REPO / "docker-compose.yml", REPO / "docker-compose.override.yml", REPO / "compose" / "mps.yml"),
    ),
}


# ------------------------------------------------------------------------------------------------------
# What a profile implies for one replica of each stage


@dataclass(frozen=True)
class StagePlacement:
    replicas: int
    device: str  # "cpu" or "cuda": what the stage CLI gets as --device inside its container
    gpus_per_replica: int
    shares_gpu: bool  # some device of this stage is also used by another stage (or replica)
    gpu_indices: tuple[int, ...]  # host GPU index of each replica (compose pins these)
    port: int


def placements(profile: DeployProfile) -> dict[str, StagePlacement]:
    """Per stage: replica count, device kind, GPUs per replica and whether its GPU is shared."""
    users: dict[str, int] = {}
    for sp in profile.stages.values():
        for device in sp.devices:
            if device.startswith("cuda"):
                key = device if ":" in device else "cuda:0"
                users[key] = users.get(key, 0) + 1
    out: dict[str, StagePlacement] = {}
    for name, sp in profile.stages.items():
        cuda = [d if ":" in d else "cuda:0" for d in sp.devices if d.startswith("cuda")]
        if cuda and len(cuda) != len(sp.devices):
            raise AssertionError(f"{profile.name}.{name}: mixes CPU and GPU replicas")
        out[name] = StagePlacement(
            replicas=sp.replicas,
            device="cuda" if cuda else "cpu",
            gpus_per_replica=1 if cuda else 0,
            shares_gpu=any(users[d] > 1 for d in cuda),
            gpu_indices=tuple(int(d.split(":")[1]) for d in cuda),
            port=sp.port,
        )
    return out


# ------------------------------------------------------------------------------------------------------
# Helm: lint, render, schema-validate


def load_values(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text()) or {}


def lint_chart(values: Mapping[str, Any] | None, chart_dir: Path = CHART_DIR) -> list[str]:
    """``helm lint --strict``: every warning or error (severity >= 2) is a problem."""
    import helm_python as helm

    report = helm.lint(str(chart_dir), dict(values or {}), strict=True)
    problems = [
        f"{m['path']}: {m['error'].strip()}" for m in report.get("messages", []) if m["severity"] >= 2
    ]
    problems += [e.strip() for e in report.get("errors", []) if e.strip() not in "\n".join(problems)]
    return problems


def render_chart(
    values: Mapping[str, Any] | None,
    chart_dir: Path = CHART_DIR,
    release: str = "mini",
    namespace: str = "ai",
) -> list[dict[str, Any]]:
    """Render offline (Helm's own engine, values.schema.json enforced) and parse every manifest."""
    import helm_python as helm

    with helm.Chart.load(str(chart_dir)) as chart:
        rendered = chart.render(dict(values or {}), name=release, namespace=namespace, is_install=True)
    docs: list[dict[str, Any]] = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                docs.append(doc)
    return docs


def render_notes(values: Mapping[str, Any] | None, chart_dir: Path = CHART_DIR) -> str:
    import helm_python as helm

    with helm.Chart.load(str(chart_dir)) as chart:
        rendered = chart.render(dict(values or {}), name="mini", namespace="ai", is_install=True)
    return next(text for path, text in rendered.items() if path.endswith("NOTES.txt"))


def validate_kubernetes(
    docs: Iterable[Mapping[str, Any]], versions: Iterable[str] = KUBE_VERSIONS
) -> list[str]:
    """Strict OpenAPI validation (unknown fields rejected) of every built-in kind; CRDs checked by hand."""
    import kubernetes_validate

    problems: list[str] = []
    docs = list(docs)
    for version in versions:
        for doc in docs:
            where = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')} @ {version}"
            if doc.get("apiVersion") == "monitoring.coreos.com/v1":
                problems += [f"{where}: {p}" for p in _check_service_monitor(doc)]
                continue
            try:
                kubernetes_validate.validate(dict(doc), version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                problems.append(f"{where}: {exc.message} at {list(exc.absolute_path)}")
            except kubernetes_validate.SchemaNotFoundError:
                problems.append(
                    f"{where}: no Kubernetes schema for {doc.get('apiVersion')} {doc.get('kind')}"
                )
    return problems


def _check_service_monitor(doc: Mapping[str, Any]) -> list[str]:
    """The Prometheus-operator CRD is not in the Kubernetes schemas; check the fields the operator needs."""
    problems = []
    if doc.get("kind") != "ServiceMonitor":
        problems.append(f"unexpected kind {doc.get('kind')}")
    spec = doc.get("spec") or {}
    if not (spec.get("selector") or {}).get("matchLabels"):
        problems.append("spec.selector.matchLabels is empty")
    endpoints = spec.get("endpoints") or []
    if not endpoints:
        problems.append("spec.endpoints is empty")
    for ep in endpoints:
        if not isinstance(ep.get("port"), str) or not str(ep.get("path", "/")).startswith("/"):
            problems.append(f"endpoint {ep}: needs a named port and an absolute path")
    return problems


# ------------------------------------------------------------------------------------------------------
# Helm: assertions on the rendered objects


def by_kind(docs: Iterable[Mapping[str, Any]], kind: str) -> list[Mapping[str, Any]]:
    return [d for d in docs if d.get("kind") == kind]


def component(doc: Mapping[str, Any]) -> str:
    return doc["metadata"]["labels"].get(COMPONENT_LABEL, "")


def stage_deployments(docs: Iterable[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    return {component(d): d for d in by_kind(docs, "Deployment") if component(d) in STAGES}


def _matches(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def check_selectors(docs: list[Mapping[str, Any]]) -> list[str]:
    """Deployment, Service, PDB, HPA and ServiceMonitor selectors each pick exactly the intended pods."""
    problems: list[str] = []
    deployments = by_kind(docs, "Deployment")
    pod_labels = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"] for d in deployments}
    for d in deployments:
        name = d["metadata"]["name"]
        if not _matches(d["spec"]["selector"]["matchLabels"], pod_labels[name]):
            problems.append(f"Deployment/{name}: selector does not match its own pod template labels")

    def selected(selector: Mapping[str, str]) -> list[str]:
        return [n for n, labels in pod_labels.items() if _matches(selector, labels)]

    for kind, get_selector in (
        ("Service", lambda o: o["spec"].get("selector") or {}),
        ("PodDisruptionBudget", lambda o: o["spec"]["selector"].get("matchLabels") or {}),
    ):
        for obj in by_kind(docs, kind):
            hits = selected(get_selector(obj))
            expected = [n for n in pod_labels if pod_labels[n].get(COMPONENT_LABEL) == component(obj)]
            if hits != expected or len(hits) != 1:
                problems.append(f"{kind}/{obj['metadata']['name']}: selects {hits}, expected {expected}")
    for hpa in by_kind(docs, "HorizontalPodAutoscaler"):
        target = hpa["spec"]["scaleTargetRef"]
        name = hpa["metadata"]["name"]
        if target.get("kind") != "Deployment" or target.get("name") not in pod_labels:
            problems.append(
                f"HorizontalPodAutoscaler/{name}: targets {target}, which the chart does not create"
            )
        elif pod_labels[target["name"]].get(COMPONENT_LABEL) != component(hpa):
            problems.append(f"HorizontalPodAutoscaler/{name}: scales another component's Deployment")
        dep = next((d for d in deployments if d["metadata"]["name"] == target.get("name")), None)
        if dep is not None and "replicas" in dep["spec"]:
            problems.append(
                f"HorizontalPodAutoscaler/{name}: Deployment also pins spec.replicas (they would fight)"
            )
    services = by_kind(docs, "Service")
    for sm in by_kind(docs, "ServiceMonitor"):
        selector = sm["spec"]["selector"]["matchLabels"]
        hits = [s for s in services if _matches(selector, s["metadata"]["labels"])]
        ports = {p["name"] for s in hits for p in s["spec"]["ports"]}
        if len(hits) != 1:
            problems.append(f"ServiceMonitor/{sm['metadata']['name']}: selects {len(hits)} Services")
        for ep in sm["spec"]["endpoints"]:
            if ep["port"] not in ports:
                problems.append(
                    f"ServiceMonitor/{sm['metadata']['name']}: port {ep['port']} not on the Service"
                )
    return problems


def cli_flag(args: list[str], flag: str) -> str | None:
    """Value of ``--flag VALUE`` in an argument list (the form the chart and compose files use)."""
    for i, arg in enumerate(args[:-1]):
        if arg == flag:
            return args[i + 1]
    return None


def _container(deployment: Mapping[str, Any]) -> Mapping[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, "one container per pod"
    return containers[0]


def container_command(deployment: Mapping[str, Any]) -> list[str]:
    """The full command line: ``command`` + ``args`` (the chart leaves ``command`` to the image entrypoint)."""
    c = _container(deployment)
    return [str(a) for a in (c.get("command") or []) + (c.get("args") or [])]


def check_stage_probes(docs: list[Mapping[str, Any]]) -> list[str]:
    """Startup, liveness and readiness probes are native gRPC probes on the port the stage CLI binds."""
    problems: list[str] = []
    services = {component(s): s for s in by_kind(docs, "Service")}
    for name, dep in stage_deployments(docs).items():
        c = _container(dep)
        argv = container_command(dep)
        if argv[:3] != ["python", "-m", f"services.{name}"]:
            problems.append(f"{name}: command {argv[:3]} is not the stage CLI")
        port = cli_flag(argv, "--port")
        if port is None:
            problems.append(f"{name}: no --port in {argv}")
            continue
        port_num = int(port)
        named = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        if named.get("grpc") != port_num:
            problems.append(f"{name}: containerPort 'grpc' {named.get('grpc')} != --port {port_num}")
        metrics = cli_flag(argv, "--metrics-port")
        if metrics is None or named.get("metrics") != int(metrics):
            problems.append(
                f"{name}: containerPort 'metrics' {named.get('metrics')} != --metrics-port {metrics}"
            )
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            spec = c.get(probe)
            if not spec or "grpc" not in spec:
                problems.append(f"{name}: {probe} is not a native gRPC probe")
                continue
            if spec["grpc"].get("port") != port_num:
                problems.append(
                    f"{name}: {probe} probes port {spec['grpc'].get('port')}, stage binds {port_num}"
                )
            if spec["grpc"].get("service", "") != "":
                problems.append(
                    f"{name}: {probe} checks service {spec['grpc']['service']!r}, not the overall ''"
                )
        svc = services.get(name)
        if svc is None:
            problems.append(f"{name}: no Service")
        else:
            if svc["spec"].get("clusterIP") != "None":
                problems.append(f"{name}: Service is not headless (gRPC would pin every stream to one pod)")
            grpc_ports = [p for p in svc["spec"]["ports"] if p["name"] == "grpc"]
            if (
                not grpc_ports
                or grpc_ports[0]["port"] != port_num
                or grpc_ports[0]["targetPort"] not in ("grpc", port_num)
            ):
                problems.append(f"{name}: Service grpc port {grpc_ports} does not lead to {port_num}")
    return problems


def check_graceful_termination(docs: list[Mapping[str, Any]]) -> list[str]:
    """terminationGracePeriodSeconds > preStop sleep + the stage's --drain-timeout."""
    problems = []
    for name, dep in stage_deployments(docs).items():
        pod = dep["spec"]["template"]["spec"]
        c = _container(dep)
        drain = float(cli_flag(container_command(dep), "--drain-timeout") or 0)
        pre = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        sleep = float(pre[1]) if len(pre) == 2 and pre[0] == "sleep" else None
        if sleep is None:
            problems.append(f"{name}: preStop is not a plain sleep: {pre}")
            continue
        grace = pod.get("terminationGracePeriodSeconds", 30)
        if not grace > sleep + drain:
            problems.append(f"{name}: grace {grace}s <= preStop {sleep}s + drain {drain}s")
    return problems


def check_security(docs: list[Mapping[str, Any]]) -> list[str]:
    """Non-root pods; the checkpoint volume is mounted read-only."""
    problems = []
    for dep in by_kind(docs, "Deployment"):
        name = dep["metadata"]["name"]
        pod = dep["spec"]["template"]["spec"]
        if not pod.get("securityContext", {}).get("runAsNonRoot"):
            problems.append(f"{name}: pod does not require a non-root user")
        for c in pod["containers"]:
            for mount in c.get("volumeMounts", []):
                if mount["name"] == "model" and not mount.get("readOnly"):
                    problems.append(f"{name}: model volume mounted writable")
        if component(dep) in STAGES and not any(
            m["name"] == "model" for m in _container(dep).get("volumeMounts", [])
        ):
            problems.append(f"{name}: no model volume")
    return problems


def configmap_profile(docs: list[Mapping[str, Any]]) -> DeployProfile:
    """The deploy profile in the rendered ConfigMap, parsed by the launcher's own parser."""
    maps = [d for d in by_kind(docs, "ConfigMap") if "deploy-profile.yaml" in d.get("data", {})]
    assert len(maps) == 1, f"expected one deploy-profile ConfigMap, found {len(maps)}"
    return parse_profile(yaml.safe_load(maps[0]["data"]["deploy-profile.yaml"]), source="ConfigMap")


def check_gpu_requests(docs: list[Mapping[str, Any]], profile: DeployProfile) -> list[str]:
    """Per stage: replicas, --device, GPU count and GPU resource kind follow the deploy profile."""
    problems: list[str] = []
    deployments = stage_deployments(docs)
    hpas = {component(h): h for h in by_kind(docs, "HorizontalPodAutoscaler")}
    for name, want in placements(profile).items():
        dep = deployments.get(name)
        if dep is None:
            problems.append(f"{name}: no Deployment")
            continue
        replicas = dep["spec"].get("replicas")
        if name in hpas:
            replicas = hpas[name]["spec"]["minReplicas"]
        if replicas != want.replicas:
            problems.append(f"{name}: {replicas} replicas, profile has {want.replicas}")
        argv = container_command(dep)
        if cli_flag(argv, "--device") != want.device:
            problems.append(
                f"{name}: --device {cli_flag(argv, '--device')}, profile places it on {want.device}"
            )
        if cli_flag(argv, "--port") != str(want.port):
            problems.append(f"{name}: --port {cli_flag(argv, '--port')}, profile port {want.port}")
        resources = _container(dep).get("resources", {})
        gpu_keys = {k for part in ("requests", "limits") for k in resources.get(part, {}) if "gpu" in k}
        if want.gpus_per_replica == 0:
            if gpu_keys:
                problems.append(f"{name}: CPU stage requests {sorted(gpu_keys)}")
            continue
        expected_key = SHARED_GPU_RESOURCE if want.shares_gpu else EXCLUSIVE_GPU_RESOURCE
        if gpu_keys != {expected_key}:
            problems.append(f"{name}: requests {sorted(gpu_keys)}, profile implies {expected_key}")
            continue
        for part in ("requests", "limits"):
            count = resources.get(part, {}).get(expected_key)
            if count is None or int(count) != want.gpus_per_replica:
                problems.append(f"{name}: {part}.{expected_key}={count}, want {want.gpus_per_replica}")
        if want.shares_gpu:
            problems += _check_colocation(name, dep, profile, deployments)
    return problems


def _check_colocation(
    name: str, dep: Mapping[str, Any], profile: DeployProfile, deployments: Mapping[str, Mapping[str, Any]]
) -> list[str]:
    """A stage sharing a GPU with other stages must land on the same node as them: either it is the anchor
    the others follow, or it has required pod affinity to a stage on the same device."""
    devices = set(profile.stage(name).devices)
    peers = [s for s in STAGES if s != name and devices & set(profile.stage(s).devices)]
    if not peers:
        return []

    def affinity_targets(d: Mapping[str, Any]) -> set[str]:
        aff = d["spec"]["template"]["spec"].get("affinity", {}).get("podAffinity", {})
        terms = aff.get("requiredDuringSchedulingIgnoredDuringExecution", [])
        return {
            t["labelSelector"]["matchLabels"].get(COMPONENT_LABEL, "")
            for t in terms
            if t.get("topologyKey") == "kubernetes.io/hostname"
        }

    mine = affinity_targets(dep)
    if mine & set(peers):
        return []
    followers = [p for p in peers if p in deployments and name in affinity_targets(deployments[p])]
    if followers:
        return []
    return [f"{name}: shares a GPU with {peers} but has no pod affinity to them and none follows it"]


# ------------------------------------------------------------------------------------------------------
# Compose


def load_yaml(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text()) or {}


_OVERRIDE_LISTS = {"command", "entrypoint", "test"}


def merge_compose(base: Mapping[str, Any], override: Mapping[str, Any], _key: str = "") -> Any:
    """Merge an override file into a base the way compose does for the keys these files use: mappings
    merge by key, command/entrypoint/healthcheck.test are replaced, other sequences are appended."""
    if isinstance(base, Mapping) and isinstance(override, Mapping):
        merged = dict(copy.deepcopy(base))
        for key, value in override.items():
            merged[key] = merge_compose(merged[key], value, key) if key in merged else copy.deepcopy(value)
        return merged
    if isinstance(base, list) and isinstance(override, list) and _key not in _OVERRIDE_LISTS:
        return list(base) + [v for v in override if v not in base]
    return copy.deepcopy(override)


_VARIABLE = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Substitute ``${VAR}`` / ``${VAR:-default}`` in every string, as compose does before merging."""
    if isinstance(value, str):
        return _VARIABLE.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), value)
    if isinstance(value, Mapping):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    return value


def compose_config(files: Iterable[Path], env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The merged, interpolated configuration of ``files`` (``env`` defaults to no variables set)."""
    config: dict[str, Any] = {}
    for path in files:
        config = merge_compose(config, interpolate(load_yaml(path), env or {}))
    return config


def validate_compose_schema(paths: Iterable[Path]) -> list[str]:
    """check-jsonschema against the compose-spec schema it bundles (offline)."""
    cmd = [
        sys.executable,
        "-m",
        "check_jsonschema",
        "--builtin-schema",
        "vendor.compose-spec",
        "--output-format",
        "json",
        *map(str, paths),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode == 0:
        return []
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return [f"check-jsonschema failed ({proc.returncode}): {proc.stdout}{proc.stderr}"]
    problems = [f"{e.get('filename')}: {e.get('path')}: {e.get('message')}" for e in report.get("errors", [])]
    problems += [f"{e.get('filename')}: {e.get('message')}" for e in report.get("parse_errors", [])]
    return problems or [f"check-jsonschema exit {proc.returncode}: {proc.stdout}{proc.stderr}"]


def yamllint_problems(paths: Iterable[Path]) -> list[str]:
    from yamllint import linter
    from yamllint.config import YamlLintConfig

    conf = YamlLintConfig(file=str(REPO / ".yamllint.yaml"))
    problems = []
    for path in paths:
        for p in linter.run(path.read_text(), conf, str(path)):
            shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
            problems.append(f"{shown}:{p.line}:{p.column}: [{p.level}] {p.message}")
    return problems


def compose_stage_services(config: Mapping[str, Any], stage: str) -> dict[str, Mapping[str, Any]]:
    """Services that serve ``stage``: the one named after it and replicas that take its name as an alias."""
    out = {}
    for name, svc in config.get("services", {}).items():
        aliases = set()
        networks = svc.get("networks") or {}
        if isinstance(networks, Mapping):
            for net in networks.values():
                aliases |= set((net or {}).get("aliases") or [])
        if name == stage or stage in aliases:
            out[name] = svc
    return out


def _environment(svc: Mapping[str, Any]) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        return dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def check_compose_layout(config: Mapping[str, Any], profile: DeployProfile, profile_file: str) -> list[str]:
    """GPU pinning, device flag, ports, health checks and the profile each service reads match the profile."""
    problems: list[str] = []
    want_all = placements(profile)
    for stage, want in want_all.items():
        services = compose_stage_services(config, stage)
        if len(services) != want.replicas:
            problems.append(f"{stage}: {len(services)} services, profile has {want.replicas} replicas")
        gpus: list[int] = []
        for name, svc in services.items():
            argv = [str(a) for a in svc.get("command") or []]
            if argv[:3] != ["python", "-m", f"services.{stage}"]:
                problems.append(f"{name}: command {argv[:3]} is not the {stage} CLI")
            if cli_flag(argv, "--device") != want.device:
                problems.append(f"{name}: --device {cli_flag(argv, '--device')}, profile says {want.device}")
            if cli_flag(argv, "--port") != str(want.port):
                problems.append(f"{name}: --port {cli_flag(argv, '--port')}, profile port {want.port}")
            test = [str(a) for a in (svc.get("healthcheck") or {}).get("test") or []]
            if "grpc_health_probe.py" not in " ".join(test) or cli_flag(test, "--port") != str(want.port):
                problems.append(f"{name}: healthcheck {test} does not probe gRPC port {want.port}")
            env = _environment(svc)
            if env.get("MINICPMO_STAGE") != stage:
                problems.append(f"{name}: MINICPMO_STAGE={env.get('MINICPMO_STAGE')}")
            if Path(env.get("MINICPMO_DEPLOY_PROFILE", "")).name != profile_file:
                problems.append(
                    f"{name}: reads profile {env.get('MINICPMO_DEPLOY_PROFILE')}, layout is {profile_file}"
                )
            if not any(str(v).endswith(":/models/MiniCPM-o-4_5:ro") for v in svc.get("volumes") or []):
                problems.append(f"{name}: checkpoint not mounted read-only at /models/MiniCPM-o-4_5")
            devices = (((svc.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get(
                "devices"
            )
            for dev in devices or []:
                if dev.get("driver") != "nvidia" or "gpu" not in (dev.get("capabilities") or []):
                    problems.append(f"{name}: device reservation {dev} is not an NVIDIA GPU")
                gpus += [int(i) for i in dev.get("device_ids") or []]
            if want.device == "cpu" and devices:
                problems.append(f"{name}: CPU stage reserves GPUs {devices}")
            if want.device == "cuda" and len(devices or []) != 1:
                problems.append(f"{name}: expected exactly one GPU reservation, found {devices}")
        if sorted(gpus) != sorted(want.gpu_indices):
            problems.append(
                f"{stage}: GPUs {sorted(gpus)}, profile places replicas on {sorted(want.gpu_indices)}"
            )
    gateway = config.get("services", {}).get("gateway")
    if gateway is None:
        return problems + ["no gateway service"]
    argv = [str(a) for a in gateway.get("command") or []]
    if Path(cli_flag(argv, "--deploy-config") or "").name != profile_file:
        problems.append(
            f"gateway: --deploy-config {cli_flag(argv, '--deploy-config')}, layout is {profile_file}"
        )
    for stage, want in want_all.items():
        addr = cli_flag(argv, f"--{stage}-addr") or ""
        if not addr.endswith(f":{want.port}"):
            problems.append(f"gateway: --{stage}-addr {addr} does not reach port {want.port}")
    host_mode = {n: s.get("network_mode") == "host" for n, s in config["services"].items()}
    if any(host_mode.values()) and not all(host_mode.values()):
        problems.append(f"mixed host and bridge networking: {host_mode}")
    return problems


def bundled_profile(name: str) -> DeployProfile:
    return load_profile(name)


# ---- what a stage process resolves from a container's command and environment ------------------------
# Where each stage CLI keeps the profile's max_num_seqs.
MAX_SEQS_DEST = {"thinker": "max_num_seqs", "talker": "max_streams", "code2wav": "max_batch"}


def stage_parsers() -> dict[str, Callable[[], argparse.ArgumentParser]]:
    """Each stage CLI's own argument parser (imports torch; call only where needed)."""
    from services.code2wav.__main__ import build_parser as code2wav_parser
    from services.talker.server import build_parser as talker_parser
    from services.thinker.__main__ import build_parser as thinker_parser

    return {"thinker": thinker_parser, "talker": talker_parser, "code2wav": code2wav_parser}


def _entrypoint_module() -> Any:
    spec = importlib.util.spec_from_file_location("docker_entrypoint", REPO / "docker" / "entrypoint.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_stage_cli_settings(
    name: str, stage: str, argv: list[str], env: Mapping[str, str], profile_file: Path, profile: DeployProfile
) -> list[str]:
    """The memory share and max sequences the stage process runs with are the profile's.

    Replays the container start: the image entrypoint (``docker/entrypoint.py``) fills
    ``MINICPMO_STAGE_SETTINGS`` from the profile (``profile_file``: the host copy of the file the
    container mounts), then the stage CLI parses ``argv`` with that section as its defaults.
    """
    from services.common.deploy_profile import STAGE_SETTINGS_ENV
    from services.common.stage_settings import parse_stage_args

    container_env = {k: v for k, v in env.items() if k != STAGE_SETTINGS_ENV}
    container_env["MINICPMO_DEPLOY_PROFILE"] = str(profile_file)
    prepared = _entrypoint_module().prepare_environment(container_env)
    if argv[:3] != ["python", "-m", f"services.{stage}"]:
        return [f"{name}: command {argv[:3]} is not the {stage} CLI"]
    with mock.patch.dict(os.environ, {STAGE_SETTINGS_ENV: prepared.get(STAGE_SETTINGS_ENV, "")}):
        args, choice = parse_stage_args(stage_parsers()[stage](), stage, argv[3:])
    want = profile.stage(stage)
    problems: list[str] = []
    if choice.fraction != want.memory_fraction:
        problems.append(
            f"{name}: runs with memory fraction {choice.fraction} ({choice.source}), "
            f"profile says {want.memory_fraction}"
        )
    got_seqs = getattr(args, MAX_SEQS_DEST[stage])
    if got_seqs != want.max_num_seqs:
        problems.append(f"{name}: runs with max_num_seqs {got_seqs}, profile says {want.max_num_seqs}")
    if stage == "thinker":
        for key in ("duplex_window", "duplex_window_high", "duplex_window_low", "weights"):
            if getattr(args, key) != getattr(want, key):
                problems.append(
                    f"{name}: runs with {key} {getattr(args, key)}, profile says {getattr(want, key)}"
                )
    return problems


def compose_profile_file(env: Mapping[str, str]) -> Path:
    """Host path of the profile a compose service names (configs/deploy is mounted at /etc/minicpmo/profiles)."""
    return REPO / "configs" / "deploy" / Path(env["MINICPMO_DEPLOY_PROFILE"]).name


def check_compose_stage_settings(config: Mapping[str, Any], profile: DeployProfile) -> list[str]:
    problems: list[str] = []
    for stage in STAGES:
        for name, svc in compose_stage_services(config, stage).items():
            env = _environment(svc)
            argv = [str(a) for a in svc.get("command") or []]
            problems += check_stage_cli_settings(name, stage, argv, env, compose_profile_file(env), profile)
    return problems


def container_env(deployment: Mapping[str, Any]) -> dict[str, str]:
    return {e["name"]: str(e.get("value", "")) for e in _container(deployment).get("env") or []}


def check_helm_stage_settings(docs: list[Mapping[str, Any]], profile_file: Path) -> list[str]:
    """``profile_file``: the rendered ConfigMap's profile written to disk (the pod mounts it)."""
    profile = load_profile(profile_file)
    problems: list[str] = []
    for stage, dep in stage_deployments(docs).items():
        problems += check_stage_cli_settings(
            dep["metadata"]["name"], stage, container_command(dep), container_env(dep), profile_file, profile
        )
    return problems
