"""`kvpilot operator` / `kvpilot crd` are registered without importing kopf."""
from __future__ import annotations

import subprocess
import sys


def test_cli_module_imports_nothing_heavy():
    code = ("import sys, argparse; import kvpilot.operator.cli as c; "
            "c.add_parser(argparse.ArgumentParser().add_subparsers()); "
            "heavy = [m for m in ('kopf', 'kubernetes', 'torch', 'prometheus_client') if m in sys.modules]; "
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_operator_flags():
    import argparse

    from kvpilot.operator.cli import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    a = parser.parse_args(["operator", "-n", "a", "--namespace", "b", "--metrics-port", "0"])
    assert a.namespace == ["a", "b"] and a.metrics_port == 0 and a.liveness_port == 8081
    assert parser.parse_args(["operator", "--all-namespaces"]).all_namespaces
    assert parser.parse_args(["crd"]).command == "crd"


def test_handlers_register_with_kopf():
    code = ("import kopf, kvpilot.operator.handlers as h; r = kopf.get_default_registry(); "
            "print(len(r._changing.get_all_handlers()), len(r._spawning.get_all_handlers()), "
            "len(r._watching.get_all_handlers()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    changing, spawning, watching = map(int, out.split())
    assert changing >= 3 and spawning == 0 and watching == 1  # no timer: no finalizer


def test_engine_defaults_reach_every_pod_the_operator_builds():
    """The chart's engine values -> `kvpilot operator` flags -> the environment reconcile reads:
    an image upgrade rolls pods that name none; a spec's own values still win."""
    import argparse

    import pytest

    from kvpilot.operator.cli import add_parser, engine_defaults
    from kvpilot.operator.manifests.deployment import build_deployment
    from kvpilot.operator.manifests.objects import Owner
    from kvpilot.operator.reconcile import parse_spec
    from kvpilot.operator.api.defaults import OperatorDefaults

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["operator", "--engine-image", "reg.example/kvpilot/engine:0.2.0",
                              "--gpu-resource-name", "amd.com/gpu", "--engine-defaults", json_defaults()])
    env = {"KVPILOT_ENGINE_DEFAULTS": engine_defaults(args)}
    defaults = OperatorDefaults.from_env(env)

    def pod(spec):
        return build_deployment(Owner("m", "demo", "u"), parse_spec({"spec": spec}, defaults), 1)[
            "spec"]["template"]["spec"]
    p = pod({"model": {"source": "builtin:tiny"}, "resources": {"gpus": 1}})
    c = p["containers"][0]
    assert c["image"] == "reg.example/kvpilot/engine:0.2.0" and c["resources"]["limits"]["amd.com/gpu"] == "1"
    assert p["imagePullSecrets"] == [{"name": "regcred"}] and p["serviceAccountName"] == "llm"
    assert p["automountServiceAccountToken"] is True
    assert p["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    assert "runAsUser" not in c["securityContext"]  # OpenShift assigns the ids
    assert p["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists"}]
    p = pod({"model": {"source": "builtin:tiny"}, "engine": {"image": "mine:1"},
             "pod": {"labels": {"team": "b"}, "imagePullSecrets": ["other"]}})
    assert p["containers"][0]["image"] == "mine:1" and p["imagePullSecrets"] == [{"name": "other"}]
    assert parse_spec({"spec": {"model": {"source": "builtin:tiny"}, "pod": {"labels": {"team": "b"}}}},
                      defaults).pod.labels == {"team": "b", "tier": "llm"}
    args.engine_defaults = '{"pod": {"serviceAccountName": "Not A Name"}}'
    with pytest.raises(ValueError, match="--engine-defaults"):
        engine_defaults(args)


def json_defaults() -> str:
    import json

    return json.dumps({"pod": {"imagePullSecrets": ["regcred"], "serviceAccountName": "llm",
                               "labels": {"team": "a", "tier": "llm"},
                               "securityContext": {"runAsNonRoot": True}},
                       "scheduling": {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]}})
