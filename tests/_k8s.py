"""What the Kubernetes tests (``tests/test_k8s_*.py``) share: ``examples/kubernetes/`` read as
the cluster would read it, and checked against the CLI. No cluster needed.

Every YAML document of the manifests parses (``yaml.safe_load_all``) into a kind this project
deploys, with the fields it needs. Every ``hspmd-launch`` command line, in a manifest or in the
README, is parsed by the real command (``launch_command.make_context``, or the subcommand's own
click command) with the pod's environment (``$(VAR)`` filled from the container's env, the
downward-API fields with sample values) and the pod's files (its secrets and config maps laid
out in a temporary directory); the agent's line then goes through ``build_config`` as the agent
takes it. The ``check_*`` functions then hold the fields the launcher depends on to agree:
environment variables the CLI knows, etcd endpoints, ports and certificate names, volumes and
the secrets and config maps behind them, node identity, the Job's failure policy against
``--nnodes``, the grace period against ``--shutdown-timeout``, the script's flags against the
script; each raises an ``AssertionError`` naming what disagrees. The fixtures ``docs`` and
``readme`` (the manifests' documents, the README's text) serve every Kubernetes test module.
"""

from __future__ import annotations

import importlib
import os
import re
import shlex
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional
from urllib.parse import urlsplit

import click
import pytest
import yaml

from hspmd_elastic.contract.env import (DEVICE_ENV, ETCD_BINARY_ENV, ETCD_PASSWORD_ENV,
                                        HangRule)
from hspmd_elastic.contract.keys import job_prefix
from hspmd_elastic.graph.config import ModelConfig
from launcher import cli
from launcher.api import ConfigError
from launcher.etcd_security import subcommand_security

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "examples" / "kubernetes"
MANIFESTS = ("etcd.yaml", "job.yaml", "dashboard.yaml")
README = K8S / "README.md"
IMAGE_ROOT = "/opt/hspmd/"  # where the README's image keeps the repository
NAMESPACE = "hspmd"
API_VERSIONS = {
    "Namespace": "v1", "Service": "v1", "ConfigMap": "v1", "Secret": "v1",
    "PersistentVolumeClaim": "v1", "StatefulSet": "apps/v1", "Deployment": "apps/v1",
    "Job": "batch/v1", "PodDisruptionBudget": "policy/v1",
    "NetworkPolicy": "networking.k8s.io/v1",
    "Certificate": "cert-manager.io/v1", "Issuer": "cert-manager.io/v1",
}
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
SAMPLE_FIELDS = {"metadata.name": "pod-0", "metadata.namespace": NAMESPACE,
                 "status.podIP": "10.1.2.3", COMPLETION_INDEX: "0"}
CERT_KEYS = ("tls.crt", "tls.key", "ca.crt")  # what a cert-manager Certificate's Secret holds
NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
VAR_RE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")  # "$$" is an escaped "$"
OWN_ENV = ("PET_", "HSPMD_")
CLEARED_ENV = ("PET_", "HSPMD_", "TORCH_ELASTIC_", "SLURM_")
SECRET_CMD_RE = re.compile(r"kubectl(?: -n \S+)? create secret generic (\S+)"
                           r"((?: --from-(?:literal|file)=[^\s=]+=\S+)+)")


# ---------------------------------------------------------------------------- reading
def load_docs() -> list[dict]:
    docs = []
    for name in MANIFESTS:
        docs.extend(d for d in yaml.safe_load_all((K8S / name).read_text()) if d is not None)
    return docs


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    """The manifests' documents (``load_docs``): a fixture the ``test_k8s_*.py`` modules import."""
    return load_docs()


@pytest.fixture(scope="module")
def readme() -> str:
    """examples/kubernetes/README.md's text: a fixture the ``test_k8s_*.py`` modules import."""
    return README.read_text()


def ident(doc: dict) -> str:
    return f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"


def of_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def one(docs: list[dict], kind: str) -> dict:
    found = list(of_kind(docs, kind).values())
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def workloads(docs: list[dict]) -> Iterator[tuple[dict, dict]]:
    for doc in docs:
        if doc["kind"] in ("Job", "Deployment", "StatefulSet"):
            yield doc, doc["spec"]["template"]["spec"]


def containers(docs: list[dict]) -> Iterator[tuple[dict, dict, dict]]:
    for owner, pod in workloads(docs):
        for c in [*pod.get("initContainers", []), *pod["containers"]]:
            yield owner, pod, c


def made_secrets(docs: list[dict], readme: str) -> dict[str, set[str]]:
    """Secret name -> its keys, for every Secret the manifests or the README's commands make."""
    made = {d["metadata"]["name"]: {*d.get("data", {}), *d.get("stringData", {})}
            for d in of_kind(docs, "Secret").values()}
    made.update({d["spec"]["secretName"]: set(CERT_KEYS)
                 for d in of_kind(docs, "Certificate").values()})
    for m in SECRET_CMD_RE.finditer(readme):
        made[m.group(1)] = set(re.findall(r"--from-(?:literal|file)=([^\s=]+)=", m.group(2)))
    return made


def expand(text: str, env: dict[str, str], where: str) -> str:
    """Kubernetes' ``$(VAR)``: only a variable defined earlier in the container's env."""
    def sub(m: re.Match) -> str:
        if m.group(1) is None:
            return "$"
        assert m.group(1) in env, f"{where}: $({m.group(1)}) is not defined in its env"
        return env[m.group(1)]
    return VAR_RE.sub(sub, text)


def pod_env(container: dict, where: str, fields: dict[str, str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = expand(str(item["value"]), env, where)
        else:
            path = item["valueFrom"]["fieldRef"]["fieldPath"]
            assert path in fields, f"{where}: env {item['name']} from unknown field {path}"
            env[item["name"]] = fields[path]
    return env


def launch_argv(container: dict) -> Optional[list[str]]:
    argv = [str(a) for a in [*container.get("command", []), *container.get("args", [])]]
    for i, arg in enumerate(argv):
        if Path(arg).name == "hspmd-launch":
            return argv[i + 1:]
    return None


def fake_file(key: str) -> str:
    if key.endswith(".key"):
        return "-----BEGIN PRIVATE KEY-----\nMA==\n-----END PRIVATE KEY-----\n"
    if key.endswith(".crt"):
        return "-----BEGIN CERTIFICATE-----\nMA==\n-----END CERTIFICATE-----\n"
    return "0123456789abcdef" * 4  # a bearer token


class PodFiles:
    """The container's mounts under ``root``: secret keys (fake PEM files, a sample token),
    config map data as written in the manifests, empty directories for the rest."""

    def __init__(self, root: Path, owner: dict, pod: dict, container: dict, docs: list[dict],
                 secrets: dict[str, set[str]]):
        where = f"{ident(owner)} container {container['name']}"
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        claims = {t["metadata"]["name"] for t in owner["spec"].get("volumeClaimTemplates", [])}
        maps, pvcs = of_kind(docs, "ConfigMap"), of_kind(docs, "PersistentVolumeClaim")
        self.mounts: dict[str, tuple[Path, dict]] = {}
        for mount in container.get("volumeMounts", []):
            name = mount["name"]
            assert name in volumes or name in claims, f"{where}: mount {name!r} has no volume"
            host = root / mount["mountPath"].strip("/")
            host.mkdir(parents=True, exist_ok=True)
            volume = volumes.get(name, {"persistentVolumeClaim": {"claimTemplate": name}})
            self.mounts[mount["mountPath"].rstrip("/")] = (host, volume)
            if "secret" in volume:
                sname = volume["secret"]["secretName"]
                assert sname in secrets, (f"{where}: no manifest or README command makes "
                                          f"secret {sname!r}")
                self._items(host, volume["secret"], secrets[sname], f"secret {sname!r}", where,
                            fake_file)
            elif "configMap" in volume:
                cname = volume["configMap"]["name"]
                assert cname in maps, f"{where}: no manifest makes config map {cname!r}"
                data = maps[cname].get("data", {})
                self._items(host, volume["configMap"], set(data), f"config map {cname!r}",
                            where, lambda key: data[key])
            elif "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"].get("claimName")
                assert claim is None or claim in pvcs, (f"{where}: no manifest makes "
                                                        f"PersistentVolumeClaim {claim!r}")
            else:
                assert "emptyDir" in volume, f"{where}: volume {name!r} of an unknown type"

    @staticmethod
    def _items(host: Path, source: dict, keys: set[str], what: str, where: str, content):
        items = source.get("items") or [{"key": k, "path": k} for k in sorted(keys)]
        for item in items:
            assert item["key"] in keys, f"{where}: {what} has no key {item['key']!r}"
            (host / item["path"]).write_text(content(item["key"]))

    def mount_of(self, path: str) -> Optional[tuple[str, Path, dict]]:
        best = max((m for m in self.mounts if path == m or path.startswith(m + "/")),
                   key=len, default=None)
        return None if best is None else (best, *self.mounts[best])

    def host(self, value: str) -> str:
        """A container path as it lies here; anything else unchanged."""
        found = self.mount_of(value)
        if found:
            mount, host, _ = found
            return str(host) + value[len(mount):]
        return image_path(value)


def image_path(value: str) -> str:
    """A path of the image's copy of the repository as it lies here; anything else unchanged."""
    return str(ROOT / value[len(IMAGE_ROOT):]) if value.startswith(IMAGE_ROOT) else value


# ------------------------------------------------------------------------- the commands
def command_of(argv: list[str]) -> tuple[click.Command, list[str], str]:
    if argv and argv[0] in cli.SUBCOMMANDS:
        module, _, attr = cli.SUBCOMMANDS[argv[0]].partition(":")
        return (getattr(importlib.import_module(module), attr), argv[1:],
                f"hspmd-launch {argv[0]}")
    return cli.launch_command, argv, "hspmd-launch"


def known_env(command: click.Command) -> set[str]:
    """The variables ``command`` reads: its options' and what the agent reads itself."""
    names = {ETCD_PASSWORD_ENV}
    for param in command.params:
        envvar = getattr(param, "envvar", None)
        names.update([envvar] if isinstance(envvar, str) else envvar or ())
    if command is cli.launch_command:
        names.update({*HangRule.variables(), DEVICE_ENV, ETCD_BINARY_ENV})
    return names


def check_env_names(command: click.Command, env: dict[str, str], where: str) -> None:
    for name in env:
        assert not name.startswith(OWN_ENV) or name in known_env(command), (
            f"{where}: env {name} is not a variable hspmd-launch reads")


def check_script_flags(argv: list[str], where: str) -> None:
    """The options after the training script (a file of this repository) are the script's."""
    script = next((Path(a) for a in argv if a.endswith(".py")), None)
    assert script and script.is_file() and ROOT in script.parents, f"{where}: no script"
    flags = set(re.findall(r"add_argument\(\s*\"(--[a-z0-9-]+)\"", script.read_text()))
    for arg in argv[argv.index(str(script)) + 1:]:
        assert not arg.startswith("--") or arg in flags, f"{where}: {script.name} has no {arg}"


@contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        for name in list(os.environ):
            if name.startswith(CLEARED_ENV):
                mp.delenv(name)
        for name, value in env.items():
            mp.setenv(name, value)
        yield


def parse(argv: list[str], env: dict[str, str], where: str) -> tuple[click.Command, dict]:
    """``argv`` (after ``hspmd-launch``) parsed by the real command under ``env``."""
    command, args, prog = command_of(argv)
    with environment(env):
        try:
            ctx = command.make_context(prog, list(args))
        except click.ClickException as exc:
            raise AssertionError(f"{where}: {prog} refuses {shlex.join(argv)}: "
                                 f"{exc.format_message()}") from None
        if command is not cli.launch_command and any(
                p.name == "ca_file" for p in command.params):
            with ctx:
                try:
                    subcommand_security(ctx)
                except click.ClickException as exc:
                    raise AssertionError(f"{where}: {exc.format_message()}") from None
    return command, ctx.params


@dataclass
class Launch:
    """One container that runs ``hspmd-launch``, parsed."""

    owner: dict
    pod: dict
    container: dict
    where: str
    raw: list[str]  # argv as written, $(VAR) unexpanded
    env: dict[str, str]  # the container's env, sample values for the downward API
    files: PodFiles
    command: click.Command
    params: dict
    config: object = None  # the agent's LaunchConfig (build_config)
    nproc_word: Optional[str] = None  # --nproc-per-node gpu|auto|...: needs the node's devices


def launches(docs: list[dict], readme: str, root: Path) -> list[Launch]:
    secrets, out = made_secrets(docs, readme), []
    for n, (owner, pod, container) in enumerate(containers(docs)):
        raw = launch_argv(container)
        if raw is None:
            continue
        where = f"{ident(owner)} container {container['name']}"
        env = pod_env(container, where, SAMPLE_FIELDS)
        files = PodFiles(root / str(n), owner, pod, container, docs, secrets)
        check_env_names(command_of(raw)[0], env, where)
        argv = [files.host(expand(a, env, where)) for a in raw]
        host_env = {k: files.host(v) for k, v in env.items()}
        command, params = parse(argv, host_env, where)
        launch = Launch(owner, pod, container, where, raw, env, files, command, dict(params))
        if command is cli.launch_command:
            # What counts or probes this machine's devices (not the pod's) is taken as given.
            word = str(params["nproc_per_node"])
            if word in cli.NPROC_WORDS:
                launch.nproc_word, params = word, {**params, "nproc_per_node": "1"}
            if params["hspmd_device"] == "cuda":
                params = {**params, "hspmd_device": "auto"}
            with environment(host_env):
                try:
                    launch.config = cli.build_config(dict(params))
                except ConfigError as exc:
                    raise AssertionError(f"{where}: hspmd-launch refuses it: {exc}") from None
        out.append(launch)
    return out


def agents(found: list[Launch]) -> list[Launch]:
    return [x for x in found if x.command is cli.launch_command]


def by_command(found: list[Launch], name: str) -> list[Launch]:
    return [x for x in found if x.command.name == name]


# ------------------------------------------------------------------------------ checks
def check_documents(docs: list[dict]) -> None:
    seen = set()
    for doc in docs:
        kind = doc.get("kind")
        assert kind in API_VERSIONS, f"{ident(doc)}: unknown kind"
        assert doc.get("apiVersion") == API_VERSIONS[kind], (
            f"{ident(doc)}: apiVersion {doc.get('apiVersion')}, not {API_VERSIONS[kind]}")
        name = doc["metadata"]["name"]
        assert NAME_RE.match(name) and len(name) <= 63, f"{ident(doc)}: bad name"
        assert ident(doc) not in seen, f"{ident(doc)} defined twice"
        seen.add(ident(doc))
        if kind == "Namespace":
            assert name == NAMESPACE
        else:
            assert doc["metadata"].get("namespace") == NAMESPACE, f"{ident(doc)}: namespace"
    assert f"Namespace/{NAMESPACE}" in seen, "the namespace is not made"


def check_wiring(docs: list[dict]) -> None:
    """Selectors, Services, issuers: each reference names something the manifests make."""
    labels = [(ident(o), o["spec"]["template"]["metadata"].get("labels", {}))
              for o, _ in workloads(docs)]

    def selects(selector: dict) -> list[str]:
        return [who for who, lab in labels if selector and selector.items() <= lab.items()]

    for owner, pod in workloads(docs):
        spec = owner["spec"]
        if owner["kind"] != "Job":
            assert spec["selector"]["matchLabels"].items() <= (
                spec["template"]["metadata"]["labels"].items()), f"{ident(owner)}: selector"
        else:
            assert pod["restartPolicy"] in ("Never", "OnFailure"), ident(owner)
        for c in pod["containers"]:
            assert c.get("image") and c.get("name"), f"{ident(owner)}: container fields"
    services = of_kind(docs, "Service")
    for svc in services.values():
        assert selects(svc["spec"]["selector"]), f"{ident(svc)} selects no pod"
        if svc["spec"].get("clusterIP") != "None":
            assert svc["spec"]["ports"], f"{ident(svc)}: no ports"
    for sts in of_kind(docs, "StatefulSet").values():
        svc = services.get(sts["spec"]["serviceName"])
        assert svc and svc["spec"].get("clusterIP") == "None", f"{ident(sts)}: no headless Service"
    for job in of_kind(docs, "Job").values():
        sub = job["spec"]["template"]["spec"].get("subdomain")
        if sub:
            svc = services.get(sub)
            assert svc and svc["spec"].get("clusterIP") == "None", f"{ident(job)}: subdomain"
            assert ident(job) in selects(svc["spec"]["selector"]), (
                f"{ident(svc)} misses {ident(job)}")
    for pdb in of_kind(docs, "PodDisruptionBudget").values():
        assert selects(pdb["spec"]["selector"]["matchLabels"]), f"{ident(pdb)} selects no pod"
    for pol in of_kind(docs, "NetworkPolicy").values():
        assert selects(pol["spec"]["podSelector"]["matchLabels"]), f"{ident(pol)} selects no pod"
    issuers = of_kind(docs, "Issuer")
    ca_secrets = {c["spec"]["secretName"] for c in of_kind(docs, "Certificate").values()
                  if c["spec"].get("isCA")}
    for cert in of_kind(docs, "Certificate").values():
        assert cert["spec"]["issuerRef"]["name"] in issuers, f"{ident(cert)}: no such issuer"
        assert cert["spec"]["secretName"], ident(cert)
    for issuer in issuers.values():
        assert ("selfSigned" in issuer["spec"]) != ("ca" in issuer["spec"]), ident(issuer)
        if "ca" in issuer["spec"]:
            assert issuer["spec"]["ca"]["secretName"] in ca_secrets, f"{ident(issuer)}: its CA"


def check_volumes(docs: list[dict], readme: str, root: Path) -> None:
    secrets = made_secrets(docs, readme)
    for n, (owner, pod, container) in enumerate(containers(docs)):
        where = f"{ident(owner)} container {container['name']}"
        env = pod_env(container, where, SAMPLE_FIELDS)
        for arg in [*container.get("command", []), *container.get("args", [])]:
            expand(str(arg), env, where)
        PodFiles(root / str(n), owner, pod, container, docs, secrets)


def etcd_args(container: dict) -> dict[str, str]:
    out = {}
    for arg in container["args"]:
        key, _, value = str(arg).partition("=")
        out[key] = value
    return out


def port_of(url: str) -> int:
    return urlsplit(url).port


def check_etcd(docs: list[dict], found: list[Launch]) -> None:
    sts = one(docs, "StatefulSet")
    spec, (container,) = sts["spec"], sts["spec"]["template"]["spec"]["containers"]
    assert spec["replicas"] == 3, f"{ident(sts)}: {spec['replicas']} replicas, not 3 members"
    args = etcd_args(container)
    members = dict(m.split("=", 1) for m in args["--initial-cluster"].split(","))
    names = [f"{sts['metadata']['name']}-{i}" for i in range(spec["replicas"])]
    assert sorted(members) == names, f"--initial-cluster {sorted(members)} is not 3 members"
    svc = of_kind(docs, "Service")[spec["serviceName"]]
    ports = {p["name"]: p["port"] for p in svc["spec"]["ports"]}
    cports = {p["name"]: p["containerPort"] for p in container["ports"]}
    domain = f"{spec['serviceName']}.{NAMESPACE}.svc"
    for name, flag in (("client", "--listen-client-urls"), ("peer", "--listen-peer-urls")):
        assert ports[name] == cports[name] == port_of(args[flag]), (
            f"{ident(svc)}: {name} port {ports[name]} is not {flag} {args[flag]}")
    assert args["--advertise-client-urls"] == f"https://$(POD_NAME).{domain}:{ports['client']}"
    assert args["--initial-advertise-peer-urls"] == f"https://$(POD_NAME).{domain}:{ports['peer']}"
    for name, url in members.items():
        assert url == f"https://{name}.{domain}:{ports['peer']}", f"--initial-cluster {url}"
    assert "--client-cert-auth" in args and "--trusted-ca-file" in args, "client certificates"
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == spec["replicas"] // 2 + 1, "PDB keeps no majority"
    # Every client names every member, at the Service's client port, by a name the members'
    # certificate holds (TLS checks it).
    want = {f"{n}.{domain}:{ports['client']}" for n in names}
    cert_file = args["--cert-file"]
    mount = next(m for m in container["volumeMounts"] if cert_file.startswith(m["mountPath"]))
    volume = next(v for v in spec["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    cert = next(c for c in of_kind(docs, "Certificate").values()
                if c["spec"]["secretName"] == volume["secret"]["secretName"])
    seen = []
    for launch in found:
        spec_ = (launch.config.rdzv.endpoints if launch.config else
                 launch.params["etcd_endpoints"].split(","))
        seen.append(launch.where)
        assert set(spec_) == want, f"{launch.where}: etcd endpoints {spec_}, not {sorted(want)}"
    users = of_kind(docs, "Job")["etcd-users"]["spec"]["template"]["spec"]["containers"][0]
    env = pod_env(users, "etcd-users", SAMPLE_FIELDS)
    assert {e.removeprefix("https://") for e in env["ETCDCTL_ENDPOINTS"].split(",")} == want
    for endpoint in want:
        assert endpoint.rsplit(":", 1)[0] in cert["spec"]["dnsNames"], f"{ident(cert)}: {endpoint}"
    assert len(seen) >= 2, "no hspmd-launch container talks to etcd"


def check_job(docs: list[dict], found: list[Launch]) -> None:
    (agent,) = agents(found)
    job, config, params = agent.owner, agent.config, agent.params
    spec, pod = job["spec"], agent.pod
    lo, hi = config.rdzv.min_nodes, config.rdzv.max_nodes
    pods = spec["completions"]
    assert spec["completionMode"] == "Indexed" and spec["parallelism"] == pods
    assert pods > hi, f"{pods} pods for --nnodes {lo}:{hi}: no spare"
    assert spec["maxFailedIndexes"] == pods - lo, "maxFailedIndexes is not pods - --nnodes MIN"
    assert spec["successPolicy"]["rules"][0]["succeededCount"] == lo, "succeededCount"
    assert pod["restartPolicy"] == "Never"
    assert Path(agent.container["command"][0]).name == "tini", "the agent as PID 1 reaps no orphan"
    grace = pod["terminationGracePeriodSeconds"]
    assert grace >= config.shutdown_timeout_s + 10, (
        f"terminationGracePeriodSeconds {grace} leaves no time after --shutdown-timeout "
        f"{config.shutdown_timeout_s:g}")
    # node identity: one id per completion index, each one hspmd-launch accepts
    flag = agent.raw[agent.raw.index("--hspmd-node-id") + 1]
    ids = set()
    for index in range(pods):
        fields = {**SAMPLE_FIELDS, COMPLETION_INDEX: str(index)}
        ids.add(cli._check_id("--hspmd-node-id",
                              expand(flag, pod_env(agent.container, agent.where, fields), "")))
    assert len(ids) == pods, f"--hspmd-node-id {flag} is not one id per index"
    assert config.local_addr == SAMPLE_FIELDS["status.podIP"], "--local-addr is not the pod IP"
    # the etcd user is the job's (its certificate's common name; the etcd-users Job's JOB_ID)
    assert config.rdzv.run_id == agent.env.get("HSPMD_JOB_ID", config.rdzv.run_id)
    cert_secret = agent.files.mount_of(agent.raw[agent.raw.index("--hspmd-etcd-cert") + 1])[2]
    cert = next(c for c in of_kind(docs, "Certificate").values()
                if c["spec"]["secretName"] == cert_secret["secret"]["secretName"])
    assert cert["spec"]["commonName"] == config.rdzv.run_id, f"{ident(cert)}: not the job's user"
    users = of_kind(docs, "Job")["etcd-users"]["spec"]["template"]["spec"]["containers"][0]
    env = pod_env(users, "etcd-users", SAMPLE_FIELDS)
    assert env["JOB_ID"] == config.rdzv.run_id, "etcd-users makes another job's user"
    script = users["args"][0].replace("$JOB_ID", env["JOB_ID"])
    assert f'readwrite "{job_prefix(env["JOB_ID"])}"' in script, "the role is not the job's prefix"
    # GPUs: --nproc-per-node gpu needs the pod's GPUs, elastic workers compute on them
    assert agent.nproc_word == "gpu", "--nproc-per-node is not one worker per GPU"
    assert not config.elastic.device_memory_bytes, "declared memory on real GPUs"
    gpus = agent.container["resources"]["limits"].get("nvidia.com/gpu")
    assert gpus and gpus > 0, "--nproc-per-node gpu without nvidia.com/gpu"
    assert params["hspmd_device"] == "cuda", "elastic workers may fall back to the CPU"
    # the script: its flags exist, it trains what the leader plans for, its state is shared
    check_script_flags(list(config.entrypoint), agent.where)
    args = list(config.entrypoint[3:])
    value = dict(zip(args, args[1:]))
    model = agent.raw[agent.raw.index("--hspmd-model") + 1]
    assert value["--config"] == agent.files.host(model), "--config is not --hspmd-model"
    assert int(value["--global-batch"]) == config.elastic.global_batch
    ModelConfig.from_json(Path(value["--config"]).read_text())
    pvcs = of_kind(docs, "PersistentVolumeClaim")
    for opt in ("--checkpoint-dir", "--out"):
        path = agent.raw[agent.raw.index(opt) + 1]
        found_ = agent.files.mount_of(path)
        assert found_, f"{opt} {path} is on no volume"
        claim = found_[2].get("persistentVolumeClaim", {}).get("claimName")
        assert claim and "ReadWriteMany" in pvcs[claim]["spec"]["accessModes"], (
            f"{opt} {path} is not on a volume every pod shares")


def check_dashboard(docs: list[dict], found: list[Launch]) -> None:
    (dash,) = by_command(found, "dashboard")
    params = dash.params
    svc = next(s for s in of_kind(docs, "Service").values()
               if s["spec"]["selector"].items() <= dash.owner["spec"]["template"]["metadata"]
               ["labels"].items())
    cports = {p["name"]: p["containerPort"] for p in dash.container["ports"]}
    for port in svc["spec"]["ports"]:
        target = port["targetPort"]
        assert cports.get(target, target) == params["port"], (
            f"{ident(svc)}: targetPort {target} is not --port {params['port']}")
    assert params["token"], "the dashboard serves off loopback without --token-file"
    names = set(params["allow_hosts"])
    name = svc["metadata"]["name"]
    assert {name, f"{name}.{NAMESPACE}.svc"} <= names, "--allow-host misses the Service's names"
    assert params["job"] == agents(found)[0].config.rdzv.run_id, "the dashboard shows another job"


def check_all(docs: list[dict], readme: str, root: Path) -> None:
    check_documents(docs)
    check_wiring(docs)
    check_volumes(docs, readme, root / "volumes")
    found = launches(docs, readme, root / "files")
    check_etcd(docs, found)
    check_job(docs, found)
    check_dashboard(docs, found)


def readme_commands(text: str) -> list[tuple[str, list[str], object]]:
    """Every ``hspmd-launch`` line of the README's shell blocks, with the workload it is
    ``kubectl exec``'d in (None: run anywhere), and every container of its YAML blocks that
    runs ``hspmd-launch`` (the container itself)."""
    out = []
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S):
        if lang in ("bash", "sh"):
            for line in body.replace("\\\n", " ").splitlines():
                if "hspmd-launch" not in line:
                    continue
                words = shlex.split(line, comments=True)
                target = re.search(r"\bexec (?:-\w+ )*(?:deploy|job|statefulset)/([\w-]+)", line)
                out.append((line.strip(), words[words.index("hspmd-launch") + 1:],
                            target and target.group(1)))
        elif lang == "yaml":
            for doc in yaml.safe_load_all(body):
                if isinstance(doc, dict) and launch_argv(doc) is not None:
                    out.append((f"yaml block {doc.get('name')}", launch_argv(doc), doc))
    return out
