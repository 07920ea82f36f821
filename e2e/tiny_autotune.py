"""Helpers for e2e tests that autotune real `kvpilot serve` pods on builtin:tiny (the engine
image): a deployment in its own namespace, load from `kvpilot bench serve` in a thread, and the
autotuner's report read back (test_operator_ha and test_operator_faults use them; the autotuner's
own cases run on simulated pods, test_autotune, which reads its report with these helpers too)."""
from __future__ import annotations

import asyncio
import threading
import uuid


from kvpilot.engine.bench.serve import BenchConfig, benchmark
from test_operator import diagnose, engine_pods, is_ready, llmd


INTERVAL, WINDOW, COOLDOWN = "3s", "10s", "5s"


class Load:
    """`kvpilot bench serve` against one pod, in a thread, until stopped."""

    def __init__(self, pod: dict, concurrency: int, input_len: int, output_len: int):
        self.cfg = BenchConfig(base_url=f"http://{pod['status']['podIP']}:8000", model="tiny",
                               random_input_len=input_len, random_output_len=output_len,
                               num_prompts=3000, max_concurrency=concurrency, disable_tqdm=True,
                               timeout_s=600)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.task: asyncio.Task | None = None
        self.started = threading.Event()

    def _run(self) -> None:
        async def main():
            self.loop, self.task = asyncio.get_running_loop(), asyncio.current_task()
            self.started.set()
            try:
                await benchmark(self.cfg)
            except asyncio.CancelledError:
                pass
        asyncio.run(main())

    def __enter__(self) -> "Load":
        self.thread.start()
        self.started.wait(10)
        return self

    def stop(self) -> None:
        if self.loop is not None and self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.task.cancel)
        self.thread.join(30)

    def __exit__(self, *exc) -> None:
        self.stop()


def deploy(cluster, kube, wait_for, *, seqs: int, seqs_range: tuple[int, int], kv: str,
           max_replicas: int = 1, mode: str = "Auto") -> tuple[str, dict]:
    ns = f"at-{uuid.uuid4().hex[:6]}"
    cluster.create_namespace(ns)
    cluster.apply({
        "apiVersion": "serving.kvpilot.dev/v1alpha1", "kind": "LLMDeployment",
        "metadata": {"name": "tiny", "namespace": ns},
        "spec": {"model": {"source": "builtin:tiny", "servedName": "tiny"},
                 "engine": {"maxNumSeqs": seqs, "maxModelLen": 512, "maxNumBatchedTokens": 512,
                            "blockSize": 16, "kvCacheMemory": kv},
                 "resources": {"gpus": 0, "cpu": "500m", "memory": "1Gi"},
                 "replicas": 1, "autoscaling": {"minReplicas": 1, "maxReplicas": max_replicas},
                 "autotune": {"mode": mode, "interval": INTERVAL, "window": WINDOW, "cooldown": COOLDOWN,
                              "prometheus": {"url": cluster.prometheus_url},
                              "maxNumSeqs": {"min": seqs_range[0], "max": seqs_range[1]},
                              "maxModelLen": {"min": 128, "max": 512}}}})
    try:
        wait_for(lambda: is_ready(kube, ns) and engine_pods(kube, ns), timeout=300, interval=1,
                 what="the LLMDeployment to be Ready")
    except TimeoutError:
        raise AssertionError(diagnose(cluster, ns)) from None
    (pod,) = engine_pods(kube, ns)
    return ns, pod


def autotune(kube, ns: str, name: str = "tiny") -> dict:
    """status.autotune of LLMDeployment `name` (test_autotune's is `sim`)."""
    return ((llmd(kube, ns, name) or {}).get("status") or {}).get("autotune") or {}


def applied_changes(kube, ns: str, setting: str, name: str = "tiny") -> list[dict]:
    return [d for d in autotune(kube, ns, name).get("history", [])
            if setting in d.get("change", {}) and d.get("applied")]


def events(kube, ns: str, reason: str) -> list[dict]:
    items = kube.get(f"/api/v1/namespaces/{ns}/events")["items"]
    return [e for e in items if e.get("reason") == reason and e["involvedObject"].get("kind") == "LLMDeployment"]


def trail(kube, ns: str, name: str = "tiny") -> str:
    """The autotuner's report, for a failure message."""
    st = autotune(kube, ns, name)
    lines = [f"diagnoses: {st.get('recentDiagnoses')}", f"last: {st.get('lastDecision')}",
             f"snapshot: {st.get('snapshot')}", f"capacity: {(st.get('capacity') or {}).get('summary')}"]
    lines += [f"  {d['time']} {d['action']} {d['change']} applied={d.get('applied')} "
              f"verified={d.get('verified')}: {d['reason']}" for d in st.get("history", [])]
    return "\n".join(lines)


def until(wait_for, kube, ns: str, predicate, timeout: float, what: str):
    try:
        return wait_for(predicate, timeout=timeout, interval=1, what=what)
    except TimeoutError as e:
        raise AssertionError(f"{e}\n{trail(kube, ns)}") from None


def auto_once_loaded(cluster, kube, wait_for, ns: str, loaded) -> None:
    """Recommend until the autotuner's own window shows steady load (`loaded(snapshot)`),
    then Auto: the first change's baseline (and so its verification) is not read from the
    load's ramp-up, which would make any change look like it made things worse."""
    until(wait_for, kube, ns, lambda: loaded(autotune(kube, ns).get("snapshot") or {}), timeout=90,
          what="a window of steady load")
    cluster.kubectl("patch", "llmd", "tiny", "-n", ns, "--type=merge", "-p", '{"spec":{"autotune":{"mode":"Auto"}}}')


def cleanup(cluster, ns: str) -> None:
    """Delete the namespace and wait (bounded) until it is gone: the next case's verification
    compares throughput across a change, and a pod still shutting down beside it on this
    2-core host takes CPU from the window it judges."""
    cluster.kubectl("delete", "namespace", ns, "--wait=true", "--timeout=110s", check=False, timeout=130)
