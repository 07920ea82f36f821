"""Scale from zero through the gateway, on the local cluster with a real tiny-model pod
(builtin:tiny on this CPU): N cold starts, each from a deployment at zero replicas with
no pod left, of a burst of streamed requests sent to the gateway; the time from the
first request to its first token, and every request's outcome (none may be dropped).

    flock /tmp/kvpilot-e2e.lock .venv/bin/python e2e/scale_from_zero_bench.py --cold-starts 20

Uses the cluster in .cluster/ when one runs there (`make cluster-up`), else starts one and
stops it at the end. Between cold starts the benchmark itself sets replicas 0 (the
autotuner's idle rule would take scaleToZeroAfter each time; e2e/test_gateway.py covers it)."""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvsession as ks  # noqa: E402
from kvsession import log, run_to_exit_code  # noqa: E402

NS = "kvpilot-cold"
NAME = "tiny"
LLMD = f"/apis/serving.kvpilot.dev/v1alpha1/namespaces/{NS}/llmdeployments/{NAME}"


def pods_left(kube) -> int:
    pods = kube.get(f"/api/v1/namespaces/{NS}/pods",
                    params={"labelSelector": f"serving.kvpilot.dev/llmdeployment={NAME}"})["items"]
    return len(pods)


async def burst(url: str, n: int) -> list[tuple[int | None, float | None, str]]:
    """(status, seconds to the first token, error) per request, sent at once."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def one(i: int):
            start = time.perf_counter()
            body = {"model": NAME, "prompt": f"cold start {i}", "max_tokens": 8, "ignore_eos": True, "stream": True}
            try:
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    first, text = None, ""
                    async for chunk in r.aiter_text():
                        text += chunk
                        if first is None and '"text"' in chunk:
                            first = time.perf_counter() - start
                    ok = r.status_code == 200 and text.rstrip().endswith("[DONE]") and "upstream_failed" not in text
                    return r.status_code, first, "" if ok else text[-200:]
            except httpx.HTTPError as e:
                return None, None, f"{type(e).__name__}: {e}"
        return await asyncio.gather(*(one(i) for i in range(n)))


class Bench:
    def __init__(self, args) -> None:
        self.args = args
        self.cluster = None
        self.started = False

    def run(self) -> int:
        a = self.args
        self.cluster, self.started = ks.open_cluster(Path(a.cluster_dir))
        ks.install_operator(self.cluster, values={"gateway.enabled": "true"})
        kube = self.cluster.kube()
        self.cluster.create_namespace(NS)
        m = ks.llmd_manifest(NS, NAME, {"maxNumSeqs": 8, "maxModelLen": 512, "kvCacheMemory": "32Mi"},
                             {"mode": "Off"}, replicas=0, autoscaling={"minReplicas": 0, "maxReplicas": 1})
        self.cluster.apply(m)
        url = ks.wait_for(lambda: ks.gateway_url(kube, NAME), timeout=180, interval=1,
                          what="the gateway to list the deployment")
        log(f"gateway {url}; {a.cold_starts} cold starts of {a.burst} streamed requests each (real tiny-model pod)")
        firsts, dropped, sent = [], 0, 0
        for i in range(a.cold_starts):
            kube.merge_patch(LLMD + "/scale", {"spec": {"replicas": 0}})
            ks.wait_for(lambda: pods_left(kube) == 0, timeout=180, interval=0.5, what="no pod left")
            ks.wait_for(lambda: ks.gateway_sees_no_replica(url, NAME), timeout=30, interval=0.5,
                        what="the gateway to see no ready replica")
            answers = asyncio.run(burst(url, a.burst))
            sent += len(answers)
            bad = [x for x in answers if x[0] != 200 or x[2]]
            dropped += len(bad)
            ttft = min((t for _, t, _ in answers if t is not None), default=None)
            firsts.append(ttft)
            log(f"cold start {i + 1:>2}/{a.cold_starts}: first token after "
                f"{ttft:.1f} s; {len(answers) - len(bad)}/{len(answers)} answered" if ttft is not None else
                f"cold start {i + 1}: no token; {bad[:2]}")
        ok = [t for t in firsts if t is not None]
        log(f"scale from zero through the gateway, {len(firsts)} cold starts of a real tiny-model pod: time to "
            f"first token p50 {statistics.median(ok):.1f} s, min {min(ok):.1f} s, max {max(ok):.1f} s; "
            f"dropped {dropped} of {sent} requests")
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        wakes = [line for line in metrics.splitlines() if line.startswith("kvpilot_gateway_scale_from_zero_total")]
        log(f"gateway: {wakes}")
        return 0 if dropped == 0 and len(ok) == len(firsts) else 1

    def cleanup(self) -> None:
        if self.cluster is None:
            return
        if self.started and not self.args.keep:
            self.cluster.stop()
        else:
            self.cluster.kubectl("delete", "namespace", NS, "--wait=false", check=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cold-starts", type=int, default=20)
    p.add_argument("--burst", type=int, default=4, help="requests sent at once to the deployment at zero")
    p.add_argument("--cluster-dir", default=str(ks.ROOT / ".cluster"))
    p.add_argument("--keep", action="store_true")
    return run_to_exit_code(Bench(p.parse_args(argv)), "the scale-from-zero benchmark")


if __name__ == "__main__":
    sys.exit(main())
