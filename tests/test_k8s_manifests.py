"""examples/kubernetes/ cannot drift from the CLI, nor from itself (``tests/_k8s.py`` reads and
checks it; no cluster needed): every document is a kind this project deploys with the fields it
needs; every mount and reference resolves; every ``hspmd-launch`` line of the manifests is
accepted by the CLI; etcd, the Job and the dashboard agree with their flags. Modified copies in
memory show that each check fails.
"""

from __future__ import annotations

import copy

import pytest

from _k8s import (check_all, check_dashboard, check_documents, check_etcd, check_job,
                  check_volumes, check_wiring, launches, of_kind)
from _k8s import docs, readme  # noqa: F401  (fixtures)

pytestmark = pytest.mark.timeout(60)


def test_every_document_is_a_known_kind_with_its_fields(docs):
    check_documents(docs)
    check_wiring(docs)
    kinds = {d["kind"] for d in docs}
    assert {"StatefulSet", "Job", "Deployment", "Service", "Certificate"} <= kinds


def test_every_mount_and_reference_resolves(docs, readme, tmp_path):
    check_volumes(docs, readme, tmp_path)


def test_every_hspmd_launch_line_is_accepted_by_the_cli(docs, readme, tmp_path):
    found = launches(docs, readme, tmp_path)
    assert sorted(x.command.name for x in found) == ["dashboard", "hspmd-launch"]


def test_etcd_is_three_members_at_the_endpoints_the_clients_use(docs, readme, tmp_path):
    check_etcd(docs, launches(docs, readme, tmp_path))


def test_job_agrees_with_its_flags(docs, readme, tmp_path):
    check_job(docs, launches(docs, readme, tmp_path))


def test_dashboard_service_token_and_hosts(docs, readme, tmp_path):
    check_dashboard(docs, launches(docs, readme, tmp_path))


def _agent(d):
    return of_kind(d, "Job")["hspmd-job42"]["spec"]["template"]["spec"]


def _swap(items: list, old, new) -> None:
    items[items.index(old)] = new


MUTATIONS = {
    "a flag the CLI does not have": (
        lambda d: _swap(_agent(d)["containers"][0]["args"], "--rdzv-endpoint",
                        "--rdzv-endpoints"), r"(?i)no such option '--rdzv-endpoints'"),
    "no spare": (
        lambda d: _swap(_agent(d)["containers"][0]["args"], "2:2", "2:3"), r"no spare"),
    "a dashboard flag the CLI does not have": (
        lambda d: _swap(of_kind(d, "Deployment")["hspmd-dashboard"]["spec"]["template"]["spec"]
                        ["containers"][0]["args"], "--token-file", "--token"),
        r"(?i)no such option '--token'"),
    "a bad flag value": (
        lambda d: _swap(_agent(d)["containers"][0]["args"], "2:2", "3:2"),
        r"invalid --nnodes value"),
    "an environment variable the CLI does not read": (
        lambda d: _agent(d)["containers"][0]["env"].append(
            {"name": "HSPMD_HANG_STARTUP", "value": "900"}),
        r"HSPMD_HANG_STARTUP is not a variable"),
    "an undefined $(VAR)": (
        lambda d: _swap(_agent(d)["containers"][0]["args"], "$(POD_IP)", "$(POD_ADDR)"),
        r"\$\(POD_ADDR\) is not defined"),
    "a Service port that is not etcd's": (
        lambda d: of_kind(d, "Service")["etcd"]["spec"]["ports"][0].update(port=2378),
        r"client port 2378"),
    "a missing secret": (
        lambda d: _agent(d)["volumes"][0]["secret"].update(secretName="job42-tls"),
        r"makes secret 'job42-tls'"),
    "a mount without a volume": (
        lambda d: _agent(d)["volumes"].pop(1), r"mount 'model' has no volume"),
    "five etcd members": (
        lambda d: of_kind(d, "StatefulSet")["etcd"]["spec"].update(replicas=5),
        r"5 replicas, not 3"),
    "a grace period shorter than --shutdown-timeout": (
        lambda d: _agent(d).update(terminationGracePeriodSeconds=30),
        r"leaves no time after --shutdown-timeout"),
    "a script flag the script does not have": (
        lambda d: _swap(_agent(d)["containers"][0]["args"], "--checkpoint-every",
                        "--checkpoint-interval"),
        r"elastic_llama.py has no --checkpoint-interval"),
    "a dashboard port the Service does not reach": (
        lambda d: of_kind(d, "Deployment")["hspmd-dashboard"]["spec"]["template"]["spec"]
        ["containers"][0]["ports"][0].update(containerPort=8471),
        r"targetPort http is not --port 8470"),
}


def test_the_unmodified_manifests_pass_every_check(docs, readme, tmp_path):
    check_all(docs, readme, tmp_path)


@pytest.mark.parametrize("what", sorted(MUTATIONS))
def test_a_modified_copy_fails(docs, readme, tmp_path, what):
    mutate, message = MUTATIONS[what]
    broken = copy.deepcopy(docs)
    mutate(broken)
    with pytest.raises(AssertionError, match=message):
        check_all(broken, readme, tmp_path)
