"""deploy/: the Kubernetes manifests pass `kubernetes-validate --strict` and yamllint, and say what the product
needs (no GPU request, every GPU visible, host PIDs, lowest priority, no privileges, probes on /health); the
Prometheus rules pass `promtool check rules` and their own `promtool test rules` unit tests, which fail when a
rule is broken; the Grafana dashboard names only metrics forge_load exports and series those rules record.

kubernetes-validate, yamllint and promtool come from scripts/install_test_tools.sh; their tests skip without them.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from forge_load.config.load import load_config
from forge_load.config.values import ConfigError
from forge_load.control.status import GpuSlots
from forge_load.service import health, metrics
from forge_load.service.loop import run_simulated
from forge_load.steering import holds

ROOT = Path(__file__).resolve().parent.parent
KUBE = ROOT / "deploy" / "kubernetes"
MANIFESTS = sorted(KUBE.glob("*.yaml"))
DASHBOARD = ROOT / "deploy" / "grafana" / "forge_load_dashboard.json"
DCGM_METRICS = {"DCGM_FI_DEV_GPU_UTIL"}  # the dcgm-exporter series the dashboard and the rules may join with
PROMETHEUS = ROOT / "deploy" / "prometheus"
RULE_FILES = sorted(PROMETHEUS.glob("*.yaml"))
RULE_TESTS = sorted((PROMETHEUS / "tests").glob("*.yaml"))
# Metrics the rules are written against before the filler exports them. Once it does, the rules
# test below fails until the name is taken out of this set.
NOT_YET_EXPORTED: set[str] = set()


def tool(name: str) -> str:
    """A console script from this venv (or PATH), or skip saying how to get it."""
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        pytest.skip(f"needs `{name}` (scripts/install_test_tools.sh installs it)")
    return found


# --- the manifests, as the tools see them ------------------------------------------------------------------


def test_there_are_manifests() -> None:
    assert [p.name for p in MANIFESTS] == ["00-namespace.yaml", "10-priorityclass.yaml", "20-daemonset.yaml",
                                           "30-service.yaml"]


def test_manifests_pass_kubernetes_validate_strict() -> None:
    result = subprocess.run([tool("kubernetes-validate"), "--strict", *map(str, MANIFESTS)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed") == len(MANIFESTS), result.stdout


def test_kubernetes_validate_strict_rejects_an_unknown_field(tmp_path: Path) -> None:
    # The check above can fail: a misspelt field is an error under --strict.
    bad = tmp_path / "bad.yaml"
    bad.write_text((KUBE / "20-daemonset.yaml").read_text().replace("hostPID: true", "hostPid: true"))
    result = subprocess.run([tool("kubernetes-validate"), "--strict", str(bad)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0 and "hostPid" in result.stdout + result.stderr


def test_manifests_pass_yamllint() -> None:
    result = subprocess.run([tool("yamllint"), "--strict", "-c", str(ROOT / "deploy" / "yamllint.yaml"),
                             str(KUBE), str(PROMETHEUS)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# --- what they say -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def docs() -> dict[str, dict[str, Any]]:
    """kind -> the one manifest of that kind."""
    yaml = pytest.importorskip("yaml", reason="needs PyYAML (it comes with yamllint)")
    out: dict[str, dict[str, Any]] = {}
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc["kind"] not in out, doc["kind"]
            out[doc["kind"]] = doc
    return out


def container(docs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    (only,) = docs["DaemonSet"]["spec"]["template"]["spec"]["containers"]
    return only


def env_of(docs: dict[str, dict[str, Any]]) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container(docs)["env"]}


def test_the_daemonset_requests_no_gpu_and_sees_them_all(docs: dict[str, dict[str, Any]]) -> None:
    pod = docs["DaemonSet"]["spec"]["template"]["spec"]
    text = json.dumps(docs["DaemonSet"])
    assert "nvidia.com/gpu\":" not in text and "nvidia.com/gpu'" not in text
    for kind in ("requests", "limits"):
        assert not [r for r in container(docs)["resources"][kind] if "gpu" in r]
    env = env_of(docs)
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["FORGE_GPUS"] == "all"
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["hostPID"] is True


def test_hostpid_says_why() -> None:
    lines = (KUBE / "20-daemonset.yaml").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip() == "hostPID: true")
    comment = " ".join(line for line in lines[at - 6:at] if line.strip().startswith("#"))
    assert "PID namespace" in comment and "process" in comment


def test_the_forge_settings_in_the_daemonset_are_valid(docs: dict[str, dict[str, Any]]) -> None:
    env = {k: v for k, v in env_of(docs).items() if k.startswith("FORGE_") and v is not None}
    try:
        config = load_config([], env)
    except ConfigError as error:
        pytest.fail(f"the DaemonSet's FORGE_* settings do not load: {error}")
    assert config.gpus == "all" and config.metrics_port is not None
    port = container(docs)["ports"][0]
    assert port["containerPort"] == config.metrics_port and port["name"] == "metrics"


def test_it_never_displaces_real_work(docs: dict[str, dict[str, Any]]) -> None:
    priority = docs["PriorityClass"]
    assert docs["DaemonSet"]["spec"]["template"]["spec"]["priorityClassName"] == priority["metadata"]["name"]
    assert priority["value"] < 0  # below every pod without a class
    assert priority["preemptionPolicy"] == "Never"
    assert priority["globalDefault"] is False


def test_it_runs_where_nvidias_daemonsets_run(docs: dict[str, dict[str, Any]]) -> None:
    pod = docs["DaemonSet"]["spec"]["template"]["spec"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    gpu_keys = {"feature.node.kubernetes.io/pci-10de.present", "nvidia.com/gpu.present"}
    assert {e["key"] for term in terms for e in term["matchExpressions"]} - {"forge-load/enabled"} == gpu_keys
    for term in terms:  # each way of finding a GPU node honours the opt-out label
        assert {"key": "forge-load/enabled", "operator": "NotIn", "values": ["false"]} in term["matchExpressions"]


def test_it_has_no_privileges_it_does_not_need(docs: dict[str, dict[str, Any]]) -> None:
    pod = docs["DaemonSet"]["spec"]["template"]["spec"]
    security = container(docs)["securityContext"]
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert "privileged" not in security and "add" not in security["capabilities"]
    assert pod["automountServiceAccountToken"] is False
    assert not pod.get("hostNetwork") and not pod.get("hostIPC")
    uid = pod["securityContext"]["runAsUser"]
    if uid == 0:  # root only to reach the kubelet's socket, and the manifest says so
        assert env_of(docs).get("FORGE_KUBELET_SOCKET")
        lines = (KUBE / "20-daemonset.yaml").read_text().splitlines()
        at = next(i for i, line in enumerate(lines) if line.strip() == "runAsUser: 0")
        comment = " ".join(line for line in lines[at - 10:at] if line.strip().startswith("#"))
        assert "socket" in comment and "capabilit" in comment
        assert pod["securityContext"]["runAsNonRoot"] is False and "runAsNonRoot" not in security
    else:  # the image's user: the Dockerfile's USER must be the uid the pod runs as
        assert security["runAsNonRoot"] is True and pod["securityContext"]["runAsNonRoot"] is True
        dockerfile = (ROOT / "Dockerfile").read_text()
        assert re.search(rf"^USER {uid}\b", dockerfile, re.MULTILINE)


def test_the_kubelets_pod_resources_are_asked_through_a_read_only_directory(docs: dict[str, dict[str, Any]]) -> None:
    pod = docs["DaemonSet"]["spec"]["template"]["spec"]
    env = env_of(docs)
    config = load_config([], {k: v for k, v in env.items() if k.startswith("FORGE_") and v})
    assert config.kubelet_socket == "/var/lib/kubelet/pod-resources/kubelet.sock"
    mount = next(m for m in container(docs)["volumeMounts"] if m["mountPath"] == "/var/lib/kubelet/pod-resources")
    assert mount["readOnly"] is True
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["hostPath"]["path"] == "/var/lib/kubelet/pod-resources"  # the directory: a new socket shows
    # The pod's own name and namespace (the downward API): the filler never holds a GPU for itself.
    refs = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in container(docs)["env"]}
    assert (refs["POD_NAME"], refs["POD_NAMESPACE"]) == ("metadata.name", "metadata.namespace")


def test_what_it_writes_goes_to_a_writable_volume(docs: dict[str, dict[str, Any]]) -> None:
    pod = docs["DaemonSet"]["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in container(docs)["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    env = env_of(docs)
    assert env["CUDA_CACHE_PATH"].startswith("/tmp/")  # the driver's kernels compiled from the PTX
    # The heartbeat: where it is set, else its default place for the pod's user.
    uid = pod["securityContext"]["runAsUser"]
    assert env.get("FORGE_HEARTBEAT_FILE", str(health.default_heartbeat_path(uid=uid))).startswith("/tmp/")


def test_no_deployment_sets_numba() -> None:
    # The filler loads compiled kernels; numba runs only in the `jit` extra's compile at start, which keeps no
    # cache (cuda.compile, no cache=True): a NUMBA_* setting there would be one an operator tunes for nothing.
    for path in (ROOT / "Dockerfile", ROOT / "docker-compose.yml", ROOT / "deploy" / "systemd" / "forge-load.service",
                 *KUBE.glob("*.yaml")):
        assert "NUMBA_" not in path.read_text(), path


def test_probes_ask_health_on_the_metrics_port(docs: dict[str, dict[str, Any]]) -> None:
    c = container(docs)
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "metrics"}, probe
    # The startup probe allows minutes for CUDA start-up; liveness restarts a stalled filler within a minute or so.
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] <= 120


def test_resources_are_limited(docs: dict[str, dict[str, Any]]) -> None:
    resources = container(docs)["resources"]
    assert set(resources["limits"]) == {"cpu", "memory"} and set(resources["requests"]) == {"cpu", "memory"}


def test_the_nodes_pause_directory_is_mounted_read_only(docs: dict[str, dict[str, Any]]) -> None:
    pod = docs["DaemonSet"]["spec"]["template"]["spec"]
    mount = next(m for m in container(docs)["volumeMounts"] if m["mountPath"] == "/run/forge-load")
    assert mount["readOnly"] is True
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["hostPath"] == {"path": "/run/forge-load", "type": "DirectoryOrCreate"}
    env = {e["name"]: e.get("value") for e in container(docs)["env"]}
    assert env["FORGE_PAUSE_FILE"] == "/run/forge-load/pause"
    assert load_config([], {k: v for k, v in env.items() if k.startswith("FORGE_") and v}).pause_file == (
        "/run/forge-load/pause")


def test_the_nodes_hold_directory_is_mounted_read_write_under_the_pause_directory(
        docs: dict[str, dict[str, Any]]) -> None:
    pod = docs["DaemonSet"]["spec"]["template"]["spec"]
    mount = next(m for m in container(docs)["volumeMounts"] if m["mountPath"] == holds.DEFAULT_HOLD_DIR)
    assert mount.get("readOnly") is not True
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["hostPath"] == {"path": holds.DEFAULT_HOLD_DIR, "type": "DirectoryOrCreate"}
    env = {e["name"]: e.get("value") for e in container(docs)["env"]}
    config = load_config([], {k: v for k, v in env.items() if k.startswith("FORGE_") and v})
    assert config.hold_dir == holds.DEFAULT_HOLD_DIR


def test_compose_mounts_the_hold_directory_read_write() -> None:
    yaml = pytest.importorskip("yaml", reason="needs PyYAML (it comes with yamllint)")
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for name, service in compose["services"].items():
        volumes = service["volumes"]
        assert f"{holds.DEFAULT_HOLD_DIR}:{holds.DEFAULT_HOLD_DIR}:rw" in volumes, name
        assert "/run/forge-load:/run/forge-load:ro" in volumes, name
        env = {**compose["x-forge-load"]["environment"], **(service.get("environment") or {})}
        assert load_config([], {k: str(v) for k, v in env.items()}).hold_dir == holds.DEFAULT_HOLD_DIR


def test_every_pod_says_it_is_the_filler(docs: dict[str, dict[str, Any]]) -> None:
    daemonset = docs["DaemonSet"]
    for labels in (daemonset["metadata"]["labels"], daemonset["spec"]["template"]["metadata"]["labels"]):
        assert labels["app.kubernetes.io/component"] == "gpu-filler"
        assert labels["app.kubernetes.io/name"] == "forge-load"


def test_the_service_finds_the_pods_for_prometheus(docs: dict[str, dict[str, Any]]) -> None:
    service, daemonset = docs["Service"], docs["DaemonSet"]
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in service["spec"]["selector"].items())
    assert daemonset["spec"]["selector"]["matchLabels"].items() <= labels.items()
    annotations = service["metadata"]["annotations"]
    port = container(docs)["ports"][0]["containerPort"]
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                           "prometheus.io/path": "/metrics"}
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    assert service["spec"]["clusterIP"] == "None"


def test_everything_is_in_the_namespace(docs: dict[str, dict[str, Any]]) -> None:
    namespace = docs["Namespace"]["metadata"]["name"]
    for kind in ("DaemonSet", "Service"):
        assert docs[kind]["metadata"]["namespace"] == namespace
    # hostPID needs the privileged Pod Security level in that namespace, or the pods are refused.
    assert docs["Namespace"]["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


# --- the Prometheus rules ------------------------------------------------------------------------------------


def rule_groups() -> list[dict[str, Any]]:
    yaml = pytest.importorskip("yaml", reason="needs PyYAML (it comes with yamllint)")
    return [group for path in RULE_FILES for group in yaml.safe_load(path.read_text())["groups"]]


def recorded_names() -> set[str]:
    return {rule["record"] for group in rule_groups() for rule in group["rules"] if "record" in rule}


def series_names(expr: str) -> set[str]:
    """The forge_load, DCGM and recorded series a PromQL expression names (not its labels or functions)."""
    names = re.findall(r"(?<![\w:\"])[A-Za-z_:][\w:]*", re.sub(r'"[^"]*"', '""', expr))
    return {n for n in names if n.startswith(("forge_load_", "DCGM_")) or ":" in n}


def test_there_are_rule_files_and_unit_tests() -> None:
    assert [p.name for p in RULE_FILES] == ["forge_load_rules.yaml"]
    assert [p.name for p in RULE_TESTS] == ["forge_load_rules_test.yaml"]


def test_rule_files_pass_promtool_check() -> None:
    promtool = tool("promtool")
    for path in RULE_FILES:
        result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
    count = sum(len(group["rules"]) for group in rule_groups())
    result = subprocess.run([promtool, "check", "rules", *map(str, RULE_FILES)], capture_output=True, text=True,
                            timeout=60)
    assert result.stdout.count("SUCCESS") == len(RULE_FILES) and f"{count} rules found" in result.stdout


def run_rule_tests(*paths: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("promtool"), "test", "rules", *map(str, paths)], capture_output=True, text=True,
                          timeout=60)


def test_rules_pass_their_promtool_unit_tests() -> None:
    result = run_rule_tests(*RULE_TESTS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(RULE_TESTS), result.stdout


# Each a rule made wrong in one way, and a piece of what the failing unit test then prints.
BROKEN_RULES = {
    "real work counts the filler too": (
        "clamp_min(UUID:DCGM_FI_DEV_GPU_UTIL:ratio - UUID:forge_load_filler_utilization:ratio, 0)",
        "UUID:DCGM_FI_DEV_GPU_UTIL:ratio", "UUID:forge_load_real_utilization:ratio"),
    "real work not clamped at 0": (
        "clamp_min(UUID:DCGM_FI_DEV_GPU_UTIL:ratio - UUID:forge_load_filler_utilization:ratio, 0)",
        "UUID:DCGM_FI_DEV_GPU_UTIL:ratio - UUID:forge_load_filler_utilization:ratio",
        "UUID:forge_load_real_utilization:ratio"),
    "duplicate filler series not folded": (
        "max by (UUID, GPU_I_ID) (forge_load_own_utilization_ratio)", "forge_load_own_utilization_ratio",
        "UUID:forge_load_filler_utilization:ratio"),
    "the MIG devices of one GPU folded in DCGM's reading": (
        "max by (UUID, GPU_I_ID) (DCGM_FI_DEV_GPU_UTIL)", "max by (UUID) (DCGM_FI_DEV_GPU_UTIL)",
        "UUID:DCGM_FI_DEV_GPU_UTIL:ratio"),
    "the MIG devices of one GPU folded in the filler's share": (
        "max by (UUID, GPU_I_ID) (forge_load_own_utilization_ratio)",
        "max by (UUID) (forge_load_own_utilization_ratio)", "UUID:forge_load_filler_utilization:ratio"),
    "a GPU without a filler left out": (
        "          or 0 * UUID:DCGM_FI_DEV_GPU_UTIL:ratio\n", "", "fleet:forge_load_real_utilization:avg"),
    "a pod back under a new address is down": (
        "unless on(UUID) forge_load_up", "unless forge_load_up", "ForgeLoadDown"),
    "a gone MIG device hidden by another of its GPU": (
        "unless on(UUID, GPU_I_ID) forge_load_up", "unless on(UUID) forge_load_up", "ForgeLoadDown"),
    "a gone filler is not down": (
        "          or\n          max_over_time(forge_load_up{UUID=~\"GPU-.+\", GPU_I_ID=\"\"}[1h]) unless on(UUID) "
        "forge_load_up\n", "", "ForgeLoadDown"),
    "a starting filler's series without a GPU's UUID is gone": (
        'forge_load_up{UUID=~"GPU-.+", GPU_I_ID=""}', 'forge_load_up{GPU_I_ID=""}', "ForgeLoadDown"),
    "a GPU in MIG mode named as a whole is gone": (
        "unless on(UUID) forge_load_up", "unless on(UUID, GPU_I_ID) forge_load_up", "ForgeLoadDown"),
    "one handover scrape alerts": ("        for: 30s\n", "        for: 0s\n", "ForgeLoadBusyBesideForeignWork"),
    "DCGM not a witness": (
        "            or on(UUID, GPU_I_ID)\n            UUID:forge_load_real_utilization:ratio > 0.2\n", "",
        "ForgeLoadBusyBesideForeignWork"),
    "a MIG device busy for its neighbour's foreign work": (
        "          and on(UUID, GPU_I_ID)\n", "          and on(UUID)\n", "ForgeLoadBusyBesideForeignWork"),
    "DCGM's witness of one MIG device hidden by another's": (
        "            or on(UUID, GPU_I_ID)\n", "            or on(UUID)\n", "ForgeLoadBusyBesideForeignWork"),
    "a young capped series counts as an hour": (
        "          and\n          present_over_time(forge_load_power_capped[10m] offset 50m)\n", "",
        "ForgeLoadPowerCapBinding"),
    "a third of the hour is most of it": (
        "avg_over_time(forge_load_power_capped[1h]) > 0.5", "avg_over_time(forge_load_power_capped[1h]) > 0.3",
        "ForgeLoadPowerCapBinding"),
}


@pytest.mark.parametrize("broken", sorted(BROKEN_RULES))
def test_the_unit_tests_fail_on_a_broken_rule(broken: str, tmp_path: Path) -> None:
    # The rules still load (promtool check passes), but they compute the wrong thing: the unit tests say so.
    old, new, failing = BROKEN_RULES[broken]
    (rules,) = RULE_FILES
    text = rules.read_text()
    assert text.count(old) == 1, old
    (tmp_path / rules.name).write_text(text.replace(old, new))
    (tmp_path / "tests").mkdir()
    for test in RULE_TESTS:
        (tmp_path / "tests" / test.name).write_text(test.read_text())
    check = subprocess.run([tool("promtool"), "check", "rules", str(tmp_path / rules.name)], capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    result = run_rule_tests(*sorted((tmp_path / "tests").glob("*.yaml")))
    assert result.returncode != 0 and "FAILED" in result.stdout + result.stderr, result.stdout
    assert failing in result.stdout + result.stderr, result.stdout + result.stderr


def documented_rules() -> set[str]:
    """The names in the first column of the tables under "Prometheus rules" in docs/deploying.md."""
    page = (ROOT / "docs" / "deploying.md").read_text()
    section = page[page.index("## Prometheus rules"):]
    section = section[:section.index("\n## ")]
    cells = re.findall(r"^\| ([^|]+) \|", section, re.M)
    return {name for cell in cells for name in re.findall(r"`([^`]+)`", cell)}


def test_rules_are_named_by_convention_and_documented() -> None:
    documented = documented_rules()
    records = recorded_names()
    assert records
    for name in records:
        # level:metric:operations; level UUID (one series per GPU or MIG device) or fleet (one over all of them).
        assert re.fullmatch(r"(UUID|fleet):(forge_load|DCGM)_\w+:[a-z0-9_]+", name), name
        assert name in documented, name
    alerts = [rule for group in rule_groups() for rule in group["rules"] if "alert" in rule]
    assert {a["alert"] for a in alerts} == {"ForgeLoadDown", "ForgeLoadBusyBesideForeignWork",
                                            "ForgeLoadPowerCapBinding"}
    for alert in alerts:
        assert alert["alert"] in documented, alert["alert"]
        assert alert["labels"]["severity"] in ("info", "warning", "critical"), alert["alert"]
        annotations = alert["annotations"]
        assert set(annotations) == {"summary", "description"}, alert["alert"]
        for label in ("gpu", "UUID"):
            assert f"$labels.{label}" in annotations["summary"], (alert["alert"], label)
        assert "$labels.instance" in annotations["description"], alert["alert"]
    assert documented == records | {a["alert"] for a in alerts}  # and nothing the rules file no longer has


def test_rules_use_only_series_that_exist() -> None:
    exprs = [rule["expr"] for group in rule_groups() for rule in group["rules"]]
    used = {n for expr in exprs for n in series_names(expr)}
    records = recorded_names()
    ours = {n for n in used if n.startswith("forge_load_")}
    assert used - ours - records <= DCGM_METRICS, used - ours - records - DCGM_METRICS
    assert ours - exported_names() == NOT_YET_EXPORTED, "update NOT_YET_EXPORTED: " + str(ours - exported_names())
    # Every recorded series is used: by another rule, or by the dashboard.
    dashboard = {n for expr in dashboard_exprs(json.loads(DASHBOARD.read_text())) for n in series_names(expr)}
    unused = records - (used | dashboard) - {n for n in records if n.startswith("fleet:")}
    assert not unused, unused


# --- the Grafana dashboard -----------------------------------------------------------------------------------


@cache
def exported_names() -> set[str]:
    """Every sample name a live registry exposes, a simulated filler behind it (stopped, so all series show; with
    a power cap, so its series show too)."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    config = load_config("--simulate --sim-speed 0 --duration 3 --sim-foreign 1-2 --max-power-w 650".split(), env={})
    gpu_slots = GpuSlots(simulated=True)
    slot = gpu_slots.add("0")
    run_simulated(config, io.StringIO(), heartbeat=slot.beat,
                  on_start=lambda rt: slot.attach(rt.info, lambda: rt.filler.status(rt.now())))
    text = generate_latest(metrics.make_registry(gpu_slots)).decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [a["expr"] for a in dashboard["annotations"]["list"] if "expr" in a]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if isinstance(v.get("query"), dict)]
    return exprs


def test_the_dashboard_names_only_exported_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    names = {n for expr in dashboard_exprs(dashboard) for n in series_names(expr)}
    exported = exported_names()
    # forge_load_mig_info has a series only for a MIG device (tests/test_metrics.py checks it on one)
    assert exported >= set(metrics.METRICS) - {"forge_load_mig_info"}
    ours = {n for n in names if n.startswith("forge_load_")}
    assert ours and ours <= exported, ours - exported
    recorded = {n for n in names if ":" in n}
    assert recorded <= recorded_names(), recorded - recorded_names()
    assert names - ours - recorded <= DCGM_METRICS, names - ours - recorded - DCGM_METRICS
    # What the dashboard must show: target, device utilization, own and foreign share per GPU.
    for needed in ("forge_load_target_ratio", "forge_load_device_utilization_ratio",
                   "forge_load_own_utilization_ratio", "forge_load_foreign_utilization_ratio", "forge_load_state"):
        assert needed in ours, needed


def test_the_dashboard_is_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    for panel in dashboard["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        for target in panel["targets"]:
            # (not label_replace's $1, a back-reference)
            used = set(re.findall(r"\$([A-Za-z_]\w*)", target["expr"])) - {"__rate_interval"}
            assert used <= variables, (panel["title"], used - variables)
    # Time series select with the UUID variable; those per GPU (not one average over the selection) label
    # their series by GPU.
    series = [t for p in dashboard["panels"] if p["type"] in ("timeseries", "state-timeline") for t in p["targets"]]
    assert series and all('UUID=~"$UUID"' in t["expr"] for t in series)
    per_gpu = per_gpu_targets(dashboard)
    assert per_gpu and all("gpu" in t["legendFormat"] for t in per_gpu)


def groupings(expr: str) -> list[list[str]]:
    """The label lists of an expression's on(...), ignoring(...), by (...) and without (...)."""
    return [[label.strip() for label in found.split(",")]
            for found in re.findall(r"\b(?:on|ignoring|by|without)\s*\(([^()]*)\)", expr)]


def test_grouping_by_uuid_tells_the_mig_devices_of_one_gpu_apart() -> None:
    # Two MIG devices of one GPU share its UUID (dcgm-exporter's labels, tests/test_metrics_mig.py): whatever
    # groups or joins by UUID takes GPU_I_ID too (a whole GPU has none, so there it changes nothing).
    # One exception, on purpose: a whole GPU's series (no GPU instance) is gone only when no series of its UUID is
    # left, its MIG devices' included (named as a whole, a GPU in MIG mode goes on as its MIG devices).
    whole_gpu_gone = 'max_over_time(forge_load_up{UUID=~"GPU-.+", GPU_I_ID=""}[1h]) unless on(UUID) forge_load_up'
    exprs = [rule["expr"] for group in rule_groups() for rule in group["rules"]]
    assert sum(expr.count(whole_gpu_gone) for expr in exprs) == 1
    exprs = [expr.replace(whole_gpu_gone, "") for expr in exprs]
    exprs += dashboard_exprs(json.loads(DASHBOARD.read_text()))
    by_uuid = [labels for expr in exprs for labels in groupings(expr) if "UUID" in labels]
    assert by_uuid and all("GPU_I_ID" in labels for labels in by_uuid), by_uuid


def per_gpu_targets(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """The time-series targets that show one series per GPU (not one average over the selection)."""
    series = [t for p in dashboard["panels"] if p["type"] in ("timeseries", "state-timeline") for t in p["targets"]]
    return [t for t in series if not re.fullmatch(r"avg\([^()]*\)", t["expr"])]


def test_per_gpu_panels_name_a_whole_gpu_as_before_and_each_mig_device_apart(tmp_path: Path) -> None:
    # Every per-GPU series takes its host and legend name from the same join with forge_load_gpu_info; promtool
    # evaluates it over a whole GPU and two MIG devices of another GPU, labelled as forge_load labels them
    # (a whole GPU's empty GPU_I_ID is no label once scraped).
    targets = per_gpu_targets(json.loads(DASHBOARD.read_text()))
    join = " * on(UUID, GPU_I_ID) group_left(hostname, legend_gpu) "
    assert targets and all(join in t["expr"] and "{{legend_gpu}}" in t["legendFormat"] for t in targets)
    assert len({t["expr"][t["expr"].index(join):] for t in targets}) == 1
    (own,) = [t["expr"] for t in targets if t["expr"].startswith("forge_load_own_utilization_ratio{")]
    scrape = 'instance="node-1:9401", job="forge-load"'
    devices = {'gpu="0", UUID="GPU-w"': "0", **{
        f'gpu="1", UUID="GPU-m", GPU_I_ID="{gi}", GPU_I_PROFILE="3g.40gb"': f"1 GI {gi}" for gi in (1, 2)}}
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": "dashboard:own",
                                                          "expr": own.replace("$UUID", ".*")}]}]}
    (tmp_path / "rules.json").write_text(json.dumps(rules))
    series = [{"series": f"forge_load_own_utilization_ratio{{{d}, {scrape}}}", "values": "0.5x3"} for d in devices]
    series += [{"series": f'forge_load_gpu_info{{{d}, modelName="NVIDIA H100 80GB HBM3", hostname="node-1", '
                          f"{scrape}}}", "values": "1x3"} for d in devices]
    expected = [{"labels": f'dashboard:own{{{d}, {scrape}, hostname="node-1", legend_gpu="{shown}"}}', "value": 0.5}
                for d, shown in devices.items()]
    test = {"rule_files": ["rules.json"], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": series,
                       "promql_expr_test": [{"expr": "dashboard:own", "eval_time": "2m", "exp_samples": expected}]}]}
    (tmp_path / "test.json").write_text(json.dumps(test))
    result = run_rule_tests(tmp_path / "test.json")
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr


def test_the_real_work_vs_filler_panel_stacks_the_recorded_split() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    (panel,) = [p for p in dashboard["panels"] if p["title"] == "Real work vs filler"]
    assert panel["type"] == "timeseries"
    assert panel["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    assert panel["fieldConfig"]["defaults"]["unit"] == "percentunit"
    shown = {t["legendFormat"]: t["expr"] for t in panel["targets"]}
    # Real work, filler and idle: the three per-GPU rules that add up to 1, averaged over the selected GPUs.
    assert shown == {legend: f'avg(UUID:{rule}:ratio{{UUID=~"$UUID"}})' for legend, rule in (
        ("real work", "forge_load_real_utilization"), ("filler", "forge_load_filler_utilization"),
        ("idle", "forge_load_idle"))}
    assert set(series_names(" ".join(shown.values()))) <= recorded_names()


def test_promtool_parses_every_dashboard_query(tmp_path: Path) -> None:
    promtool = tool("promtool")
    exprs = dashboard_exprs(json.loads(DASHBOARD.read_text()))
    rules = [{"record": f"dashboard:query{i}", "expr": e.replace("$UUID", ".*").replace("$__rate_interval", "1m")}
             for i, e in enumerate(exprs) if not e.startswith("label_values(")]
    path = tmp_path / "rules.json"  # JSON is YAML
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(rules)} rules found" in result.stdout


def test_the_state_panel_shows_every_state() -> None:
    from forge_load.control.status import STATES

    dashboard = json.loads(DASHBOARD.read_text())
    (panel,) = [p for p in dashboard["panels"] if p["type"] == "state-timeline"]
    (mapping,) = panel["fieldConfig"]["defaults"]["mappings"]
    shown = {int(value): option["text"] for value, option in mapping["options"].items()}
    assert sorted(shown.values()) == sorted(STATES)
    expr = panel["targets"][0]["expr"]
    for value, state in shown.items():  # each state's number is the one its term multiplies by (starting: none)
        assert (f'{value} * forge_load_state{{state="{state}"' in expr) == (value != 0), state
