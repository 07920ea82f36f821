"""Simulated GPU pods on the local cluster: an LLMDeployment with engine.simulate becomes
Ready on a pod that requests nvidia.com/gpu, answers completions, says it is simulated
(status, column, metrics), stays small, answers /health through `kubectl port-forward`; and the demo's story, on its fast timings, ends
with the autotuner having fixed the deployment."""
from __future__ import annotations

import re
import select
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from demo_story import FAST, Story
from test_operator import condition, diagnose

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "llmdeployment-simulated.yaml"
LLMD = "/apis/serving.kvpilot.dev/v1alpha1/namespaces/{ns}/llmdeployments/{name}"
MAX_SIMULATED_RSS = 200 * 2**20


def _metric(text: str, name: str) -> float | None:
    m = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


def apply_example(cluster, kube, namespace: str, wait_for, path: Path) -> tuple[str, dict]:
    """Apply an example LLMDeployment in `namespace` (Prometheus: the cluster's); its name and
    its object once Ready."""
    m = yaml.safe_load(path.read_text())
    m["metadata"]["namespace"] = namespace
    m["spec"].setdefault("autotune", {}).setdefault("prometheus", {})["url"] = cluster.prometheus_url
    name = m["metadata"]["name"]
    cluster.apply(m)

    def ready():
        obj = kube.get(LLMD.format(ns=namespace, name=name), ok404=True)
        return obj if condition(obj, "Ready").get("status") == "True" else None
    try:
        return name, wait_for(ready, timeout=300, interval=1, what=f"{path.name} to be Ready")
    except TimeoutError:
        raise AssertionError(diagnose(cluster, namespace)) from None


def test_a_simulated_llmdeployment_is_ready_answers_and_says_so(cluster, tuned_operator, namespace, wait_for):
    kube = tuned_operator
    name, obj = apply_example(cluster, kube, namespace, wait_for, EXAMPLE)
    assert obj["status"]["simulated"] == "h100-80gb/llama-3.1-8b"
    assert "simulated h100-80gb" in condition(obj, "Ready")["message"]
    row = cluster.kubectl("get", "llmd", name, "-n", namespace).stdout
    assert "SIMULATED" in row.splitlines()[0] and "h100-80gb/llama-3.1-8b" in row

    pods = kube.get(f"/api/v1/namespaces/{namespace}/pods",
                    params={"labelSelector": f"serving.kvpilot.dev/llmdeployment={name}"})["items"]
    (pod,) = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    container = pod["spec"]["containers"][0]
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert pod["metadata"]["labels"]["serving.kvpilot.dev/simulated"] == "true"
    assert "--simulate" in container["args"]
    url = f"http://{pod['status']['podIP']}:8000"
    r = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": "llama-3.1-8b", "prompt": "Hello from a simulated GPU", "max_tokens": 20, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 20 and r.json()["choices"][0]["text"]

    text = httpx.get(f"{url}/metrics", timeout=10).text
    assert 'kvpilot:simulated_info{accelerator="h100-80gb",model="llama-3.1-8b"' in text
    kv = _metric(text, "kvpilot:kv_cache_bytes")
    assert 50 * 2**30 < kv < 60 * 2**30  # 80 GB x 0.9 - 15 GiB of weights - reserve
    rss = _metric(text, "process_resident_memory_bytes")
    print(f"\nsimulated H100 pod (Llama-3.1-8B): RSS {rss / 2**20:.0f} MiB, KV cache {kv / 2**30:.1f} GiB")
    assert rss < MAX_SIMULATED_RSS
    assert port_forwarded_health(cluster, namespace, pod["metadata"]["name"]) == 200


def port_forwarded_health(cluster, namespace: str, pod: str) -> int:
    """GET /health through `kubectl port-forward` (which connects to the pod's localhost: the
    engine must listen there too, not only on the pod IP)."""
    pf = subprocess.Popen([str(cluster.bin_dir / "kubectl"), f"--kubeconfig={cluster.kubeconfig}",
                           "port-forward", "-n", namespace, f"pod/{pod}", ":8000"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        ready, _, _ = select.select([pf.stdout], [], [], 30)
        assert ready, "kubectl port-forward printed nothing in 30 s"
        line = pf.stdout.readline()  # "Forwarding from 127.0.0.1:PORT -> 8000"
        assert "127.0.0.1:" in line, line
        port = int(line.split("127.0.0.1:")[1].split()[0])
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code
    finally:
        pf.terminate()
        pf.wait(timeout=10)


def test_a_simulated_70b_over_four_gpus_is_one_engine_with_all_their_kv(cluster, tuned_operator, namespace,
                                                                       wait_for):
    """resources.gpus: 4 on a model that does not fit one GPU: the pod requests four, the
    engine gets --tensor-parallel-size 4, and its KV cache is the four GPUs' together."""
    kube = tuned_operator
    name, obj = apply_example(cluster, kube, namespace, wait_for, ROOT / "examples" / "llmdeployment-simulated-70b.yaml")
    assert obj["status"]["simulated"] == "4xh100-80gb/llama-3.1-70b"
    assert "simulated 4xh100-80gb" in condition(obj, "Ready")["message"]
    pods = kube.get(f"/api/v1/namespaces/{namespace}/pods",
                    params={"labelSelector": f"serving.kvpilot.dev/llmdeployment={name}"})["items"]
    (pod,) = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    container = pod["spec"]["containers"][0]
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "4"
    args = container["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "4"
    url = f"http://{pod['status']['podIP']}:8000"
    r = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": "llama-3.1-70b", "prompt": "Hello from four simulated GPUs", "max_tokens": 16, "ignore_eos": True})
    assert r.status_code == 200, r.text
    text = httpx.get(f"{url}/metrics", timeout=10).text
    kv = _metric(text, "kvpilot:kv_cache_bytes")
    print(f"\nsimulated 4x H100 pod (Llama-3.1-70B, tensor parallel 4): KV cache {kv / 2**30:.1f} GiB; "
          f"Ready: {condition(obj, 'Ready')['message']}")
    # 4 x (80 GB x 0.9 - a quarter of 131 GiB of weights - activations - reserve): about 150 GiB.
    assert 140 * 2**30 < kv < 160 * 2**30


def test_the_demo_story_on_its_fast_path(cluster, tuned_operator, tmp_path):
    story = Story(cluster, FAST, tmp_path, real_engine=False)  # as make demo runs it; the real
    # engine's answer on builtin:tiny is test_operator's test_example_serves_completions
    try:
        result = story.run()
    finally:
        story.stop()
        story.delete()
    print("\n" + "\n".join(result.summary))
    assert result.fixed, "\n".join(result.summary)
    raises = [c for c in result.changes if "maxNumSeqs" in c.change]
    assert raises and all(b > a for a, b in (c.change["maxNumSeqs"] for c in raises))
    assert result.after["req_per_s"] > 2 * result.before["req_per_s"]
    assert result.png.exists()
