// Module of the Pod sandbox's pause program. See e2e/pause/build.sh.
module kvpilot.local/e2e/pause

go 1.26.0
