package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

func buildPause(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "pause")
	cmd := exec.Command("go", "build", "-o", bin, ".")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

func TestExitsZeroOnSignal(t *testing.T) {
	bin := buildPause(t)
	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGINT} {
		cmd := exec.Command(bin)
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		time.Sleep(200 * time.Millisecond) // let it install its handlers
		start := time.Now()
		cmd.Process.Signal(sig)
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("%v: %v", sig, err)
			}
			t.Logf("%v: exited 0 after %v", sig, time.Since(start))
		case <-time.After(2 * time.Second):
			cmd.Process.Kill()
			t.Fatalf("%v: still running after 2s", sig)
		}
	}
}

// TestReapsZombies runs pause as PID 1 of a new PID namespace, leaves an
// orphan in it that exits, and checks that pause collected it.
func TestReapsZombies(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root for a PID namespace")
	}
	for _, tool := range []string{"unshare", "nsenter"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skip(tool, " not found")
		}
	}
	bin := buildPause(t)
	ns := exec.Command("unshare", "--pid", "--fork", "--kill-child", bin)
	if err := ns.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { ns.Process.Kill(); ns.Wait() }()

	var pid string // pause's PID outside the namespace: unshare's child
	for i := 0; i < 50 && pid == ""; i++ {
		time.Sleep(50 * time.Millisecond)
		pid = children(strconv.Itoa(ns.Process.Pid))
	}
	if pid == "" {
		t.Fatal("pause did not start")
	}
	// sh exits at once; its background sleep is reparented to pause and exits soon after.
	if out, err := exec.Command("nsenter", "-t", pid, "-p", "--", "sh", "-c", "sleep 0.3 >/dev/null 2>&1 & exit 0").CombinedOutput(); err != nil {
		t.Fatalf("nsenter: %v\n%s", err, out)
	}
	adopted := false
	for i := 0; i < 40; i++ {
		time.Sleep(50 * time.Millisecond)
		if kids := children(pid); kids != "" {
			adopted = true
		} else if adopted {
			return // the orphan came and was reaped
		}
	}
	t.Fatalf("pause's children after 2s: %q (adopted: %v); zombies are not reaped", children(pid), adopted)
}

// children lists the children of a process, as /proc has them (zombies included).
func children(pid string) string {
	b, _ := os.ReadFile("/proc/" + pid + "/task/" + pid + "/children")
	return strings.TrimSpace(string(b))
}
