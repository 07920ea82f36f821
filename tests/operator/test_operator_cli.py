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
