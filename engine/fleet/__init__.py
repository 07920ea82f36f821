"""The fleet simulator: replicas of the simulated engine on a virtual clock, traces and
scenarios, scoring, calibration against published figures, and `kvpilot sim`."""
