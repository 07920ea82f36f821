package main

import (
	"context"
	"errors"
	"fmt"
	"log"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// EnvVar is what Allocate puts in a container's environment: the ids of its
// simulated devices, comma-separated.
const EnvVar = "KVPILOT_SIMULATED_GPU_IDS"

type config struct {
	resource string        // e.g. nvidia.com/gpu
	count    int           // devices gpu-0 .. gpu-(count-1)
	dir      string        // the kubelet's device-plugin folder
	poll     time.Duration // how often to look at kubelet.sock
}

func (c config) kubeletSocket() string { return filepath.Join(c.dir, "kubelet.sock") }

// socketName is the plugin's own socket in c.dir, e.g. kvpilot-nvidia.com-gpu.sock.
func (c config) socketName() string {
	return "kvpilot-" + strings.ReplaceAll(c.resource, "/", "-") + ".sock"
}

// plugin implements the kubelet's DevicePlugin service for simulated devices,
// all of them always healthy.
type plugin struct {
	pluginapi.UnimplementedDevicePluginServer
	devices []*pluginapi.Device
	stop    chan struct{} // closed when this server stops; ends ListAndWatch
}

func newPlugin(count int) *plugin {
	p := &plugin{stop: make(chan struct{})}
	for i := range count {
		p.devices = append(p.devices, &pluginapi.Device{ID: fmt.Sprintf("gpu-%d", i), Health: pluginapi.Healthy})
	}
	return p
}

func (p *plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{GetPreferredAllocationAvailable: true}, nil
}

// ListAndWatch sends the device list once; it never changes, so the stream
// then stays open until the kubelet or this plugin ends it.
func (p *plugin) ListAndWatch(_ *pluginapi.Empty, s grpc.ServerStreamingServer[pluginapi.ListAndWatchResponse]) error {
	if err := s.Send(&pluginapi.ListAndWatchResponse{Devices: p.devices}); err != nil {
		return err
	}
	select {
	case <-s.Context().Done():
	case <-p.stop:
	}
	return nil
}

// GetPreferredAllocation prefers the required devices, then the lowest ids offered.
func (p *plugin) GetPreferredAllocation(_ context.Context, r *pluginapi.PreferredAllocationRequest) (*pluginapi.PreferredAllocationResponse, error) {
	resp := &pluginapi.PreferredAllocationResponse{}
	for _, c := range r.ContainerRequests {
		ids := append([]string{}, c.MustIncludeDeviceIDs...)
		for _, id := range c.AvailableDeviceIDs {
			if len(ids) >= int(c.AllocationSize) {
				break
			}
			if !slices.Contains(ids, id) {
				ids = append(ids, id)
			}
		}
		resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerPreferredAllocationResponse{DeviceIDs: ids})
	}
	return resp, nil
}

// Allocate only tells the container which simulated devices it got.
func (p *plugin) Allocate(_ context.Context, r *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	resp := &pluginapi.AllocateResponse{}
	for _, c := range r.ContainerRequests {
		for _, id := range c.DevicesIds {
			if !p.has(id) {
				return nil, fmt.Errorf("unknown device %q", id)
			}
		}
		log.Printf("allocate %v", c.DevicesIds)
		resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerAllocateResponse{
			Envs: map[string]string{EnvVar: strings.Join(c.DevicesIds, ",")},
		})
	}
	return resp, nil
}

func (p *plugin) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}

func (p *plugin) has(id string) bool {
	return slices.ContainsFunc(p.devices, func(d *pluginapi.Device) bool { return d.ID == id })
}

// run serves and registers until ctx ends, starting over whenever kubelet.sock
// is replaced (a kubelet restart) or the plugin's socket disappears.
func run(ctx context.Context, cfg config) error {
	for {
		kubelet, err := waitForFile(ctx, cfg.kubeletSocket(), cfg.poll)
		if err != nil {
			return nil // ctx ended
		}
		p := newPlugin(cfg.count)
		srv, err := serve(cfg, p)
		if err != nil {
			return err
		}
		if err = register(ctx, cfg); err != nil {
			err = fmt.Errorf("registering with %s: %w; retrying", cfg.kubeletSocket(), err)
		} else {
			log.Printf("registered %s (%d devices) with %s", cfg.resource, cfg.count, cfg.kubeletSocket())
			err = watch(ctx, cfg, kubelet)
		}
		close(p.stop)
		srv.Stop()
		if ctx.Err() != nil {
			os.Remove(filepath.Join(cfg.dir, cfg.socketName()))
			return nil
		}
		log.Print(err)
		sleep(ctx, cfg.poll)
	}
}

// serve listens on the plugin's socket, replacing a stale one.
func serve(cfg config, p *plugin) (*grpc.Server, error) {
	path := filepath.Join(cfg.dir, cfg.socketName())
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	ln, err := net.Listen("unix", path)
	if err != nil {
		return nil, err
	}
	srv := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(srv, p)
	go srv.Serve(ln)
	return srv, nil
}

// register tells the kubelet about the plugin's socket (relative to cfg.dir).
func register(ctx context.Context, cfg config) error {
	conn, err := grpc.NewClient("unix://"+cfg.kubeletSocket(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version:      pluginapi.Version,
		Endpoint:     cfg.socketName(),
		ResourceName: cfg.resource,
		Options:      &pluginapi.DevicePluginOptions{GetPreferredAllocationAvailable: true},
	})
	return err
}

// watch returns when kubelet.sock is no longer the file it was, or when the
// plugin's own socket is gone (the kubelet deletes it on start).
func watch(ctx context.Context, cfg config, kubelet os.FileInfo) error {
	own := filepath.Join(cfg.dir, cfg.socketName())
	for sleep(ctx, cfg.poll) {
		if fi, err := os.Stat(cfg.kubeletSocket()); err != nil || !os.SameFile(fi, kubelet) {
			return fmt.Errorf("%s was re-created or removed; registering again", cfg.kubeletSocket())
		}
		if _, err := os.Stat(own); err != nil {
			return fmt.Errorf("%s was removed; serving and registering again", own)
		}
	}
	return nil
}

func waitForFile(ctx context.Context, path string, poll time.Duration) (os.FileInfo, error) {
	logged := false
	for {
		if fi, err := os.Stat(path); err == nil {
			return fi, nil
		} else if !logged {
			log.Printf("waiting for %s", path)
			logged = true
		}
		if !sleep(ctx, poll) {
			return nil, ctx.Err()
		}
	}
}

// sleep waits d and reports whether ctx is still live.
func sleep(ctx context.Context, d time.Duration) bool {
	select {
	case <-ctx.Done():
		return false
	case <-time.After(d):
		return true
	}
}
