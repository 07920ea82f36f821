"""$(VAR) expansion with the kubelet's rules (k8s.io/kubernetes/third_party/
forked/golang/expansion): $(NAME) is replaced when NAME is known, $$ stands for a
literal $, and unknown references are left as they are."""
from __future__ import annotations

from typing import Mapping


def expand(s: str, env: Mapping[str, str]) -> str:
    out: list[str] = []
    i, n = 0, len(s)
    while i < n:
        c = s[i]
        if c == "$" and i + 1 < n:
            nxt = s[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                end = s.find(")", i + 2)
                if end != -1:
                    name = s[i + 2:end]
                    out.append(env[name] if name in env else s[i:end + 1])
                    i = end + 1
                    continue
                out.append(s[i:])
                break
            out.append(c + nxt)
            i += 2
            continue
        out.append(c)
        i += 1
    return "".join(out)
