"""examples/kubernetes/README.md cannot drift from the manifests nor from the CLI
(``tests/_k8s.py``): every ``hspmd-launch`` line it shows is accepted by the CLI with the
environment and files of the pod it runs in, the agent's line is job.yaml's, and the manifests
are applied in order.
"""

from __future__ import annotations

import pytest

from _k8s import (MANIFESTS, SAMPLE_FIELDS, PodFiles, agents, check_env_names,
                  check_script_flags, command_of, containers, expand, image_path, launches,
                  made_secrets, parse, pod_env, readme_commands)
from _k8s import docs, readme  # noqa: F401  (fixtures)

from launcher import cli

pytestmark = pytest.mark.timeout(60)


def test_readme_commands_are_accepted_by_the_cli(docs, readme, tmp_path):
    """Each line with the environment and files of the pod it runs in."""
    secrets = made_secrets(docs, readme)
    found = readme_commands(readme)
    assert {command_of(argv)[0].name for _, argv, _ in found} >= {"hspmd-launch", "status"}
    for n, (line, argv, where) in enumerate(found):
        env, host = {}, image_path
        if isinstance(where, dict):  # a container spec of the README
            env = pod_env(where, line, SAMPLE_FIELDS)
            check_env_names(command_of(argv)[0], env, line)
        elif where:  # kubectl exec in a workload of the manifests
            owner, pod, container = next(x for x in containers(docs)
                                         if x[0]["metadata"]["name"] == where)
            env = pod_env(container, line, SAMPLE_FIELDS)
            host = PodFiles(tmp_path / str(n), owner, pod, container, docs, secrets).host
        argv = [host(expand(a, env, line)) for a in argv]
        command, _ = parse(argv, {k: host(v) for k, v in env.items()}, f"README: {line}")
        if command is cli.launch_command:
            check_script_flags(argv, f"README: {line}")


def test_readme_shows_the_agents_command_line(docs, readme, tmp_path):
    """The agent's line in the README is the manifest's, with the first pod's values."""
    (agent,) = agents(launches(docs, readme, tmp_path))
    argv = [expand(a, agent.env, agent.where) for a in agent.raw]
    shown = [a for _, a, where in readme_commands(readme)
             if where is None and command_of(a)[0] is cli.launch_command]
    assert argv in shown, "README: the agent's command line differs from job.yaml's"


def test_readme_applies_the_manifests_in_order(readme):
    order = [readme.find(f"kubectl apply -f {name}") for name in MANIFESTS]
    assert -1 not in order and order == sorted(order), "README: apply etcd, job, dashboard"
