"""Pod addresses 10.K.x.y in the cluster's pod network (see ../podnet.py),
added to its loopback device while the pod lives."""
from __future__ import annotations

import threading

from ..podnet import PodNetwork


class Ipam:
    def __init__(self, net: PodNetwork):
        self.net = net
        self.lock = threading.Lock()
        self.used: dict[str, str] = {}  # pod uid -> ip
        self.next = 1

    def allocate(self, uid: str) -> str:
        with self.lock:
            if uid in self.used:
                return self.used[uid]
            taken = set(self.used.values())
            for _ in range(254 * 254):
                n, self.next = self.next, self.next % (254 * 254 - 1) + 1
                ip = f"10.{self.net.octet}.{n // 254}.{n % 254 + 1}"
                if ip not in taken:
                    self.used[uid] = ip
                    break
            else:
                raise RuntimeError("no free pod address")
        self.net.add_address(ip)
        return ip

    def release(self, uid: str) -> None:
        with self.lock:
            ip = self.used.pop(uid, None)
        if ip:
            self.net.del_address(ip)
