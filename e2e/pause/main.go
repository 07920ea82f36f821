// Command pause is the Pod sandbox's first process, like registry.k8s.io/pause:
// it holds the Pod's namespaces, reaps the zombies that are reparented to it
// (as the namespace's PID 1), and exits 0 on SIGINT or SIGTERM. Otherwise it
// waits forever.
package main

import (
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

// version is set by build.sh.
var version = "dev"

func main() {
	if len(os.Args) == 2 && os.Args[1] == "-v" {
		fmt.Println("kvpilot pause", version)
		return
	}
	if os.Getpid() != 1 {
		fmt.Fprintln(os.Stderr, "Warning: pause should be the first process")
	}
	signals := make(chan os.Signal, 8)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range signals {
		if s != syscall.SIGCHLD {
			fmt.Fprintf(os.Stderr, "Shutting down, got signal: %v\n", s)
			os.Exit(0)
		}
		// Several exits can make one SIGCHLD: reap until none is left.
		for {
			var status syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
			if err == syscall.EINTR {
				continue
			}
			if pid <= 0 {
				break
			}
		}
	}
}
