"""The autotuner in virtual time: the offline contest (Auto against static settings and
replica-only autoscalers), its rivals, a PromQL subset over the simulator's series, and the
`kvpilot autotune simulate|contest` commands. It judges the policy; the policy never imports it."""
