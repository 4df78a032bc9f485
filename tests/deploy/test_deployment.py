"""Deployment files validated without a cluster or a container runtime."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import yaml

ROOT = os.environ.get("KVD_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
DEPLOY = os.path.join(ROOT, "deploy")
KVD = os.environ.get("KVD_BINARY", "kvd")
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))
import tied_popen  # noqa: E402  (kvd dies with the test process, however it ends)


def read(*parts):
    with open(os.path.join(DEPLOY, *parts)) as f:
        return f.read()


# ---- systemd ----

@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_systemd_unit_verifies(tmp_path):
    unit = read("systemd", "kvd.service")
    assert "ExecStart=/usr/local/bin/kvd " in unit
    for hardening in ("NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes",
                      "CapabilityBoundingSet=", "SystemCallFilter=@system-service",
                      "RestartPreventExitStatus=2", "User=kvd"):
        assert hardening in unit, hardening
    # verify needs the binary to exist: point ExecStart at the build's kvd.
    path = tmp_path / "kvd.service"
    path.write_text(unit.replace("/usr/local/bin/kvd", os.path.abspath(KVD)))
    r = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "" and r.stderr.strip() == "", r.stderr


# ---- container ----

def test_containerfile_is_multistage_portable_and_unprivileged():
    text = read("Containerfile")
    froms = re.findall(r"^FROM (\S+)", text, re.M)
    assert froms == ["debian:12", "debian:12"]
    assert "-DKVD_NATIVE=OFF" in text and "march=native" not in text
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0")
    assert "COPY --from=build" in text
    entry = json.loads(re.search(r"^ENTRYPOINT (.*)$", text, re.M).group(1))
    assert entry[0] == "/usr/local/bin/kvd" and "--config" in entry


# ---- Kubernetes (plain manifests and the Helm chart) ----

def set_value(values, dotted, value):
    """`helm --set a.b=value` on a values mapping."""
    *path, last = dotted.split(".")
    for part in path:
        values = values[part]
    assert last in values, f"no value {dotted} in values.yaml"
    values[last] = value


def render_helm(chart_dir, release="kvd", overrides=None):
    """Renders the chart's templates for the constructs it uses ({{ .Values.x }}, .Release.Name,
    quote, default .Chart.AppVersion, toYaml | nindent, include | sha256sum, nested
    {{- if .Values.x }} ... {{- end }}); anything else fails the test. `overrides`: {"a.b": v}
    as `helm --set` gives them."""
    with open(os.path.join(chart_dir, "values.yaml")) as f:
        values = yaml.safe_load(f)
    for dotted, value in (overrides or {}).items():
        set_value(values, dotted, value)
    with open(os.path.join(chart_dir, "Chart.yaml")) as f:
        chart = yaml.safe_load(f)

    def lookup(path):
        v = values
        for part in path.split("."):
            v = v[part]
        return v

    def expr(body, indent_hint):
        body = body.strip()
        m = re.fullmatch(r"toYaml \.Values\.([\w.]+) \| nindent (\d+)", body)
        if m:
            text = yaml.safe_dump(lookup(m.group(1)), default_flow_style=False).rstrip()
            pad = " " * int(m.group(2))
            return "\n" + "\n".join(pad + line for line in text.splitlines())
        m = re.fullmatch(r"\.Values\.([\w.]+) \| default \.Chart\.AppVersion", body)
        if m:
            return str(lookup(m.group(1)) or chart["appVersion"])
        m = re.fullmatch(r"\.Values\.([\w.]+)( \| quote)?", body)
        if m:
            v = lookup(m.group(1))
            return json.dumps(str(v)) if m.group(2) else str(v)
        if body == ".Release.Name":
            return release
        if re.fullmatch(r'include \(print \$\.Template\.BasePath "/[\w.]+"\) \. \| sha256sum',
                        body):
            return "0" * 64
        raise AssertionError(f"template construct not understood by the test: {{{{ {body} }}}}")

    # An if block with no other if inside it, with the whitespace {{- trims before each tag.
    innermost_if = re.compile(
        r"\s*\{\{- if \.Values\.([\w.]+) \}\}((?:(?!\{\{- if ).)*?)\s*\{\{- end \}\}", re.S)

    def conditionals(text):
        while True:
            text, n = innermost_if.subn(lambda m: m.group(2) if lookup(m.group(1)) else "", text)
            if n == 0:
                assert "{{- if" not in text and "{{- end" not in text, "unbalanced if/end"
                return text

    docs = []
    for name in sorted(os.listdir(os.path.join(chart_dir, "templates"))):
        with open(os.path.join(chart_dir, "templates", name)) as f:
            text = conditionals(f.read())
        text = re.sub(r"\s*\{\{-(.*?)\}\}", lambda m: expr(m.group(1), 0), text)
        text = re.sub(r"\{\{(.*?)\}\}", lambda m: expr(m.group(1), 0), text)
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def plain_manifests():
    docs = []
    for name in ("kvd-configmap.yaml", "kvd-daemonset.yaml"):
        docs.extend(d for d in yaml.safe_load_all(read("kubernetes", name)) if d)
    return docs


def check_kvd_on_topology(topology_text, tmp):
    """A real kvd accepts the topology: the same hosts (kvd refuses a TCP address beyond
    loopback without tokens), ports made ephemeral, the socket in a temp dir, the arena shrunk."""
    topo = yaml.safe_load(topology_text)
    topo["tiers"]["host"]["capacity"] = "16MiB"
    topo["tiers"]["host"]["prefault"] = False
    listen = topo.setdefault("listen", {})
    if listen.get("tcp"):
        listen["tcp"] = listen["tcp"].rsplit(":", 1)[0] + ":0"
    if listen.get("unix"):
        listen["unix"] = os.path.join(tmp, "kvd.sock")
    if topo.get("metrics", {}).get("listen"):
        topo["metrics"]["listen"] = topo["metrics"]["listen"].rsplit(":", 1)[0] + ":0"
    cfg = os.path.join(tmp, "topology.yaml")
    ready = os.path.join(tmp, "ready.json")
    with open(cfg, "w") as f:
        yaml.safe_dump(topo, f)
    p = tied_popen.popen([KVD, "--config", cfg, "--ready-file", ready], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 15
        while not os.path.exists(ready):
            assert p.poll() is None, "kvd refused the topology:\n" + p.stdout.read()
            assert time.monotonic() < deadline, "kvd not ready"
            time.sleep(0.05)
    finally:
        p.terminate()
        p.wait(10)
    assert p.returncode == 0


@pytest.mark.parametrize("source", ["plain", "helm"])
def test_daemonset_and_configmap(source):
    docs = plain_manifests() if source == "plain" else render_helm(
        os.path.join(DEPLOY, "helm", "kvd"))
    by_kind = {}
    for d in docs:
        assert {"apiVersion", "kind", "metadata"} <= d.keys(), d
        by_kind.setdefault(d["kind"], []).append(d)
    (cm,) = by_kind["ConfigMap"]
    (ds,) = by_kind["DaemonSet"]
    assert "StatefulSet" not in by_kind  # etcd only with cluster.enabled
    assert ds["apiVersion"] == "apps/v1" and cm["apiVersion"] == "v1"
    spec = ds["spec"]["template"]["spec"]
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert spec["hostIPC"] is True
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] != 0
    (c,) = spec["containers"]
    probe = c["readinessProbe"]["exec"]["command"]
    assert probe[0].endswith("kvdctl") and probe[-1] == "health"
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    # The topology volume is this ConfigMap, mounted where --config points.
    vol = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    topo_vol = next(n for n, v in vol.items() if "configMap" in v)
    assert vol[topo_vol]["configMap"]["name"] == cm["metadata"]["name"]
    config_arg = c["args"][c["args"].index("--config") + 1]
    assert config_arg == os.path.join(mounts[topo_vol], "topology.yaml")
    assert "topology.yaml" in cm["data"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    topo = yaml.safe_load(cm["data"]["topology.yaml"])
    assert topo["listen"]["tcp"].endswith(f":{ports['control']}")
    assert topo["metrics"]["listen"].endswith(f":{ports['metrics']}")
    # The socket kvdctl probes is the one kvd listens on.
    assert probe[probe.index("--addr") + 1] == "unix:" + topo["listen"]["unix"]
    with tempfile.TemporaryDirectory() as tmp:
        check_kvd_on_topology(cm["data"]["topology.yaml"], tmp)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_from_field(container, name):
    (e,) = [e for e in container["env"] if e["name"] == name]
    return e["valueFrom"]["fieldRef"]["fieldPath"]


def test_helm_cluster_renders_etcd_and_the_membership():
    """cluster.enabled: an etcd StatefulSet whose SRV discovery names its own peer Service, and
    kvds whose topology points at etcd's client Service and at the mounted token Secret."""
    docs = render_helm(os.path.join(DEPLOY, "helm", "kvd"),
                       overrides={"cluster.enabled": True, "cluster.tokenSecret": "kvd-token"})
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    (sts,) = by_kind["StatefulSet"]
    services = {d["metadata"]["name"]: d for d in by_kind["Service"]}
    peer = services[sts["spec"]["serviceName"]]
    assert peer["spec"]["clusterIP"] == "None" and peer["spec"]["publishNotReadyAddresses"]
    assert {"name": "etcd-server", "port": 2380, "targetPort": 2380} in peer["spec"]["ports"]
    pod = sts["spec"]["template"]
    assert peer["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (etcd,) = pod["spec"]["containers"]
    assert env_from_field(etcd, "POD_NAME") == "metadata.name"
    assert env_from_field(etcd, "POD_NAMESPACE") == "metadata.namespace"
    flags = dict(a.split("=", 1) for a in etcd["args"])
    domain = flags["--discovery-srv"]
    assert domain == peer["metadata"]["name"] + ".$(POD_NAMESPACE).svc.cluster.local"
    # Each member advertises the name its SRV record points at: <pod>.<peer Service>.<domain>.
    assert flags["--initial-advertise-peer-urls"] == f"http://$(POD_NAME).{domain}:2380"
    assert flags["--name"] == "$(POD_NAME)"
    if shutil.which("etcd"):  # every flag is one the real etcd 3.4 knows
        usage = subprocess.run(["etcd", "--help"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True).stdout
        known = set(re.findall(r"^\s+(--[\w-]+)", usage, re.M))
        assert set(flags) <= known, set(flags) - known

    (cm,) = by_kind["ConfigMap"]
    topo = yaml.safe_load(cm["data"]["topology.yaml"])
    client_svc = services[topo["cluster"]["etcd"][0].rsplit(":", 1)[0]]
    assert client_svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert {p["port"] for p in client_svc["spec"]["ports"]} == {2379}
    (ds,) = by_kind["DaemonSet"]
    spec = ds["spec"]["template"]["spec"]
    (kvd,) = spec["containers"]
    assert kvd["args"][kvd["args"].index("--node") + 1] == "$(NODE_NAME)"
    assert env_from_field(kvd, "NODE_NAME") == "spec.nodeName"
    secret_vol = next(v for v in spec["volumes"] if "secret" in v)
    assert secret_vol["secret"]["secretName"] == "kvd-token"
    mount = next(m for m in kvd["volumeMounts"] if m["name"] == secret_vol["name"])
    assert topo["cluster"]["token_file"] == mount["mountPath"] + "/token"


@pytest.mark.skipif(shutil.which("etcd") is None or shutil.which("etcdctl") is None,
                    reason="etcd-server / etcd-client not installed")
def test_helm_cluster_topology_registers_in_a_real_etcd(tmp_path):
    """The chart's cluster topology, with the endpoint and the Secret's path moved onto this
    machine, makes a real kvd register in a real etcd under the node name the pod passes."""
    docs = render_helm(os.path.join(DEPLOY, "helm", "kvd"),
                       overrides={"cluster.enabled": True, "cluster.tokenSecret": "kvd-token"})
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    topo = yaml.safe_load(cm["data"]["topology.yaml"])
    client_port, peer_port = free_port(), free_port()
    etcd = tied_popen.popen(
        ["etcd", "--name", "t", "--data-dir", str(tmp_path / "etcd"),
         "--listen-client-urls", f"http://127.0.0.1:{client_port}",
         "--advertise-client-urls", f"http://127.0.0.1:{client_port}",
         "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
         "--initial-cluster", f"t=http://127.0.0.1:{peer_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    (tmp_path / "token").write_text("s3cret\n")
    topo["cluster"]["etcd"] = [f"127.0.0.1:{client_port}"]
    topo["cluster"]["token_file"] = str(tmp_path / "token")
    topo["cluster"]["lease_ttl_s"] = 3
    topo["tiers"]["host"].update(capacity="16MiB", prefault=False)
    topo["listen"] = {"tcp": "127.0.0.1:0", "unix": str(tmp_path / "kvd.sock")}
    topo["metrics"]["listen"] = "127.0.0.1:0"
    cfg = tmp_path / "topology.yaml"
    cfg.write_text(yaml.safe_dump(topo))
    kvd = tied_popen.popen([KVD, "--config", str(cfg), "--node", "worker-7"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        prefix = f"/kvd/{topo['cluster']['name']}/members/"
        deadline = time.monotonic() + 30
        record = None
        while record is None:
            assert kvd.poll() is None, "kvd stopped:\n" + kvd.stdout.read()
            assert time.monotonic() < deadline, "kvd never registered in etcd"
            out = subprocess.run(
                ["etcdctl", "--endpoints", f"127.0.0.1:{client_port}", "get", "--prefix",
                 prefix], env=dict(os.environ, ETCDCTL_API="3"), capture_output=True, text=True)
            lines = out.stdout.splitlines()
            if len(lines) >= 2:
                assert lines[0] == prefix + "worker-7"
                record = json.loads(lines[1])
            else:
                time.sleep(0.2)
        assert record["node"] == "worker-7"
        assert re.fullmatch(r"[0-9a-f]{16}", record["token_digest"])  # the file's token
    finally:
        kvd.terminate()
        kvd.wait(10)
        etcd.terminate()
        etcd.wait(10)


def test_helm_chart_metadata():
    chart = yaml.safe_load(read("helm", "kvd", "Chart.yaml"))
    assert chart["apiVersion"] == "v2" and chart["name"] == "kvd"
    assert re.fullmatch(r"\d+\.\d+\.\d+", chart["version"])


def project_version():
    """kvd's version: project(kvd VERSION ...) in the top-level CMakeLists.txt, its one source."""
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        m = re.search(r"project\(kvd VERSION (\d+\.\d+\.\d+)", f.read())
    assert m, "no project(kvd VERSION ...) in CMakeLists.txt"
    return m.group(1)


def test_deployment_files_carry_the_project_version():
    """YAML cannot read CMake: the chart's version and appVersion, and the plain DaemonSet's
    image tag, are copies of the project version, checked here (the Helm image tag follows
    appVersion; the Python package reads CMakeLists.txt itself)."""
    version = project_version()
    chart = yaml.safe_load(read("helm", "kvd", "Chart.yaml"))
    assert chart["version"] == version
    assert chart["appVersion"] == version
    for source, docs in (("plain", plain_manifests()),
                         ("helm", render_helm(os.path.join(DEPLOY, "helm", "kvd")))):
        (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
        (c,) = ds["spec"]["template"]["spec"]["containers"]
        assert c["image"] == f"kvd:{version}", source
    with open(os.path.join(ROOT, "client", "python", "pyproject.toml")) as f:
        pyproject = f.read()
    assert re.search(r'^dynamic = \["version"\]', pyproject, re.M)
    assert 'input = "../../CMakeLists.txt"' in pyproject


def test_docs_state_the_project_version():
    """The user docs may state the version (an image tag, a line of kvd's log): each statement
    is the project version, so a release that bumps it finds every stale one here."""
    version = project_version()
    docs = os.path.join(ROOT, "docs")
    pages = [os.path.join(docs, n) for n in sorted(os.listdir(docs)) if n.endswith(".md")]
    stated = []
    for page in pages + [os.path.join(ROOT, "README.md")]:
        with open(page) as f:
            for m in re.finditer(r"\bkvd[: ](\d+\.\d+\.\d+)\b", f.read()):
                stated.append((os.path.relpath(page, ROOT), m.group(0), m.group(1)))
    assert stated, "no page states kvd's version: drop this test or the pattern is wrong"
    stale = [(page, text) for page, text, v in stated if v != version]
    assert not stale, f"pages stating another version than {version}: {stale}"


def test_bad_topology_in_the_check_is_caught(tmp_path):
    # The check above can fail: a topology with an unknown key is refused by kvd.
    with pytest.raises(AssertionError, match="refused the topology"):
        check_kvd_on_topology("tiers: {host: {capacity: 1GiB}}\nbogus_key: 1\n", str(tmp_path))
    with pytest.raises(AssertionError, match="refused the topology"):
        check_kvd_on_topology("listen: {tcp: 0.0.0.0:7400}\ntiers: {host: {capacity: 1GiB}}\n",
                              str(tmp_path))
