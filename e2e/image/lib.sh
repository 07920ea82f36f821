# Shared by the scripts in e2e/image/: progress goes to stderr with a timestamp, so stdout
# carries only each script's result (the last line) and users see what a long build does.

log() { printf '%s [image] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

# Copies a command's output to stderr, each line stamped (use as `cmd 2>&1 | ts_stderr`).
ts_stderr() {
    local line
    while IFS= read -r line; do printf '%s   %s\n' "$(date -u +%H:%M:%S)" "$line" >&2; done
}
