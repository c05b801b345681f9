"""Helm chart (helm/minicpmo), offline: for every layout's values file the chart lints strictly, renders,
validates against the Kubernetes schema, and the rendered objects agree with that layout's deploy profile.
The negative tests break one thing each (a template, a value's type, a selector, a profile) and check
that the same checks catch it."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.common.deploy_profile import load_profile
from tests.deploy_checks import (
    CHART_DIR,
    LAYOUTS,
    REPO,
    STAGES,
    by_kind,
    check_gpu_requests,
    check_graceful_termination,
    check_helm_stage_settings,
    check_security,
    check_selectors,
    check_stage_probes,
    cli_flag,
    component,
    configmap_profile,
    container_command,
    lint_chart,
    load_values,
    render_chart,
    render_notes,
    stage_deployments,
    validate_kubernetes,
    yamllint_problems,
)

pytest.importorskip("helm_python", reason="helm-python-sdk is a dev dependency (pip install -e '.[dev]')")
pytest.importorskip("kubernetes_validate")

# Everything optional switched on, so every template is rendered and validated at least once.
ALL_FEATURES: dict[str, Any] = {
    "ingress": {"enabled": True, "tls": [{"hosts": ["minicpmo.example.com"], "secretName": "minicpmo-tls"}]},
    "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
    "model": {"volume": {"type": "hostPath", "hostPath": {"path": "/data/models"}}},
    "stages": {
        "thinker": {"autoscaling": {"enabled": True, "metric": "queueDepth"}},
        "talker": {"autoscaling": {"enabled": True, "metric": "cpu"}},
    },
    "gateway": {"autoscaling": {"enabled": True}},
}


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        out[key] = (
            _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def layout_render(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    layout = LAYOUTS[request.param]
    values = load_values(layout.values_file)
    return request.param, values, render_chart(values)


def test_every_layout_has_a_values_file() -> None:
    shipped = {p.name for p in CHART_DIR.glob("values-*.yaml")}
    assert shipped == {layout.values_file.name for layout in LAYOUTS.values()}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_lint_strict(layout: str) -> None:
    assert lint_chart(load_values(LAYOUTS[layout].values_file)) == []


def test_lint_strict_defaults_and_all_features() -> None:
    assert lint_chart({}) == []
    assert lint_chart(ALL_FEATURES) == []


def test_rendered_manifests_match_kubernetes_schema(layout_render: tuple[str, dict, list]) -> None:
    _, _, docs = layout_render
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget"} <= kinds
    assert validate_kubernetes(docs) == []


def test_all_optional_objects_match_kubernetes_schema() -> None:
    docs = render_chart(_merge(load_values(LAYOUTS["8x4090"].values_file), ALL_FEATURES))
    kinds = {d["kind"] for d in docs}
    assert {"Ingress", "HorizontalPodAutoscaler", "ServiceMonitor"} <= kinds
    assert validate_kubernetes(docs) == []
    assert check_selectors(docs) == []
    hpas = {component(h): h for h in by_kind(docs, "HorizontalPodAutoscaler")}
    assert hpas["thinker"]["spec"]["metrics"][0]["pods"]["metric"]["name"] == "minicpmo_stage_queue_depth"
    assert hpas["talker"]["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    # The autoscaled stages leave spec.replicas to the HPA; its floor is the profile's replica count.
    deps = stage_deployments(docs)
    assert "replicas" not in deps["thinker"]["spec"] and hpas["thinker"]["spec"]["minReplicas"] == 4
    assert check_gpu_requests(docs, load_profile("minicpmo_4_5_8x4090")) == []
    ingress = by_kind(docs, "Ingress")[0]
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/proxy-read-timeout"] == "3600"


def test_configmap_profile_is_the_layouts_profile(layout_render: tuple[str, dict, list]) -> None:
    layout, _, docs = layout_render
    from_chart = configmap_profile(docs)
    bundled = load_profile(LAYOUTS[layout].profile)
    assert from_chart.to_dict() == bundled.to_dict()


def test_gpu_requests_follow_the_profile(layout_render: tuple[str, dict, list]) -> None:
    layout, _, docs = layout_render
    # Judge the render against the profile the render itself carries AND the bundled file it names.
    assert check_gpu_requests(docs, configmap_profile(docs)) == []
    assert check_gpu_requests(docs, load_profile(LAYOUTS[layout].profile)) == []


def _write_configmap_profile(docs: list[dict[str, Any]], tmp_path: Path) -> Path:
    path = tmp_path / "deploy-profile.yaml"
    data = [d for d in by_kind(docs, "ConfigMap") if "deploy-profile.yaml" in d.get("data", {})][0]["data"]
    path.write_text(data["deploy-profile.yaml"])
    return path


def test_stages_run_with_the_profiles_memory_share_and_limits(
    layout_render: tuple[str, dict, list], tmp_path: Path
) -> None:
    """The pod's args + env, through the image entrypoint and the stage CLI, give the profile's settings."""
    _layout, _values, docs = layout_render
    assert check_helm_stage_settings(docs, _write_configmap_profile(docs, tmp_path)) == []


def test_extra_args_overriding_the_profile_are_caught(tmp_path: Path) -> None:
    values = _merge(
        load_values(LAYOUTS["1gpu"].values_file),
        {"stages": {"thinker": {"extraArgs": ["--memory-fraction", "0.9", "--max-num-seqs", "64"]}}},
    )
    docs = render_chart(values)
    problems = check_helm_stage_settings(docs, _write_configmap_profile(docs, tmp_path))
    assert len(problems) == 2 and all("thinker" in p for p in problems)
    assert "memory fraction 0.9 (--memory-fraction), profile says 0.4" in problems[0]


def test_probes_target_the_port_the_stage_binds(layout_render: tuple[str, dict, list]) -> None:
    _, _, docs = layout_render
    assert set(stage_deployments(docs)) == set(STAGES)
    assert check_stage_probes(docs) == []


def test_selectors_match_pod_labels(layout_render: tuple[str, dict, list]) -> None:
    _, _, docs = layout_render
    assert len(by_kind(docs, "PodDisruptionBudget")) == 4
    assert check_selectors(docs) == []


def test_graceful_termination_outlasts_the_drain(layout_render: tuple[str, dict, list]) -> None:
    _, _, docs = layout_render
    assert check_graceful_termination(docs) == []


def test_pods_run_as_non_root_with_read_only_model(layout_render: tuple[str, dict, list]) -> None:
    _, _, docs = layout_render
    assert check_security(docs) == []


def test_gateway_dials_every_stage_through_its_headless_service(
    layout_render: tuple[str, dict, list],
) -> None:
    _, _, docs = layout_render
    gateway = next(d for d in by_kind(docs, "Deployment") if component(d) == "gateway")
    argv = container_command(gateway)
    assert argv[:3] == ["python", "-m", "gateway"]
    assert cli_flag(argv, "--deploy-config") == "/etc/minicpmo/deploy-profile.yaml"
    services = {component(s): s for s in by_kind(docs, "Service")}
    for stage in STAGES:
        svc = services[stage]
        port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc")
        assert (
            cli_flag(argv, f"--{stage}-addr")
            == f"dns:///{svc['metadata']['name']}.ai.svc.cluster.local:{port}"
        )


def test_notes_name_every_stage() -> None:
    notes = render_notes({})
    for stage in STAGES:
        assert f"mini-minicpmo-{stage}.ai.svc.cluster.local" in notes


def test_chart_profiles_are_copies_of_configs_deploy() -> None:
    bundled = sorted((REPO / "configs" / "deploy").glob("*.yaml"))
    copies = sorted((CHART_DIR / "profiles").glob("*.yaml"))
    assert [p.name for p in copies] == [p.name for p in bundled]
    for src, dst in zip(bundled, copies, strict=True):
        assert dst.read_bytes() == src.read_bytes(), f"{dst} differs from {src}: copy configs/deploy again"


def test_values_files_pass_yamllint() -> None:
    files = [CHART_DIR / "Chart.yaml", *sorted(CHART_DIR.glob("values*.yaml"))]
    assert yamllint_problems(files) == []


# ------------------------------------------------------------------------------------------------------
# Negative cases: each breaks one thing and the checks above must notice.


@pytest.fixture()
def chart_copy(tmp_path: Path) -> Path:
    dst = tmp_path / "minicpmo"
    shutil.copytree(CHART_DIR, dst)
    return dst


def test_broken_template_fails_render_and_lint(chart_copy: Path) -> None:
    svc = chart_copy / "templates" / "stage-service.yaml"
    svc.write_text(svc.read_text().replace("{{- end }}\n{{- end }}", "{{- end }}\n", 1))  # drop an {{ end }}
    with pytest.raises(Exception, match="(?i)unexpected EOF|end"):
        render_chart({}, chart_dir=chart_copy)
    assert lint_chart({}, chart_dir=chart_copy) != []


def test_template_emitting_invalid_kubernetes_fails_validation(chart_copy: Path) -> None:
    svc = chart_copy / "templates" / "stage-service.yaml"
    svc.write_text(svc.read_text().replace("port: {{ $stage.port }}", "port: {{ $stage.port | quote }}"))
    docs = render_chart({}, chart_dir=chart_copy)
    problems = validate_kubernetes(docs, versions=("1.37.0",))
    assert any("Service/" in p and "integer" in p for p in problems), problems


def test_wrong_value_type_is_rejected_by_the_schema() -> None:
    bad = {"stages": {"thinker": {"replicas": "four"}}}
    problems = lint_chart(bad)
    assert any("replicas" in p and "integer" in p for p in problems), problems
    with pytest.raises(Exception, match="replicas"):
        render_chart(bad)
    typo = {"stages": {"talker": {"gpus": {"count": 1}}}}
    assert any("gpus" in p for p in lint_chart(typo))


def test_mismatched_selector_is_caught(layout_render: tuple[str, dict, list]) -> None:
    _, _, docs = layout_render
    broken = copy.deepcopy(docs)
    pdb = next(d for d in by_kind(broken, "PodDisruptionBudget") if component(d) == "talker")
    pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] = "talkr"
    assert any("PodDisruptionBudget" in p for p in check_selectors(broken))
    broken = copy.deepcopy(docs)
    dep = stage_deployments(broken)["code2wav"]
    dep["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/instance"] = "other"
    assert check_selectors(broken) != []


def test_probe_on_the_wrong_port_is_caught() -> None:
    docs = render_chart({"stages": {"talker": {"port": 50062}}})
    assert check_stage_probes(docs) == []  # port moved consistently: fine
    dep = stage_deployments(docs)["talker"]
    dep["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = 50052
    assert any("readinessProbe" in p for p in check_stage_probes(docs))


def test_gpu_request_drifting_from_the_profile_is_caught() -> None:
    values = load_values(LAYOUTS["3gpu"].values_file)
    values["stages"]["talker"]["gpu"]["count"] = 2
    problems = check_gpu_requests(render_chart(values), load_profile("minicpmo_4_5_3gpu"))
    assert any("talker" in p and "want 1" in p for p in problems), problems
    # A layout rendered with another layout's profile disagrees on replicas.
    docs = render_chart(load_values(LAYOUTS["8x4090"].values_file))
    problems = check_gpu_requests(docs, load_profile("minicpmo_4_5_3gpu"))
    assert any("thinker" in p and "replicas" in p for p in problems), problems
    # 2 GPUs: talker and code2wav share a card, so an exclusive request for either is wrong.
    values = load_values(LAYOUTS["2gpu"].values_file)
    values["stages"]["code2wav"]["gpu"]["resourceName"] = "nvidia.com/gpu"
    problems = check_gpu_requests(render_chart(values), load_profile("minicpmo_4_5_2gpu"))
    assert any("code2wav" in p and "nvidia.com/gpu.shared" in p for p in problems), problems


def test_drain_longer_than_grace_is_caught() -> None:
    docs = render_chart({"terminationGraceMarginSeconds": 1})
    assert check_graceful_termination(docs) == []
    dep = stage_deployments(docs)["thinker"]
    dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 30
    assert any("thinker" in p for p in check_graceful_termination(docs))


def test_invalid_profile_content_fails_render_or_parse() -> None:
    with pytest.raises(Exception, match="stages"):
        render_chart({"deployProfile": {"name": "custom", "content": "just: text\n"}})
    with pytest.raises(Exception, match="no bundled profile"):
        render_chart({"deployProfile": {"name": "minicpmo_4_5_16gpu"}})
    profile = yaml.safe_load((REPO / "configs" / "deploy" / "cpu.yaml").read_text())
    profile["stages"]["talker"]["devices"] = "cpu"  # a string where the parser wants a list
    docs = render_chart({"deployProfile": {"name": "custom", "content": yaml.safe_dump(profile)}})
    with pytest.raises(ValueError, match="devices"):
        configmap_profile(docs)


def test_mutual_tls_renders_valid_objects_with_exec_probes() -> None:
    """tls.enabled: every stage serves its certificate and requires the gateway's (env the stage CLI and
    the probe script read), probes are exec probes, and the objects still match the Kubernetes schema."""
    values = _merge(
        load_values(LAYOUTS["1gpu"].values_file), {"tls": {"enabled": True, "secretName": "mtls"}}
    )
    docs = render_chart(values)
    assert validate_kubernetes(docs) == []
    for name, dep in stage_deployments(docs).items():
        pod = dep["spec"]["template"]["spec"]
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        assert env["MINICPMO_TLS_CERT"] == "/etc/minicpmo-tls/stage.crt", name
        assert env["MINICPMO_TLS_CLIENT_CA"] == "/etc/minicpmo-tls/ca.crt", name
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            command = pod["containers"][0][probe]["exec"]["command"]
            assert command[1] == "/opt/minicpmo/docker/grpc_health_probe.py", (name, probe)
        assert {"name": "tls", "secret": {"secretName": "mtls"}} in pod["volumes"]
    gateway = next(d for d in by_kind(docs, "Deployment") if component(d) == "gateway")
    gw_env = {e["name"]: e.get("value") for e in gateway["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert gw_env["MINICPMO_STAGE_TLS_CERT"] == "/etc/minicpmo-tls/gateway.crt"
    without_secret = _merge(load_values(LAYOUTS["1gpu"].values_file), {"tls": {"enabled": True}})
    with pytest.raises(Exception, match="tls.secretName is required"):
        render_chart(without_secret)
