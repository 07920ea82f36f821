// Command kvpilot-device-plugin advertises N simulated GPUs to the kubelet
// through its device-plugin API (k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1),
// so that pods can request e.g. nvidia.com/gpu on a node without GPUs. A
// container given devices gets KVPILOT_SIMULATED_GPU_IDS=gpu-0,... in its
// environment and nothing else: no device nodes, no NVIDIA_* variables.
//
// The kubelet's registration socket is always
// /var/lib/kubelet/device-plugins/kubelet.sock (pluginapi.KubeletSocket; the
// kubelet's --root-dir does not move it). The plugin serves its own socket in
// the same folder, registers, and serves and registers again whenever the
// kubelet re-creates kubelet.sock (a kubelet restart also deletes the plugin's
// socket).
package main

import (
	"context"
	"flag"
	"log"
	"os"
	"os/signal"
	"syscall"
	"time"

	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

func main() {
	var cfg config
	flag.StringVar(&cfg.resource, "resource", "nvidia.com/gpu", "extended resource name to advertise")
	flag.IntVar(&cfg.count, "count", 1, "number of simulated devices")
	flag.StringVar(&cfg.dir, "plugin-dir", pluginapi.DevicePluginPath,
		"the kubelet's device-plugin folder, holding kubelet.sock")
	flag.DurationVar(&cfg.poll, "poll", time.Second, "how often to check that kubelet.sock is unchanged")
	flag.Parse()
	log.SetOutput(os.Stderr)
	log.SetPrefix("kvpilot-device-plugin: ")
	if cfg.count < 0 || cfg.resource == "" {
		log.Fatal("--count must be >= 0 and --resource nonempty")
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, cfg); err != nil {
		log.Fatal(err)
	}
	log.Print("stopped")
}
